"""`tracekit memory STORE`: per-rank peak memory, what was live at the peak, and imbalance, rendered
from tracekit.analysis.memory over a store's memory_events (and memory_segments, steps, runs)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import polars as pl

from tracekit.analysis.memory import MemoryDataError, analyse, imbalance
from tracekit.topology import Layout, LayoutError

MIB = 1024**2


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1024**3:.2f} GiB" if abs(n) >= 1024**3 else f"{n / MIB:.2f} MiB"


def load_tables(store: Path, run_id: str | None) -> tuple[str, dict[str, pl.DataFrame], Layout | None]:
    """The run's memory tables from a DuckDB store (read-only), and its layout when recorded."""
    import duckdb

    if not store.is_file():
        raise MemoryDataError(f"{store}: no such store file")
    try:
        con = duckdb.connect(str(store), read_only=True)
    except duckdb.Error as e:
        raise MemoryDataError(f"{store}: not a DuckDB store ({e})") from None
    try:
        have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "memory_events" not in have:
            raise MemoryDataError(f"{store}: has no memory_events table (ingest a memory snapshot first)")
        runs = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM memory_events ORDER BY 1").fetchall()]
        if run_id is None:
            if len(runs) != 1:
                raise MemoryDataError(f"{store}: memory events of {len(runs)} runs {runs}; pick one with --run-id")
            run_id = runs[0]
        elif run_id not in runs:
            raise MemoryDataError(f"{store}: no memory events for run {run_id!r}; runs: {runs}")
        # a relation's .pl() stays columnar (arrow), no Python row objects
        tables = {t: con.sql(f"SELECT * FROM {t} WHERE run_id = ?", params=[run_id]).pl()
                  for t in ("memory_events", "memory_segments", "steps") if t in have}
        if "events" in have:  # only the spans that carry a phase (the trainer's tk.compute spans)
            tables["spans"] = con.sql("SELECT rank, ts_ns, dur_ns, phase, microbatch, vstage, name, run_id"
                                      " FROM events WHERE run_id = ? AND phase IS NOT NULL",
                                      params=[run_id]).pl()
        layout = None
        if "runs" in have:
            row = con.execute("SELECT tp, cp, pp, dp FROM runs WHERE run_id = ?", [run_id]).fetchone()
            if row is not None and None not in row:
                layout = Layout(*row)
    finally:
        con.close()
    return run_id, tables, layout


def _render(run_id: str, pk: pl.DataFrame, live: pl.DataFrame) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    t = Table(title=f"peak allocated per rank, run {run_id}")
    for col in ("rank", "pp", "peak", "vs mean", "when", "allocated by", "baseline",
                "reserved at peak", "fragmentation"):
        t.add_column(col, justify="left" if col == "allocated by" else "right")
    for r in pk.iter_rows(named=True):
        when = " ".join(x for x in (
            f"step {r['peak_step']}" if r.get("peak_step") is not None else "",
            f"{r['peak_phase']} mb {r['peak_microbatch']}" if r.get("peak_phase") is not None else "",
            f"(entry {r['peak_seq']})") if x)
        frag = r["fragmentation_at_peak"]
        t.add_row(str(r["rank"]), str(r.get("pp", "-")), _size(r["peak_allocated"]),
                  f"{r['vs_run_mean']:.2f}x" if r.get("vs_run_mean") is not None else "-", when,
                  f"{r['peak_frame']} ({r['peak_category']})", _size(r["baseline_allocated"]),
                  _size(r["reserved_at_peak"]), "-" if frag is None else f"{frag:.0%}")
    console.print(t)
    cats = live.pivot(on="category", index="rank", values="bytes", aggregate_function="sum").sort("rank")
    t = Table(title="live at the peak, by category")
    for col in cats.columns:
        t.add_column(col, justify="right")
    for r in cats.iter_rows():
        t.add_row(str(r[0]), *(_size(v) if v is not None else "-" for v in r[1:]))
    console.print(t)
    console.print("allocation sites live at the peak: --by frame")


@click.command("memory")
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--run-id", help="run to analyse (needed when the store holds several)")
@click.option("--by", type=click.Choice(["category", "frame"]), default="category", show_default=True,
              help="group what was live at the peak by category or by allocation site")
@click.option("--top", type=int, default=10, show_default=True, help="rows per rank with --by frame")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def memory_command(store: Path, run_id: str | None, by: str, top: int, as_json: bool) -> None:
    """Per-rank peak memory, when it happened, what was live at it, and imbalance across ranks."""
    from rich.console import Console

    status = Console(stderr=True).status  # a spinner on a terminal, silent otherwise
    try:
        with status(f"reading {store}"):
            run_id, tables, layout = load_tables(store, run_id)
        events = tables["memory_events"]
        with status(f"analysing {events.height:,} allocator events of run {run_id}"):
            result = analyse(events, segments=tables.get("memory_segments"), steps=tables.get("steps"),
                             spans=tables.get("spans"))
        pk = result.peaks if layout is None else imbalance(result.peaks, layout)
        live = result.live_at_peak(by=by)
    except (MemoryDataError, LayoutError) as e:
        raise click.UsageError(str(e)) from e
    if by == "frame":
        live = live.group_by("rank", maintain_order=True).head(top)
    if as_json:
        click.echo(json.dumps({"run_id": run_id, "layout": layout.as_dict() if layout else None,
                               "peaks": pk.to_dicts(), f"live_by_{by}": live.to_dicts()},
                              indent=1, default=str))
    elif by == "frame":
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"live at the peak by allocation site, run {run_id}")
        for col in ("rank", "site", "bytes", "blocks", "share"):
            t.add_column(col, justify="left" if col == "site" else "right")
        for r in live.iter_rows(named=True):
            t.add_row(str(r["rank"]), r["frame"], _size(r["bytes"]), str(r["blocks"]), f"{r['share']:.0%}")
        Console(width=160).print(t)
    else:
        _render(run_id, pk, live)
