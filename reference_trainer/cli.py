"""`python -m reference_trainer` / `tracekit train`: one option per TrainConfig field."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from .config import BACKENDS, CP_SHARDINGS, DTYPES, REDUCE_ORDERS, SCHEDULES, ConfigError, TrainConfig

_CHOICES = {"schedule": SCHEDULES, "compute_dtype": DTYPES, "grad_accum_dtype": DTYPES,
            "reduce_dtype": DTYPES, "cp_sharding": CP_SHARDINGS, "reduce_order": REDUCE_ORDERS,
            "backend": BACKENDS}

_HELP = {
    "tp": "tensor-parallel size (with sequence parallel)", "cp": "context-parallel size",
    "pp": "pipeline-parallel size", "dp": "data-parallel size (ZeRO over dp x cp)",
    "vstages": "virtual pipeline stages per PP rank (interleaving)",
    "consecutive": "N: consecutive micro-batches per virtual stage (0 = pp)",
    "schedule": "interleaved 1F1B or all-forward-all-backward",
    "zero_stage": "1: reduce-scatter grads once per step; 2: after every micro-batch",
    "micro_batches": "micro-batches per DP replica per step",
    "grad_accum_dtype": "dtype of the gradient accumulation buffer",
    "reduce_dtype": "dtype of the DP x CP gradient reduce-scatter",
    "reduce_order": "backend reductions, or all-gather + rank-ordered sum (emulatable)",
    "cp_sharding": "chunks i and 2cp-1-i of the sequence, or of every document (WLB-LLM)",
    "dump_state": "write unsharded loss, gradients and parameters per step to <out>/state/",
    "record_activations": "debug: with --dump-state, also dump every micro-batch's per-layer forward activations",
    "timeout_s": "collective timeout per rank, seconds",
    "plant_bug": "debug: plant a known bug (cp-chunk, tp-bwd-reduce, dp-double-scale, doc-mask-off-by-one)",
    "device_gflops": "emulated device per rank (0 = off): compute spans last their matmul FLOPs / this "
                     "+ bytes written / --device-gbps, so ranks sharing CPU cores behave like ranks with "
                     "a GPU each (reference_trainer/device.py)",
    "device_gbps": "the emulated device's memory bandwidth, GB/s (memory-bound ops)",
    "device_launch_us": "the emulated device's cost per kernel (op), microseconds",
    "device_jitter": "relative sd of the emulated device's per-span time (lognormal, seeded)",
    "profile_steps": "profile steps a-b: <out>/traces/rank<R>.json.gz and <out>/memory/rank<R>.pickle",
    "profile_memory": "record allocations in the profiled steps and write <out>/memory/rank<R>.pickle",
    "profile_stack": "profile with Python stacks (with_stack): CPU snapshots' allocation frames gain source lines; "
                     "bigger traces (benchmarks/recording_overhead.py)",
    "flight_recorder": "write <out>/fr/rank<R> (end of run, stall, SIGUSR1)",
    "fr_watchdog_s": "flight-recorder dump after this long without progress (0 = timeout/2)",
}


def _config_options(fn, skip: tuple[str, ...] = ("faults",)):
    """One click option per TrainConfig field except ``skip`` (faults: repeated --fault options instead)."""
    for f in reversed(dataclasses.fields(TrainConfig)):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            fn = click.option(flag + "/--no-" + f.name.replace("_", "-"), f.name, default=f.default,
                              show_default=True, help=_HELP.get(f.name))(fn)
            continue
        kind = click.Choice(_CHOICES[f.name]) if f.name in _CHOICES else (
            {"int": int, "float": float, "str": str}.get(str(f.type), str))
        fn = click.option(flag, f.name, type=kind, default=f.default, show_default=True,
                          help=_HELP.get(f.name))(fn)
    return fn


@click.command("train")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="run directory to write")
@click.option("--fault", "fault", multiple=True, metavar="SPEC",
              help="inject a fault, e.g. slow:rank=5,factor=1.5,steps=2-4 (repeatable; see faults.py)")
@_config_options
def train_command(out: Path, fault: tuple[str, ...], **fields) -> None:
    """Train the reference model on a spawned world of ranks and write a run directory."""
    fields["faults"] = ";".join(fault)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rich.markup import escape

    from .launch import LaunchError, launch, read_progress

    console = Console(stderr=True)
    try:
        cfg = TrainConfig(**fields).validate()
    except ConfigError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        sys.exit(2)
    console.print(f"training {cfg.layout} ({cfg.world_size} ranks) -> {out}")
    try:
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                      console=console) as progress:
            task = progress.add_task("spawning ranks", total=cfg.steps)

            def poll() -> None:
                done = read_progress(out)
                if done:
                    progress.update(task, completed=len(done),
                                    description=f"training (loss {done[-1]['loss']:.4f})")

            result = launch(cfg, out, poll=poll)
            progress.update(task, completed=cfg.steps)
    except ConfigError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        sys.exit(2)
    except LaunchError as e:  # a rank's own error (gloo's messages hold '[/...]': not markup)
        console.print(f"[red]run failed:[/red] {escape(str(e))}", highlight=False)
        sys.exit(3)  # the job crashed: an internal error, never a finding
    for s in result.metrics.get("steps", []):
        click.echo(f"step {s['step']}  loss {s['loss']:.6f}  {s['seconds']:.3f} s")
    click.echo(f"wrote {out / 'manifest.json'} (backend {result.manifest['backend']})")
