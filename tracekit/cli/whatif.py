"""`tracekit whatif`: how fast the step would be with the slow parts healthy (rendering only; the
analysis is tracekit.analysis.whatif).

Exit codes: 0 ok; 1 with ``--check`` when the measured step is over ``--threshold`` times the ideal;
2 bad input (no such path, not a store, a run the replay cannot model, a bad --heal/--balance).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from tracekit.cli._common import EXIT_FINDING, EXIT_OK, fail


@click.command("whatif")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--heal", "heal", multiple=True, metavar="rank=R|link=A,B",
              help="Replay with a rank's compute at its peers' median, or a link at normal speed (repeatable).")
@click.option("--balance", "balance", multiple=True, type=click.Choice(["cp", "pp"]),
              help="Replay with the compute of each CP (or PP) group equalized (repeatable).")
@click.option("--wlb", is_flag=True,
              help="Trainer runs: WLB-LLM data what-ifs (per-document CP sharding, variable-length packing).")
@click.option("--warmup", default=0, show_default=True, type=click.IntRange(min=0),
              help="Replayed steps left out of the steady step (each op at its median over the other steps).")
@click.option("--no-decompose", is_flag=True, help="Skip the slowdown decomposition (one replay per part).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--check", is_flag=True, help="Exit 1 when the slowdown is over --threshold.")
@click.option("--threshold", default=1.1, show_default=True, help="Slowdown that counts as a finding with --check.")
@click.option("--run-id", default=None, help="Run to analyse (default: the newest in the store).")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="Store to ingest a run directory into (default: <dir>.tracekit.duckdb beside it).")
def whatif_command(source: Path, heal: tuple[str, ...], balance: tuple[str, ...], wlb: bool, warmup: int,
                   no_decompose: bool,
                   as_json: bool, check: bool, threshold: float, run_id: str | None, store_path: Path | None) -> None:
    """How fast the step would be without its stragglers: replay, ideal step, slowdown by part."""
    from tracekit.analysis.whatif import WhatIfError, analyze, parse_heal
    from tracekit.cli.analysis import open_source

    try:
        for spec in heal:
            parse_heal(spec)
    except WhatIfError as e:
        fail(str(e))
    store, rid = open_source(source, run_id, quiet=as_json, store=store_path)
    try:
        tables = store.run_tables(rid)
    finally:
        store.close()
    try:
        result = analyze(tables, heal=heal, balance=balance, decompose=not no_decompose, wlb=wlb, warmup=warmup)
    except WhatIfError as e:
        fail(f"{source}: {e}")
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        _render(result)
    sys.exit(EXIT_FINDING if check and result.slowdown > threshold else EXIT_OK)


def _render(w) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    if w.missing_ranks:
        out.print(f"[yellow]note:[/] no data for ranks {', '.join(map(str, w.missing_ranks))}: their partners' "
                  "communication is replayed as they recorded it", highlight=False)
    out.print(f"[bold]whatif:[/] {w.run_id} ({w.model} model, {w.steps} steps): measured step {w.measured_ns / 1e6:.1f} ms, "
              f"ideal {w.ideal_ns / 1e6:.1f} ms, slowdown {w.slowdown:.3f} (without idle gaps {w.blocking_slowdown:.3f})",
              highlight=False)
    out.print(f"replayed as recorded: {w.replay_ns / 1e6:.1f} ms ({w.replay_error:+.2%} of measured"
              + (f", {w.violations} recorded starts before a dependency ended)" if w.violations else ")"), highlight=False)
    out.print(f"steady step (each op at its median over the steps): {w.steady_ns / 1e6:.1f} ms", highlight=False)
    out.print("slowdown by part: the ideal step with only that part as recorded, over the ideal step", highlight=False)
    t = Table(title="counterfactuals (step: mean over the replayed steps; steady: on the steady step)")
    for c in ("scenario", "step ms", "saving ms", "of step", "steady ms"):
        t.add_column(c, justify="left" if c == "scenario" else "right")
    for s in w.scenarios:
        t.add_row(s.name, f"{s.step_ns / 1e6:.1f}", f"{s.saving_ns / 1e6:.1f}", f"{s.share:.1%}", f"{s.steady_ns / 1e6:.1f}")
    out.print(t)
    if w.data is not None:
        t = Table(title=f"WLB-LLM imbalance degree per step (attention weight w={w.data.attention_weight:.2f})")
        for c in ("step", "CP attention", "CP work", "packing"):
            t.add_column(c, justify="right")
        for r in w.data.per_step.iter_rows(named=True):
            t.add_row(str(r["step"]), *(f"{r[k + '_before']:.3f} -> {r[k + '_after']:.3f}"
                                        for k in ("cp_attention_degree", "cp_work_degree", "pack_degree")))
        out.print(t)
    for title, frame in (("DP rank", w.by_dp), ("stage", w.by_stage), ("op type", w.by_optype)):
        if frame.height:
            t = Table(title=f"slowdown by {title}")
            t.add_column(title)
            t.add_column("slowdown", justify="right")
            for key, val in frame.head(10).iter_rows():
                t.add_row(str(key), f"{val:.3f}")
            out.print(t)
