"""`tracekit estimate`: render the 4D memory estimator (tracekit.memory.estimate) as tables or JSON."""

from __future__ import annotations

import json

import click

from tracekit.memory.estimate import (
    PRESETS,
    EstimateError,
    ModelDims,
    StateBytes,
    estimate_rank,
    paper_estimate,
    preset,
    sweep,
)
from tracekit.topology import Layout, LayoutError

_DIM_OPTIONS = {  # CLI option -> ModelDims field
    "hidden": "hidden", "ffn": "ffn_hidden", "heads": "heads", "kv_heads": "kv_heads",
    "layers": "layers", "vocab": "vocab",
}
VERDICT_STYLE = {"fits": "green", "may-not-fit": "yellow", "will-not-fit": "red"}


def _model(name: str | None, dims: dict[str, int | None]) -> ModelDims:
    given = {_DIM_OPTIONS[k]: v for k, v in dims.items() if v is not None}
    if name is not None:
        base = preset(name)
        fields = {f: getattr(base, f) for f in _DIM_OPTIONS.values()}
        fields.update(given)
        return ModelDims(**fields, name=base.name if not given else f"{base.name}*")
    missing = [f"--{k.replace('_', '-')}" for k, f in _DIM_OPTIONS.items() if f not in given]
    if missing:
        raise EstimateError(f"without --model, give every dimension; missing {' '.join(missing)}")
    return ModelDims(**given)


def _layout(tp: int, cp: int, pp: int, dp: int | None, gpus: int | None) -> Layout:
    inner = tp * cp * pp
    if dp is None:
        if gpus is None:
            dp = 1
        elif gpus % inner:
            raise EstimateError(f"--gpus {gpus} is not a multiple of tp*cp*pp = {inner}")
        else:
            dp = gpus // inner
    elif gpus is not None and gpus != inner * dp:
        raise EstimateError(f"--gpus {gpus} != tp*cp*pp*dp = {inner * dp}")
    return Layout(tp=tp, cp=cp, pp=pp, dp=dp)


def _console():
    from rich.console import Console

    return Console(width=140)


def _render_one(est, device_gib: float) -> None:
    from rich.table import Table

    g = est.gib()
    table = Table(title=f"{est.model} tp{est.tp} cp{est.cp} pp{est.pp} dp{est.dp} seq {est.seq} mbs {est.mbs}",
                  caption=f"{est.formula} formula, pipeline stage {est.stage}, per GPU")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    labels = {"weights": "bf16 weights", "gradients": "fp32 gradients",
              "optimizer": "optimizer state + master weights", "activations": "activations"}
    for key, label in labels.items():
        table.add_row(label, f"{g[key]:.2f}", f"{g[key] / g['total']:.0%}" if g["total"] else "-")
    table.add_row("total", f"{g['total']:.2f}", "100%", style="bold")
    console = _console()
    console.print(table)
    v = est.verdict(device_gib)
    frac = est.total / (device_gib * 1024**3)
    console.print(f"parameters on this GPU: {est.params:,.0f}")
    console.print(f"[{VERDICT_STYLE[v]}]{v}[/]: {frac:.0%} of a {device_gib:g} GiB device "
                  f"(fits at <= 80%; excludes temporary buffers and fragmentation)")


def _render_sweep(df, title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("tp", "cp", "pp", "dp", "mbs"):
        table.add_column(col, justify="right")
    for col in ("weights", "grads", "optim", "acts", "total"):
        table.add_column(f"{col} GiB", justify="right")
    table.add_column("of device", justify="right")
    table.add_column("verdict")
    for r in df.iter_rows(named=True):
        table.add_row(
            *(str(r[c]) for c in ("tp", "cp", "pp", "dp", "mbs")),
            *(f"{r[c]:.2f}" for c in ("weights_gib", "gradients_gib", "optimizer_gib",
                                      "activations_gib", "total_gib")),
            f"{r['fraction']:.0%}", f"[{VERDICT_STYLE[r['verdict']]}]{r['verdict']}[/]",
        )
    _console().print(table)


@click.command("estimate")
@click.option("--model", "model_name", help=f"preset: {', '.join(sorted(PRESETS))}")
@click.option("--hidden", type=int, help="hidden size h (overrides the preset)")
@click.option("--ffn", type=int, help="FFN hidden size")
@click.option("--heads", type=int, help="attention heads a")
@click.option("--kv-heads", "kv_heads", type=int, help="KV heads k (GQA)")
@click.option("--layers", type=int, help="transformer layers L")
@click.option("--vocab", type=int, help="vocabulary size v")
@click.option("--tp", type=int, default=1, show_default=True)
@click.option("--cp", type=int, default=1, show_default=True)
@click.option("--pp", type=int, default=1, show_default=True)
@click.option("--dp", type=int, help="data-parallel size (default: gpus / (tp*cp*pp))")
@click.option("--gpus", type=int, help="GPU count; required with --sweep")
@click.option("--mbs", type=int, default=1, show_default=True, help="micro-batch size")
@click.option("--seq", type=int, default=8192, show_default=True, help="sequence length")
@click.option("--device-gib", type=float, default=80.0, show_default=True)
@click.option("--formula", type=click.Choice(["paper", "exact"]), default="paper", show_default=True,
              help="paper: the published formula; exact: integer parameter counts of stage 0")
@click.option("--stage", type=int, help="exact formula: pipeline stage to estimate (default 0)")
@click.option("--zero-stage", type=click.IntRange(0, 3),
              help="exact formula: ZeRO stage over dp x cp (default 1, as the paper)")
@click.option("--sweep", "do_sweep", is_flag=True, help="all valid (tp, cp, pp, mbs) for --gpus")
@click.option("--mbs-values", default="1,2,4", show_default=True, help="micro-batch sizes to sweep")
@click.option("--global-batch", type=int, help="sweep: sequences per step; mbs*dp must divide it")
@click.option("--max-tp", type=int, help="sweep: largest TP size (e.g. GPUs per node)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def estimate_command(model_name, hidden, ffn, heads, kv_heads, layers, vocab, tp, cp, pp, dp, gpus,
                     mbs, seq, device_gib, formula, stage, zero_stage, do_sweep, mbs_values,
                     global_batch, max_tp, as_json) -> None:
    """Estimate per-GPU memory of a Llama model under 4D parallelism (Fujii et al. 2024)."""
    dims = {"hidden": hidden, "ffn": ffn, "heads": heads, "kv_heads": kv_heads, "layers": layers,
            "vocab": vocab}
    try:
        model = _model(model_name, dims)
        if device_gib <= 0:
            raise EstimateError(f"--device-gib must be positive, got {device_gib:g}")
        if do_sweep:
            if gpus is None:
                raise EstimateError("--sweep needs --gpus")
            try:
                mbs_list = tuple(int(x) for x in mbs_values.split(",") if x.strip())
            except ValueError:
                raise EstimateError(f"--mbs-values must be comma-separated integers, got {mbs_values!r}")
            df = sweep(model, gpus, seq, mbs_values=mbs_list, device_gib=device_gib,
                       global_batch=global_batch, max_tp=max_tp)
        else:
            layout = _layout(tp, cp, pp, dp, gpus)
            if formula == "paper":
                if stage is not None or zero_stage is not None:
                    raise EstimateError("--stage and --zero-stage need --formula exact "
                                        "(the paper's formula is stage 0 with ZeRO-1)")
                est = paper_estimate(model, layout, seq, mbs)
            else:
                est = estimate_rank(model, layout, seq, mbs, stage=stage or 0,
                                    state=StateBytes(zero_stage=1 if zero_stage is None else zero_stage))
    except (EstimateError, LayoutError) as e:
        raise click.UsageError(str(e)) from e
    if do_sweep:
        if as_json:
            click.echo(json.dumps({"model": model.name, "gpus": gpus, "seq": seq,
                                   "device_gib": device_gib, "configs": df.to_dicts()}, indent=1))
        elif df.height == 0:
            click.echo(f"no valid (tp, cp, pp, mbs) for {model.name} on {gpus} GPUs at seq {seq}")
        else:
            _render_sweep(df, f"{model.name} on {gpus} GPUs, seq {seq}, {df.height} valid configs, "
                              f"{device_gib:g} GiB devices")
    elif as_json:
        click.echo(json.dumps(est.as_dict(device_gib), indent=1))
    else:
        _render_one(est, device_gib)
