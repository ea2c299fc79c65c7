"""``tracekit simulate``: write the run directory of a simulated NCCL job (tracekit/simulate)."""

from __future__ import annotations

import sys

import click

from tracekit.simulate.config import SimConfig, SimError

KINETO_MAX_RANKS = 512  # beyond: hundreds of MB of JSON per thousand ranks; the tables straight instead


@click.command("simulate")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--cp", type=int, default=1, show_default=True, help="Context-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline stages.")
@click.option("--dp", type=int, default=1, show_default=True, help="Data-parallel (FSDP) replicas.")
@click.option("--steps", type=int, default=4, show_default=True, help="Training steps.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of noise, clocks and flavour (odd: older NCCL kernel names, no Seq args).")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="Run directory to write.")
@click.option("--fault", "faults", multiple=True, metavar="SPEC",
              help="slow:rank=5,factor=1.5[,steps=2+3] | moving:ranks=1+5+3,factor=2 | "
                   "link:a=2,b=3,delay_ms=40 | cp_imbalance:ranks=1[,weight=0.5] | "
                   "hang:rank=3,step=1[,dim=dp] | stage:pp=3,factor=1.3. Repeatable.")
@click.option("--names", type=click.Choice(["mesh", "plain", "none"]), default="mesh", show_default=True,
              help="Group descriptions: DeviceMesh (mesh_tp...), hand-made (by seed: tp / Megatron names / "
                   "'undefined'), or none (distributedInfo without pg_config).")
@click.option("--skew-ms", type=float, default=0.0, show_default=True, help="Host clock skew, uniform in +-X ms.")
@click.option("--drift-ppm", type=float, default=0.0, show_default=True, help="Host clock drift, uniform in +-Y ppm.")
@click.option("--noise", type=float, default=0.02, show_default=True, help="Lognormal sigma of compute times.")
@click.option("--spikes", type=float, default=0.0, show_default=True,
              help="Probability that a compute kernel is descheduled 5-30x.")
@click.option("--chip-spread", type=float, default=0.0, show_default=True,
              help="Lognormal sigma of each rank's own compute speed, kept for the whole run (healthy chips "
                   "differ); the factors are in the manifest.")
@click.option("--trace-names", type=click.Choice(["rank", "profiler"]), default="rank", show_default=True,
              help="Trace file names: traces/rank<R>.json.gz, or as torch.profiler.tensorboard_trace_handler "
                   "writes them (<host>_<pid>.<ns>.pt.trace.json.gz: the hosts a real job's directory gives).")
@click.option("--microbatches", type=int, default=0, help="Micro-batches per step (default 2 x pp).")
@click.option("--vstages", type=int, default=1, show_default=True, help="Virtual stages per rank (interleaved 1F1B).")
@click.option("--ranks-per-host", type=int, default=8, show_default=True, help="Ranks sharing one host clock.")
@click.option("--detail", is_flag=True,
              help="Also aten ops, nccl: annotations and ac2g flows (the profiler's full layout).")
@click.option("--layers", type=int, default=1, show_default=True, help="Transformer layers per virtual stage.")
@click.option("--mesh-order", default="dp,pp,cp,tp", show_default=True,
              help="How ranks are numbered, outermost dimension first, as init_device_mesh's dims: dp,pp,cp,tp "
                   "(Llama 3's, the trainer's) or e.g. pp,dp,cp,tp (torchtitan's and Megatron-LM's).")
@click.option("--attn-ms", type=float, default=1.6, show_default=True, help="Attention cost of a layer (ms, fwd).")
@click.option("--mlp-ms", type=float, default=2.4, show_default=True, help="MLP cost of a layer (ms, fwd).")
@click.option("--format", "fmt", type=click.Choice(["auto", "kineto", "parquet"]), default="auto", show_default=True,
              help="kineto: traces and flight-recorder dumps, as a job writes them (ingest reads them); parquet: "
                   "the store's tables straight, as a Parquet dataset (every command opens it). auto: kineto up "
                   f"to {KINETO_MAX_RANKS} ranks.")
def simulate_command(tp: int, cp: int, pp: int, dp: int, steps: int, seed: int, out: str, faults: tuple[str, ...],
                     names: str, skew_ms: float, drift_ppm: float, noise: float, spikes: float, chip_spread: float,
                     trace_names: str, microbatches: int, vstages: int, ranks_per_host: int, detail: bool,
                     layers: int, mesh_order: str, attn_ms: float, mlp_ms: float, fmt: str) -> None:
    """Simulate a 4D-parallel NCCL job: its traces and ground truth, or its tables for large worlds.

    Kineto traces and flight-recorder dumps as the job would write them, with the ground truth in
    manifest.json; or (--format parquet) the store's tables straight, as a Parquet dataset."""
    from pathlib import Path

    from tracekit.simulate.run import simulate

    cfg = SimConfig(tp=tp, cp=cp, pp=pp, dp=dp, steps=steps, seed=seed, faults=tuple(faults), names=names,
                    skew_ms=skew_ms, drift_ppm=drift_ppm, noise=noise, spikes=spikes, chip_spread=chip_spread,
                    trace_names=trace_names, microbatches=microbatches, vstages=vstages,
                    ranks_per_host=ranks_per_host, detail=detail, layers=layers, attn_ms=attn_ms, mlp_ms=mlp_ms,
                    order=tuple(reversed([d.strip() for d in mesh_order.split(",")])))
    if fmt == "auto":
        fmt = "kineto" if tp * cp * pp * dp <= KINETO_MAX_RANKS else "parquet"
    try:
        if fmt == "parquet":
            from tracekit.simulate.tables import write_dataset

            write_dataset(cfg, out, Path(out).name or "simulated")
            path = out
        else:
            path = simulate(cfg, out)
    except SimError as e:
        click.echo(f"tracekit simulate: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        click.echo(f"tracekit simulate: cannot write {out}: {e.strerror or e}", err=True)
        sys.exit(2)
    what = "a Parquet dataset store" if fmt == "parquet" else "manifest.json, traces/, fr/"
    click.echo(f"{cfg.world_size} ranks x {steps} steps -> {path} ({what})")
