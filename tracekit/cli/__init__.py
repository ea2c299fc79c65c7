"""The `tracekit` command line: every command lives in this package, one module per command group
(``analysis``, ``ingest``, ``memory``, ``estimate``, ``dashboard``), each rendering what the library
returns; this file wires them (``train`` and ``numerics`` are the trainer's and the numerics' own).

Exit codes: 0 ok; 1 a finding in check modes (e.g. a straggler or mismatch where one was asked
not to exist); 2 bad input (unreadable or invalid files, impossible configs); 130 interrupted
(Ctrl-C: one line, no traceback).
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from tracekit import __version__
from tracekit.cli._common import interrupted

# (module, attribute, summary) of each subcommand, imported lazily so that `tracekit --help` stays
# fast (the summaries are here, not read from the commands: listing them imported torch, DuckDB and
# Panel, 3.4 s) and a broken optional dependency of one command does not take the others down. A
# summary is the first line of its command's docstring (tests/test_cli.py holds them together).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "estimate": ("tracekit.cli.estimate", "estimate_command",
                 "Estimate per-GPU memory of a Llama model under 4D parallelism (Fujii et al. 2024)."),
    "memory": ("tracekit.cli.memory", "memory_command",
               "Per-rank peak memory, when it happened, what was live at it, imbalance across ranks, and"),
    "numerics": ("numerics.cli", "main",
                 "Numerics checks for parallel training: accumulation order, bit-exactness, BF16/FP32 buffers."),
    "train": ("reference_trainer.cli", "train_command",
              "Train the reference model on a spawned world of ranks and write a run directory."),
    "ingest": ("tracekit.cli.ingest", "ingest_cmd",
               "Ingest run directories, trace folders or single files into a store or a Parquet dataset."),
    "stragglers": ("tracekit.cli.analysis", "stragglers_command",
                   "Which rank made the run slow, and why (top-down DP -> PP -> CP -> TP, then root cause)."),
    "cp-wait": ("tracekit.cli.analysis", "cp_wait_command",
                "Exposed CP communication: waiting vs transfer, and what the waiting is due to."),
    "steps": ("tracekit.cli.analysis", "steps_command",
              "Step times per rank, the slow steps and what made each slow."),
    "hangs": ("tracekit.cli.analysis", "hangs_command",
              "Where the ranks stopped (flight-recorder entries) and which never joined."),
    "report": ("tracekit.cli.analysis", "report_command", "Everything: stragglers, steps, CP wait and hangs."),
    "demo": ("tracekit.cli.analysis", "demo_command",
             "Train the reference model with rank 3 computing 3x slower, ingest, report culprit and cause"),
    "simulate": ("tracekit.cli.simulate", "simulate_command",
                 "Simulate a 4D-parallel NCCL job: its traces and ground truth, or its tables for large worlds."),
    "export": ("tracekit.cli.export", "export_group",
               "Export a stored run for other tools: a Chrome-JSON trace for Perfetto."),
    "whatif": ("tracekit.cli.whatif", "whatif_command",
               "How fast the step would be without its stragglers: replay, ideal step, slowdown by part."),
    "dashboard": ("tracekit.cli.dashboard", "dashboard_command",
                  "Serve the dashboard for a tracekit store, or for a run directory (ingested on the fly)."),
}


# Environment defaults for the libraries the commands load, set before they are imported:
# - No command does large linear algebra, but numpy (imported by pyarrow and polars) starts
#   OpenBLAS's thread pool, which spins for about 0.2 CPU-s (a one-file ingest: 0.89 CPU-s with
#   it, 0.61-0.67 without), on the core the ingest's other worker needs.
# - Arrow's default allocator (mimalloc) faults in fresh pages for each Kineto batch: at 8 ranks
#   of 61 MB, the system allocator saves 0.2-0.45 CPU-s (most of it kernel time) and 20-45 MB of
#   peak memory (docs/ingest.md).
PROCESS_DEFAULTS = {"OPENBLAS_NUM_THREADS": "1", "ARROW_DEFAULT_MEMORY_POOL": "system"}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(map(len, COMMANDS))
        rows = [(name, click.utils.make_default_short_help(COMMANDS[name][2], limit)) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        for var, value in PROCESS_DEFAULTS.items():  # before pyarrow and numpy load; the user's own win
            os.environ.setdefault(var, value)
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx: click.Context) -> object:
        """Ctrl-C anywhere in a command (an import, an ingest, an analysis, the dashboard's server):
        one line and exit code 130, not click's "Aborted!" with exit code 1, which means a finding.
        Ingest's own cleanup (workers stopped, whole files only) has run by the time it arrives here."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            interrupted()
        except ValueError as e:  # a store found damaged after it opened (a dataset's bad part file)
            store = sys.modules.get("tracekit.store")  # loaded if any store was opened
            if store is not None and isinstance(e, store.StoreError):
                from tracekit.cli._common import fail

                fail(str(e))
            raise
        except Exception as e:
            if _query_interrupted(e):
                interrupted()
            raise


def _query_interrupted(e: BaseException) -> bool:
    """DuckDB turns a Ctrl-C that lands inside a query into its own error (a RuntimeError "Query
    interrupted" from the relation API, or InterruptException): the user's interrupt all the same."""
    duckdb = sys.modules.get("duckdb")
    return (duckdb is not None and isinstance(e, getattr(duckdb, "InterruptException", ()))) or \
        str(e).strip() == "Query interrupted"


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="tracekit")
def main() -> None:
    """Debug 4D-parallel training jobs: stragglers, hangs, memory and numerics."""
