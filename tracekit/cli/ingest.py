"""`tracekit ingest`: the command-line face of tracekit.ingest.pipeline (rendering only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from tracekit.cli._common import EXIT_BAD_INPUT, EXIT_OK, fail, ingest_progress
from tracekit.ingest.common import IngestError


@click.command("ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--store", "store_path", default=None, type=click.Path(path_type=Path),
              help="DuckDB store to create or add to.")
@click.option("--out", "out_dir", default=None, type=click.Path(path_type=Path),
              help="Parquet dataset directory to create or add to (instead of --store; docs/dataset.md).")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="With --out: parse in threads here, or one Ray task per file (or batch of small files).")
@click.option("--address", default=None,
              help="With --engine ray: the Ray cluster (ray://host:10001, or 'auto' for the one this machine "
                   "belongs to; default: start Ray on this machine).")
@click.option("--run-id", default=None, help="Run id for every file (default: manifest, else directory name).")
@click.option("--workers", type=int, default=None, help="Parser threads (default: one per core).")
@click.option("--processes/--threads", "processes", default=None,
              help="Each worker parses in a child process of its own, or in its thread (default: processes "
                   "on many cores and large inputs, where threads contend for the GIL).")
@click.option("--limit", "limit_settings", multiple=True, metavar="NAME=VALUE",
              help="Raise or lower a limit on one file, e.g. max_event_bytes=64MiB (repeatable; the limits and "
                   "their defaults are in docs/ingest.md, 'Limits').")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def ingest_cmd(paths: tuple[Path, ...], store_path: Path | None, out_dir: Path | None, engine: str,
               address: str | None, run_id: str | None, workers: int | None, processes: bool | None,
               limit_settings: tuple[str, ...], as_json: bool) -> None:
    """Ingest run directories, trace folders or single files into a store or a Parquet dataset.

    A DuckDB store file (--store) or a Parquet dataset directory (--out, optionally written on Ray
    with --engine ray).

    Formats are recognized by content: Kineto traces (.json/.json.gz, NCCL or gloo), flight-recorder
    dumps (pickle or JSON), memory snapshots (pickle) and op-table traces (parquet). Exit code 2 if
    any file failed; the others are still ingested.
    """
    import os

    from tracekit.ingest import limits
    from tracekit.ingest.pipeline import ingest
    from tracekit.store import StoreError

    if (store_path is None) == (out_dir is None):
        fail("give one of --store FILE (a DuckDB store) or --out DIR (a Parquet dataset)")
    if out_dir is None and (engine != "local" or address is not None):
        fail("--engine ray and --address write a Parquet dataset: give --out DIR instead of --store")
    for assignment in limit_settings:  # in the environment, so that the parser processes see them too
        try:
            var, value = limits.setting(assignment)
        except ValueError as e:
            fail(str(e))
        os.environ[var] = str(value)
    with ingest_progress(as_json) as progress:
        try:
            if out_dir is not None:
                from tracekit.ingest import on_ray, to_dataset

                try:
                    report = to_dataset.ingest(list(paths), out_dir, run_id=run_id, engine=engine, workers=workers,
                                               address=address, progress=progress)
                finally:
                    on_ray.stop_ray()  # now rather than at exit, where Ray waits 0.5 s first
            else:
                report = ingest(list(paths), store_path, run_id=run_id, workers=workers, progress=progress,
                                processes=processes)
        except (IngestError, StoreError, ValueError) as e:  # the store cannot be opened, no input, no fork
            fail(str(e))
        except RuntimeError as e:  # on_ray.EngineUnavailable: no Ray, or it cannot start or connect
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if not report.files:
        fail(f"nothing to ingest in {', '.join(map(str, paths))}: no traces, flight-recorder dumps, memory "
             "snapshots or op tables" + (f" ({len(report.ignored)} other files passed over)" if report.ignored else ""))
    missing = {f"{r}/{f}": ranks for (r, f), ranks in report.missing.items()}
    if as_json:
        click.echo(json.dumps({
            "files": [{"path": str(f.path), "run_id": f.run_id, "format": f.format, "rank": f.rank,
                       "status": f.status, "error": f.error, "rows": f.rows} for f in report.files],
            "missing_ranks": missing, "warnings": report.warnings, "runs": report.runs, "ignored": [str(p) for p in report.ignored],
            "seconds": round(report.seconds, 3), "bytes": report.bytes_ingested},
            indent=2))
    else:
        _render(report, missing)
    sys.exit(EXIT_BAD_INPUT if report.failed else EXIT_OK)


def _render(report: object, missing: dict[str, list[int]]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from tracekit.ingest.topo import ranges_text

    out = Console()
    t = Table(title="ingested")
    for c in ("run", "format", "files", "rows", "skipped", "failed"):
        t.add_column(c, justify="right" if c in ("files", "rows", "skipped", "failed") else "left")
    groups: dict[tuple[str, str], list] = {}
    for f in report.files:  # type: ignore[attr-defined]
        groups.setdefault((f.run_id, f.format or "?"), []).append(f)
    for (run, fmt), fs in sorted(groups.items()):
        t.add_row(run, fmt, str(sum(f.status == "ok" for f in fs)), str(sum(f.rows for f in fs)),
                  str(sum(f.status == "skipped" for f in fs)), str(sum(f.status == "failed" for f in fs)))
    out.print(t)
    n, mb, sec = len(report.ok), report.bytes_ingested / 1e6, report.seconds  # type: ignore[attr-defined]
    out.print(f"{n} file{'' if n == 1 else 's'}, {mb:,.1f} MB in {sec:.1f} s"
              + (f" ({mb / sec:,.0f} MB/s)" if n and sec > 0 else ""), highlight=False)
    for key, ranks in missing.items():
        out.print(f"[yellow]warning:[/yellow] {key}: ranks missing: {ranges_text(ranks)} ({len(ranks)})")
    for w in report.warnings:  # type: ignore[attr-defined]
        out.print(f"[yellow]warning:[/yellow] {escape(w)}", soft_wrap=True, highlight=False)
    for f in report.failed:  # type: ignore[attr-defined]
        out.print(f"[red]failed:[/red] {escape(f.error or '')}", soft_wrap=True, highlight=False)
    ignored = report.ignored  # type: ignore[attr-defined]
    if ignored:
        out.print(f"passed over {len(ignored)} file{'s' if len(ignored) > 1 else ''} not recognized as traces: "
                  f"{escape(_grouped(ignored))}", soft_wrap=True, highlight=False)


def _grouped(paths: list[Path], most: int = 6) -> str:
    """Paths under their common folder, several files of one subfolder as 'sub/ (n files)'."""
    import os
    from collections import Counter

    paths = [p.absolute() for p in paths]  # commonpath refuses relative and absolute mixed
    root = Path(os.path.commonpath([p.parent for p in paths]))
    parts = [p.relative_to(root).parts for p in paths]
    per_dir = Counter(ps[0] for ps in parts if len(ps) > 1)
    items: list[str] = []
    for ps in parts:
        if len(ps) > 1 and per_dir[ps[0]] > 1:
            item = f"{ps[0]}/ ({per_dir[ps[0]]} files)"
        else:
            item = str(Path(*ps))
        if item not in items:
            items.append(item)
    shown = ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")
    return f"{root}: {shown}"
