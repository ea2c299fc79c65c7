"""The `tracekit` command line. Commands live next to the code they render; this file wires them.

Exit codes: 0 ok; 1 a finding in check modes (e.g. a straggler or mismatch where one was asked
not to exist); 2 bad input (unreadable or invalid files, impossible configs).
"""

from __future__ import annotations

import importlib
import os

import click

from tracekit import __version__

# (module, attribute) of each subcommand, imported lazily so `tracekit --help` stays fast and a
# broken optional dependency of one command does not take the others down.
COMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("tracekit.memory.estimate_cli", "estimate_command"),
    "memory": ("tracekit.memory.cli", "memory_command"),
    "numerics": ("numerics.cli", "main"),
    "train": ("reference_trainer.cli", "train_command"),
    "ingest": ("tracekit.ingest.cli", "ingest_cmd"),
    "stragglers": ("tracekit.analysis_cli", "stragglers_command"),
    "cp-wait": ("tracekit.analysis_cli", "cp_wait_command"),
    "steps": ("tracekit.analysis_cli", "steps_command"),
    "hangs": ("tracekit.analysis_cli", "hangs_command"),
    "report": ("tracekit.analysis_cli", "report_command"),
    "demo": ("tracekit.analysis_cli", "demo_command"),
    "dashboard": ("tracekit.dashboard_cli", "dashboard_command"),
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

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        for var, value in PROCESS_DEFAULTS.items():  # before pyarrow and numpy load; the user's own win
            os.environ.setdefault(var, value)
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="tracekit")
def main() -> None:
    """Debug 4D-parallel training jobs: stragglers, hangs, memory and numerics."""
