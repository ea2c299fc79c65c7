"""`tracekit memory STORE`: per-rank peak memory, what was live at the peak, imbalance, and for a
reference-trainer run the estimate next to the measured peak by component, rendered from
tracekit.analysis.memory and tracekit.memory.compare over a store's memory tables
(tracekit.analysis.memory_tables)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import polars as pl

from tracekit.analysis.memory import MemoryDataError, analyse, imbalance
from tracekit.analysis.memory_tables import load_tables
from tracekit.memory.compare import COMPARED, MemoryComparison, trainer_comparison
from tracekit.memory.llama_dims import EstimateError
from tracekit.topology import LayoutError

MIB = 1024**2
COMPONENT_NOTE = {
    "weights": "parameters, in the compute dtype",
    "gradients": "accumulation buffer, reduce-scatter shard, last step's reduced shard",
    "optimizer": "fp32 master shard and AdamW moments",
    "activations": "kept for backward by the micro-batches in flight (paper terms + attention matrices)",
    "other": "temporaries and uncategorized blocks: no estimator term",
}


def _size(n: float | None, signed: bool = False) -> str:
    if n is None:
        return "-"
    sign = "+" if signed and n > 0 else ""
    for unit, scale in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def _when(r: dict) -> str:
    return " ".join(x for x in (
        f"step {r['peak_step']}" if r.get("peak_step") is not None else "",
        f"{r['peak_phase']} mb {r['peak_microbatch']}" if r.get("peak_phase") is not None else "",
        f"(entry {r['peak_seq']})") if x)


def _render(run_id: str, pk: pl.DataFrame, live: pl.DataFrame, console) -> None:
    from rich.table import Table

    t = Table(title=f"peak allocated per rank, run {run_id}")
    for col in ("rank", "pp", "peak", "vs mean", "when", "allocated by", "baseline",
                "reserved at peak", "fragmentation"):
        t.add_column(col, justify="left" if col == "allocated by" else "right")
    for r in pk.iter_rows(named=True):
        frag = r["fragmentation_at_peak"]
        t.add_row(str(r["rank"]), str(r.get("pp", "-")), _size(r["peak_allocated"]),
                  f"{r['vs_run_mean']:.2f}x" if r.get("vs_run_mean") is not None else "-", _when(r),
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


def _render_comparison(cmp: MemoryComparison, console) -> None:
    from rich.table import Table

    cfg = cmp.config
    desc = (f"tp{cfg.get('tp')} cp{cfg.get('cp')} pp{cfg.get('pp')} dp{cfg.get('dp')}, "
            f"{cfg.get('compute_dtype')} compute / {cfg.get('grad_accum_dtype')} gradients, "
            f"ZeRO-{cfg.get('zero_stage')}, {cfg.get('schedule')} x {cfg.get('micro_batches')} micro-batches")
    t = Table(title=f"estimate vs measured at the peak ({desc}); component columns: measured (estimated)")
    for col in ("rank", "pp", "measured", "estimated", "meas/est", *COMPARED):
        t.add_column(col, justify="right")
    comp = {(r["rank"], r["component"]): r for r in cmp.by_component.iter_rows(named=True)}
    for r in cmp.by_rank.iter_rows(named=True):
        cells = [f"{_size(comp[r['rank'], c]['measured'])} ({_size(comp[r['rank'], c]['estimated'])})"
                 for c in COMPARED]
        t.add_row(str(r["rank"]), str(r.get("pp", "-")), _size(r["peak_allocated"]), _size(r["estimated"]),
                  f"{r['measured_over_estimated']:.2f}x", *cells)
    console.print(t)
    gaps = cmp.by_component.group_by("component").agg(pl.col("difference").mean())
    gap = {r["component"]: r["difference"] for r in gaps.iter_rows(named=True)}
    for c in COMPARED:
        console.print(f"  {c:12s} {_size(gap[c], signed=True):>12s} mean measured - estimated: {COMPONENT_NOTE[c]}")


@click.command("memory")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="Store to ingest a run directory into (default: <dir>.tracekit.duckdb beside it).")
@click.option("--run-id", help="run to analyse (needed when the store holds several)")
@click.option("--by", type=click.Choice(["category", "frame"]), default="category", show_default=True,
              help="group what was live at the peak by category or by allocation site")
@click.option("--top", type=int, default=10, show_default=True, help="rows per rank with --by frame")
@click.option("--estimate/--no-estimate", default=True, show_default=True,
              help="for a reference-trainer run, the estimator next to the measured peak")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="write a PNG of measured vs estimated per rank by component (needs matplotlib)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def memory_command(source: Path, store_path: Path | None, run_id: str | None, by: str, top: int, estimate: bool,
                   plot_path: Path | None, as_json: bool) -> None:
    """Per-rank peak memory, when it happened, what was live at it, imbalance across ranks, and
    the 4D estimator applied to the run's own config next to it. SOURCE: a store or a run directory."""
    from rich.console import Console

    from tracekit.cli._common import store_of

    store, run_id = store_of(source, run_id, as_json, store_path, warn=lambda m: Console(stderr=True).print(
        f"warning: {m}", markup=False, highlight=False, soft_wrap=True))

    status = Console(stderr=True).status  # a spinner on a terminal, silent otherwise
    try:
        with status(f"reading {store}"):
            run_id, tables, layout, manifest = load_tables(store, run_id)
        events = tables["memory_events"]
        with status(f"analysing {events.height:,} allocator events of run {run_id}"):
            result = analyse(events, segments=tables.get("memory_segments"), steps=tables.get("steps"),
                             spans=tables.get("spans"), blocks=tables.get("memory_blocks"))
        pk = result.peaks if layout is None else imbalance(result.peaks, layout)
        live = result.live_at_peak(by=by)
    except (MemoryDataError, LayoutError) as e:
        raise click.UsageError(str(e)) from e
    cmp, why_not = None, "no --estimate"
    if estimate:
        if manifest is None or "config" not in manifest:
            why_not = "the run has no reference-trainer manifest (config, layout, stage_layers)"
        else:
            try:  # the measured tables stand on their own: a manifest the estimator rejects is a note
                cmp = trainer_comparison(result, manifest, peaks=pk)
            except (EstimateError, LayoutError, MemoryDataError, KeyError, TypeError, ValueError) as e:
                why_not = f"the estimator rejects the run's manifest: {e}"
    if plot_path is not None:
        if cmp is None:
            raise click.UsageError(f"--plot needs the estimate: {why_not}")
        from tracekit.memory.plot import plot_comparison

        plot_comparison(cmp, plot_path, title=f"run {run_id}")
    if by == "frame":
        live = live.group_by("rank", maintain_order=True).head(top)
    if as_json:
        out = {"run_id": run_id, "layout": layout.as_dict() if layout else None,
               "peaks": pk.to_dicts(), f"live_by_{by}": live.to_dicts(),
               "estimate_vs_measured": None if cmp is None else {
                   "config": cmp.config, "by_rank": cmp.by_rank.to_dicts(),
                   "by_component": cmp.by_component.to_dicts(),
                   "estimates": {str(r): e.as_dict() for r, e in cmp.estimates.items()}},
               "estimate_missing_because": None if cmp is not None else why_not}
        click.echo(json.dumps(out, indent=1, default=str))
        return
    console = Console(width=170)
    if by == "frame":
        from rich.table import Table

        t = Table(title=f"live at the peak by allocation site, run {run_id}")
        for col in ("rank", "site", "bytes", "blocks", "share"):
            t.add_column(col, justify="left" if col == "site" else "right")
        for r in live.iter_rows(named=True):
            t.add_row(str(r["rank"]), r["frame"], _size(r["bytes"]), str(r["blocks"]), f"{r['share']:.0%}")
        console.print(t)
    else:
        _render(run_id, pk, live, console)
    if cmp is not None:
        _render_comparison(cmp, console)
    elif estimate:
        console.print(f"no estimate: {why_not}")
    if plot_path is not None:
        console.print(f"plot: {plot_path}")


