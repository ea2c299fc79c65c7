"""The `numerics` command line: precision report and the gloo reduction-order self-test.

Exit codes: 0 ok; 1 a finding in a check mode (the self-test found gloo no longer matches the model);
2 bad input; 3 the ranks could not run (spawn/gloo failure).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click
import polars as pl
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from numerics.precision import DEFAULT_THRESHOLD, buffer_precision, synthetic_terms
from numerics.reduction_order import ORDERS


@click.group()
def main() -> None:
    """Numerics checks for parallel training: accumulation order, bit-exactness, BF16/FP32 buffers."""


@main.command()
@click.option("-m", "--micro-batches", "micro_batches", type=click.IntRange(min=1), multiple=True,
              default=(1, 4, 8, 16, 64), show_default=True, help="Micro-batches per step (repeatable).")
@click.option("--dp", type=click.IntRange(min=1), default=1, show_default=True, help="Data-parallel ranks.")
@click.option("-n", "--numel", type=click.IntRange(min=1), multiple=True, default=(65536,), show_default=True,
              help="Elements of a synthetic buffer (repeatable).")
@click.option("--signal", type=float, default=0.0, show_default=True,
              help="Shared gradient direction per term, in units of the per-term noise (0 = pure noise).")
@click.option("--order", type=click.Choice(sorted(ORDERS)), default="gloo_ring", show_default=True,
              help="How the DP ranks' buffers are summed.")
@click.option("--threshold", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_THRESHOLD, show_default=True,
              help="Flag a buffer when its bf16 accumulation error exceeds this many storage floors.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON rows instead of a table.")
def precision(micro_batches, dp, numel, signal, order, threshold, seed, as_json) -> None:
    """Accumulation error of BF16 vs FP32 gradient buffers against an fp64 exact sum, on synthetic
    gradient streams of k = micro-batches x dp terms, and which buffers need FP32 accumulation."""
    import torch

    torch.set_num_threads(1)  # results must not depend on the machine's thread count
    jobs = [(n, m) for n in numel for m in micro_batches]
    rows = []
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task("accumulating", total=len(jobs))
        for i, (n, m) in enumerate(jobs):
            terms = synthetic_terms(m, dp, n, signal=signal, seed=seed + i)
            rows.append(buffer_precision(f"synthetic{i}", terms, order=order, threshold=threshold))
            progress.advance(task)
    if as_json:
        click.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    table = Table(title=f"accumulation error vs fp64, normwise (dp={dp}, order={order}, signal={signal:g})")
    for col in ("buffer", "numel", "mb", "k", "bf16 buf", "fp32 buf", "floor", "ratio", "lost", "verdict"):
        table.add_column(col, justify="left" if col in ("buffer", "verdict") else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.buffer, str(r.numel), str(r.micro_batches), str(r.terms), f"{r.err_bf16:.2e}", f"{r.err_fp32:.2e}",
            f"{r.storage_floor:.2e}", f"{r.ratio:.2f}x", f"{r.absorbed:.1%}", "[bold red]needs FP32[/]" if r.needs_fp32 else "bf16 ok",
        )
    console = Console()
    console.width = max(console.width, 120)  # a piped/CI log is not 80 columns wide; never truncate numbers
    console.print(table)
    console.print(f"mb: micro-batches; k: terms (mb x dp); floor: error of rounding the exact sum once to bf16; "
                  f"lost: bf16 additions swallowed whole.\nrule: needs FP32 iff bf16 buffer error > {threshold:g} x floor")


@main.command()
@click.option("--world-size", type=click.IntRange(min=8), default=8, show_default=True,
              help="Ranks to spawn (groups of 2, 3, 4 and 8 ranks are formed inside).")
@click.option("--json", "as_json", is_flag=True, help="Print every per-rank result as JSON.")
def selftest(world_size, as_json) -> None:
    """Run real gloo collectives and check they still add in the modelled order, bit for bit."""
    from numerics.gloo_selftest import GlooModelMismatch, check_gloo_matches_model, run_gloo_selftest

    with Console(stderr=True).status(f"running gloo collectives on {world_size} spawned ranks"):
        try:
            report = run_gloo_selftest(world_size=world_size)
        except RuntimeError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(3)
    if as_json:
        click.echo(report.table().write_json())
    else:
        summary = (
            report.table()
            .group_by("n", "dtype", "collective", "op", "order")
            .agg(pl.len().alias("rank_results"), pl.col("mismatches").sum(), pl.col("other_order_mismatches").sum())
            .sort("n", "dtype", "collective", "op", "order")
        )
        with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
            click.echo(str(summary))
    try:
        check_gloo_matches_model(report)
    except GlooModelMismatch as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    if not as_json:
        click.echo(f"ok: {len(report.results)} rank results on torch {report.torch_version} match the models bit for bit")


if __name__ == "__main__":
    main()
