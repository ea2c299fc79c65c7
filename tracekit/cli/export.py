"""`tracekit export`: a stored run in other tools' formats (a Chrome-JSON trace for Perfetto)."""

from __future__ import annotations

from pathlib import Path

import click

from tracekit.cli._common import fail


def parse_ids(text: str | None, what: str) -> list[int] | None:
    """'0,3,8-11' -> [0, 3, 8, 9, 10, 11]; None stays None (all)."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise click.BadParameter(f"{what} must look like 0,3,8-11, not {text!r}") from None
    return out


@click.group("export")
def export_group() -> None:
    """Export a stored run for other tools: a Chrome-JSON trace for Perfetto."""


@export_group.command("perfetto")
@click.argument("store", type=click.Path(exists=True, path_type=Path))  # a DuckDB file or a dataset dir
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The trace to write (.json, or .json.gz compressed).")
@click.option("--run", "run_id", default=None, help="Run id (default: the newest).")
@click.option("--ranks", default=None, help="Ranks to include, e.g. 0,3,8-11 (default: all).")
@click.option("--steps", default=None, help="Steps to include, e.g. 2-4 (default: all).")
def perfetto_command(store: Path, out: Path, run_id: str | None, ranks: str | None, steps: str | None) -> None:
    """Write one clock-aligned Chrome-JSON trace of the chosen ranks with the findings annotated
    (open it in ui.perfetto.dev or chrome://tracing)."""
    from tracekit.perfetto import write_chrome_trace
    from tracekit.store import Store, StoreError

    rank_ids, step_ids = parse_ids(ranks, "--ranks"), parse_ids(steps, "--steps")
    try:
        with Store(store, read_only=True) as st:
            per_rank = write_chrome_trace(st, out, run_id, rank_ids, step_ids)
    except StoreError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{out}: cannot write ({e.strerror or e})")
    click.echo(f"{sum(per_rank.values()):,} spans of {len(per_rank)} ranks -> {out} (open in ui.perfetto.dev)")
