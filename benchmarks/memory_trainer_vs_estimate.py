"""The estimator next to measured memory, rank by rank and component by component, for real runs.

Three parts (all by default; pick with --samples / --trainer / --activation-sweep):

- samples: the bundled runs (sample_traces/slow_rank_8, cp_imbalance_8) ingested into a store and
  shown by ``tracekit memory`` (estimate vs measured per rank by component);
- trainer: fresh 8-rank gloo runs of the reference trainer (``profile_steps=1-1``: its own
  CPU-derived snapshots with categories by storage address) for a few configs, ingested and shown
  the same way, with a PNG per run (``--plot``) under benchmarks/_work/;
- activation sweep: single-process runs profiled with ``profile_memory=True`` and turned into a
  snapshot by torch's own ``_profile_to_snapshot``: the step's transient peak (activations and
  temporaries, on top of the model state) against the estimate's activations, split into the
  paper's FlashAttention terms and the attention matrices this trainer materializes.

Each run's table is the output of the command printed above it.

    PYTHONPATH=$PWD python benchmarks/memory_trainer_vs_estimate.py [--samples] [--trainer] [--activation-sweep]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "_work" / "memory_vs_estimate"
SAMPLES = ("slow_rank_8", "cp_imbalance_8")
TRAINER = {  # 8 ranks each; step 0 warms up, step 1 is recorded
    "tp2_pp2_dp2_fp32": dict(tp=2, pp=2, dp=2, seq_len=256, compute_dtype="fp32", grad_accum_dtype="fp32"),
    "cp2_pp2_dp2_bf16_zero2": dict(cp=2, pp=2, dp=2, seq_len=256, compute_dtype="bf16", grad_accum_dtype="fp32",
                                   zero_stage=2),
    "tp2_pp2_dp2_v2_afab": dict(tp=2, pp=2, dp=2, vstages=2, n_layers=8, seq_len=128, schedule="afab",
                                compute_dtype="bf16", grad_accum_dtype="bf16"),
}
SWEEP = [
    dict(seq_len=128, compute_dtype="fp32"),
    dict(seq_len=256, compute_dtype="fp32"),
    dict(seq_len=512, compute_dtype="fp32"),
    dict(seq_len=256, compute_dtype="bf16"),
    dict(seq_len=256, compute_dtype="bf16", dim=128, n_heads=8, n_kv_heads=2, ffn_dim=384),
]


def tracekit(*args: str) -> None:
    cmd = ["tracekit", *args]
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    res = subprocess.run([sys.executable, "-c", "from tracekit.cli import main; main()", *args],
                         env=env, capture_output=True, text=True)
    print(res.stdout.rstrip(), res.stderr[-2000:] if res.returncode else "", flush=True)
    if res.returncode:
        raise SystemExit(f"tracekit {args[0]} failed ({res.returncode})")


def show(run_dir: Path, name: str) -> None:
    store = WORK / f"{name}.duckdb"
    store.unlink(missing_ok=True)
    tracekit("ingest", str(run_dir), "--store", str(store), "--run-id", name)
    tracekit("memory", str(store), "--plot", str(WORK / f"{name}.png"))


def trainer_runs() -> None:
    from reference_trainer.config import TrainConfig
    from reference_trainer.launch import launch_many

    jobs = [(TrainConfig(steps=2, profile_steps="1-1", flight_recorder=False, backend="gloo", **ch),
             WORK / "runs" / name) for name, ch in TRAINER.items()]
    print(f"training {len(jobs)} configs on 8 gloo ranks (load average {os.getloadavg()[0]:.1f}) ...", flush=True)
    launch_many(jobs)
    for name in TRAINER:
        show(WORK / "runs" / name, name)


def activation_sweep() -> None:
    import polars as pl
    import torch
    from torch.cuda._memory_viz import _profile_to_snapshot
    from torch.profiler import ProfilerActivity, profile

    from reference_trainer.comm import Comm
    from reference_trainer.config import TrainConfig
    from reference_trainer.launch import write_manifest
    from reference_trainer.train import Trainer
    from tracekit.analysis.memory import analyse
    from tracekit.memory.trainer import trainer_estimate

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, changes in enumerate(SWEEP):
            cfg = TrainConfig(steps=1, micro_batches=2, backend="gloo", **changes).validate()
            manifest = write_manifest(cfg, Path(tmp) / f"run{i}", "gloo", [])
            trainer = Trainer(cfg, Comm.single())
            trainer.train_step()  # warm-up: the optimizer's buffers exist from here on
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                         with_stack=True) as prof:
                trainer.train_step()
            entries = _profile_to_snapshot(prof)["device_traces"][0]
            pk = analyse(pl.DataFrame({
                "rank": [0] * len(entries), "seq": list(range(len(entries))),
                "action": [e["action"] for e in entries], "addr": [e["addr"] for e in entries],
                "size": [e["size"] for e in entries]})).peaks.row(0, named=True)
            # everything recorded is transient (the state predates the recording): the step's peak
            # on top of what the previous step left is its activations and temporaries
            measured = pk["peak_allocated"] - pk["baseline_allocated"]
            est = trainer_estimate(manifest, 0)
            paper = est.activations - est.detail["act_attention_matrices"]
            rows.append({"seq": cfg.seq_len, "dim": cfg.dim, "dtype": cfg.compute_dtype,
                         "measured_MiB": measured / 2**20, "paper_terms_MiB": paper / 2**20,
                         "measured/paper": measured / paper,
                         "with_attention_matrices_MiB": est.activations / 2**20,
                         "measured/estimate": measured / est.activations})
    print("\nactivation sweep (single process, 4 layers, 2 micro-batches):")
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=160, float_precision=2):
        print(pl.DataFrame(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", action="store_true")
    ap.add_argument("--trainer", action="store_true")
    ap.add_argument("--activation-sweep", action="store_true")
    args = ap.parse_args()
    every = not (args.samples or args.trainer or args.activation_sweep)
    WORK.mkdir(parents=True, exist_ok=True)
    if every or args.samples:
        for name in SAMPLES:
            show(ROOT / "sample_traces" / name, name)
    if every or args.trainer:
        trainer_runs()
    if every or args.activation_sweep:
        activation_sweep()
    print(f"\nload average {os.getloadavg()[0]:.1f}; plots in {WORK}")


if __name__ == "__main__":
    main()
