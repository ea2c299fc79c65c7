"""The `numerics` command line: bit-exact check against the sequential reference, precision report
(synthetic or a real model's buffers) and the gloo reduction-order self-test.

Exit codes: 0 ok; 1 a finding (a bug: a mismatch outside what reordering can do; the self-test found
gloo no longer matches the model); 4 a rounding-order-only difference; 2 bad input; 3 internal error
(the ranks could not run, or any crash: never reported as a mismatch); 130 interrupted.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click
import polars as pl
from rich.console import Console
from rich.progress import Progress
from rich.markup import escape
from rich.table import Table

from numerics.precision import DEFAULT_THRESHOLD, buffer_precision, synthetic_terms
from numerics.reduction_order import ORDERS


class _Guarded(click.Group):
    """A crash is never a finding: an unexpected exception is one line and exit 3; Ctrl-C exits 130."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # noqa: BLE001 - the top level turns any crash into exit 3
            click.echo(f"internal error: {type(exc).__name__}: {exc}", err=True)
            ctx.exit(3)


@click.group(cls=_Guarded)
def main() -> None:
    """Numerics checks for parallel training: accumulation order, bit-exactness, BF16/FP32 buffers."""


@main.command()
@click.option("-m", "--micro-batches", "micro_batches", type=click.IntRange(min=1), multiple=True,
              help="Micro-batches per step (repeatable; synthetic default 1, 4, 8, 16, 64; with --model-config "
                   "the run's own).")
@click.option("--dp", type=click.IntRange(min=1), default=None,
              help="Data-parallel ranks (synthetic default 1; with --model-config the run's own).")
@click.option("-n", "--numel", type=click.IntRange(min=1), multiple=True, default=(65536,), show_default=True,
              help="Elements of a synthetic buffer (repeatable).")
@click.option("--signal", type=float, default=0.0, show_default=True,
              help="Shared gradient direction per term, in units of the per-term noise (0 = pure noise).")
@click.option("--order", type=click.Choice(sorted(ORDERS)), default="gloo_ring", show_default=True,
              help="How the DP ranks' buffers are summed (synthetic; a run's config gives its own).")
@click.option("--threshold", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_THRESHOLD, show_default=True,
              help="Flag a buffer when its bf16 error exceeds this many storage floors.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model-config", "model_config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Measure the real gradient buffers of this run (its manifest.json, or a JSON/YAML of config "
                   "fields) over --steps training steps and --seeds seeds: accumulation and reduce apart, "
                   "bf16 and fp32 against fp64, plus the loss divergence of each dtype pair.")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="With --model-config: steps.")
@click.option("--seeds", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --model-config: seeds (a verdict the seeds disagree on is 'borderline').")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def precision(micro_batches, dp, numel, signal, order, threshold, seed, model_config, steps, seeds, as_json) -> None:
    """Which gradient buffers need FP32: synthetic gradient streams (k = micro-batches x dp terms,
    bf16 vs fp32 buffer against the fp64 sum), or (--model-config) a run's own buffers over real
    training steps, accumulation and reduce measured apart; a summary line first."""
    import torch

    torch.set_num_threads(1)  # results must not depend on the machine's thread count
    rows = []
    if model_config is not None:
        _precision_experiment(model_config, micro_batches, dp, steps, seeds, threshold, as_json)
        return
    jobs = [(n, m) for n in numel for m in (micro_batches or (1, 4, 8, 16, 64))]
    dp = dp or 1
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task("accumulating", total=len(jobs))
        for i, (n, m) in enumerate(jobs):
            terms = synthetic_terms(m, dp, n, signal=signal, seed=seed + i)
            rows.append(buffer_precision(f"synthetic{i}", terms, order=order, threshold=threshold))
            progress.advance(task)
    if as_json:
        click.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    source = f"signal={signal:g}"
    table = Table(title=f"accumulation error vs fp64, normwise (dp={dp}, order={order}, {source})")
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


def _precision_experiment(path: Path, micro_batches, dp, steps: int, seeds: int, threshold: float, as_json: bool) -> None:
    from numerics.model_precision import load_config
    from numerics.precision_experiment import precision_experiment
    from numerics.run_config import RunConfigError

    try:
        base = load_config(path)
        changes = {k: v for k, v in (("dp", dp), ("micro_batches", micro_batches[-1] if micro_batches else None)) if v}
        cfg = base.replace(**changes).validate(str(path))
    except RunConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    with Console(stderr=True).status(f"training {steps} steps x {seeds} seeds in fp64 and 4 dtype pairs", ) as _:
        report = precision_experiment(cfg, steps=steps, seeds=seeds, threshold=threshold)
    if as_json:
        click.echo(json.dumps({"summary": report.summary(), "loss_divergence": report.loss_divergence,
                               "buffers": [asdict(b) for b in report.buffers]}, indent=1))
        return
    console = Console()
    console.width = max(console.width, 170)
    console.print(report.summary())
    table = Table(title=f"normwise error vs fp64, median over {steps} steps x {seeds} seeds (k = {report.buffers[0].terms} terms)")
    for col in ("buffer", "numel", "accum bf16", "accum fp32", "reduce bf16", "reduce fp32", "floor", "growth",
                "accumulation", "reduce"):
        table.add_column(col, justify="left" if col in ("buffer", "accumulation", "reduce") else "right", no_wrap=True)
    for b in report.buffers:
        table.add_row(b.buffer, str(b.numel), f"{b.accum_bf16:.2e}", f"{b.accum_fp32:.2e}", f"{b.reduce_bf16:.2e}",
                      f"{b.reduce_fp32:.2e}", f"{b.floor:.2e}", f"{b.accum_growth:.2f}x", b.accumulation, b.reduce)
    console.print(table)
    console.print(f"verdict per site: needs FP32 iff its bf16 error > {threshold:g} x floor (bf16 rounding of the exact "
                  "reduced gradient) on every seed; growth: bf16 accumulation error at the last step / first step")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Check this finished run (made with --dump-state) instead of making one; its manifest gives the config.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the parallel run here (default: a temporary directory).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--activations/--no-activations", default=True, show_default=True,
              help="Record and compare every micro-batch's per-layer forward activations, so a forward bug is "
                   "named by its first diverging layer (keeps all activations of a step in memory).")
@click.option("--strict-order", is_flag=True,
              help="Run with fp32 compute and bf16 gradient buffers and reduce, where a wrong summation order "
                   "changes bits (the default bf16 compute / fp32 buffers hides most order mistakes).")
@click.option("--accept-order", is_flag=True, help="Exit 0, not 4, when every mismatch is rounding order only.")
@click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED)
def check(run_dir, out, as_json, activations, strict_order, accept_order, trainer_args) -> None:
    """Run the reference trainer (TRAINER_ARGS: its own options, e.g. --tp 2 --dp 2 --steps 1) with its
    state dumped, run the sequential reference from the run's manifest, and compare bit for bit.

    Exit 0: bit-exact; 1: a bug (a buffer outside what reordering can do, wrong data, a missing
    layer); 4: rounding order only (0 with --accept-order); 2: bad input; 3: internal error."""
    from numerics.check import RunStateError, TrainerRunError, check_run, run_check
    from numerics.plan import PlanError
    from numerics.run_config import RunConfigError

    try:
        with Console(stderr=True).status("running the parallel trainer and the sequential reference"):
            if run_dir is not None:
                if trainer_args:
                    raise RunConfigError(f"--run checks a finished run: trainer options {list(trainer_args)} make no sense")
                report = check_run(run_dir)
            else:
                report = run_check(None, out, activations, strict_order, trainer_args)
    except (RunConfigError, PlanError, RunStateError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except TrainerRunError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(3)
    first = report.first_divergent
    first_step = None if first is None else report.steps[first[0]]
    where = None if first is None else first_step.divergence.get(first[1])
    keep = run_dir if run_dir is not None else out
    if keep is not None:
        # Kept beside the run so the dashboard's numerics view (and later readers) find the report.
        (keep / "numerics.json").write_text(json.dumps(report.table().to_dicts(), default=str))
        # the verdict as the check words it, so readers (the dashboard) show it rather than re-derive it
        (keep / "numerics_verdict.json").write_text(json.dumps(
            {"bit_exact": report.bit_exact, "status": report.status, "summary": report.summary(),
             "diagnosis": report.diagnosis}))
    layout = report.config.layout
    if as_json:
        hist = report.ulp_histogram()
        if first is not None:
            hist = hist.filter((pl.col("step") == first[0]) & (pl.col("buffer") == first[1]))
        click.echo(json.dumps({
            "bit_exact": report.bit_exact, "status": report.status, "layout": layout, "summary": report.summary(),
            "diagnosis": report.diagnosis, "findings": list(report.findings),
            "first_divergent": None if first is None else {"step": first[0], "buffer": first[1]},
            "first_bug": None if report.first_bug is None else asdict(report.first_bug),
            "first_divergent_where": None if where is None else asdict(where),
            "sharding": [] if first_step is None else list(first_step.sharding),
            "verdicts": [asdict(v) for v in report.verdicts],
            "buffers": report.table().to_dicts(), "first_divergent_ulp_histogram": hist.to_dicts(),
        }, indent=1, default=str))
    else:
        _print_check(report, layout, first, where)
    sys.exit(check_exit_code(report.status, accept_order))


def check_exit_code(status: str, accept_order: bool = False) -> int:
    """0 match, 1 bug, 4 rounding order only (0 when order differences are accepted)."""
    return {"match": 0, "bug": 1, "order": 0 if accept_order else 4}[status]


def _print_check(report, layout: str, first, where) -> None:
    console = Console()
    console.width = max(console.width, 160)
    console.print(f"{layout}: {escape(report.summary())}")
    for f in report.findings[1:]:
        console.print(f"  {escape(f)}")
    if first is None:
        return
    bad = report.table().filter(pl.col("mismatches") > 0)
    table = Table(title=f"mismatching buffers ({bad.height}), comparison order: activations in forward order, "
                        "loss, gradients in backward order, parameters; ULPs in the buffer's own dtype")
    for col in ("step", "buffer", "mismatches", "max ulp", "rel err", "norm ratio", "verdict"):
        table.add_column(col, justify="left" if col in ("buffer", "verdict") else "right", no_wrap=True)
    for r in bad.head(25).iter_rows(named=True):
        table.add_row(str(r["step"]), r["buffer"], f"{r['mismatches']}/{r['numel']}", f"{r['max_ulp']} {r['dtype']}",
                      f"{r['rel_err']:.3g}", _ratio(r["norm_ratio"]), r["verdict"])
    console.print(table)
    shown = bad.filter(pl.col("verdict") == "bug").head(3) if report.status == "bug" else bad.head(3)
    for r in shown.iter_rows(named=True):
        console.print(f"  {r['verdict']} {r['buffer']} (step {r['step']}): {escape(r['location'])}\n    {escape(r['cause'])}")
    acts = bad.filter(pl.col("buffer").str.starts_with("act/"))
    if acts.height:
        console.print("where the differing activations differ first, in forward order:")
        for r in acts.head(8).iter_rows(named=True):
            console.print(f"  step {r['step']} {r['buffer'][4:]}: {r['where']}")
    hist = report.ulp_histogram().filter((pl.col("step") == first[0]) & (pl.col("buffer") == first[1]))
    console.print(f"ULP histogram of {first[1]} (step {first[0]}): " + ", ".join(
        f"[{r['ulp_min']}, {r['ulp_max']}]: {r['count']}" for r in hist.iter_rows(named=True)))


def _ratio(r: float) -> str:
    return f"{r:.6g}" if abs(r - 1) > 1e-4 or r == 1 else f"1{r - 1:+.3g}"


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
