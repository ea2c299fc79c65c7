"""Measured activation memory of the reference trainer against the estimator, side by side.

For a few single-process configs (world 1, so one process and no spawn), builds the trainer, runs
one warm-up step, then profiles one step with ``profile_memory=True`` and turns it into a snapshot
with torch's own ``_profile_to_snapshot``. Everything in that trace is transient (the model state
was allocated before recording), so its peak is the step's activation + temporary peak. Printed
next to ``trainer_estimate``'s activations, split into the paper's FlashAttention terms and the
attention matrices this trainer materializes (fp32 scores kept by softmax plus the probabilities
in the compute dtype), to show how much of the gap that one term explains.

    PYTHONPATH=$PWD python benchmarks/memory_trainer_vs_estimate.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

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

CONFIGS = [
    dict(seq_len=128, compute_dtype="fp32"),
    dict(seq_len=256, compute_dtype="fp32"),
    dict(seq_len=512, compute_dtype="fp32"),
    dict(seq_len=256, compute_dtype="bf16"),
    dict(seq_len=256, compute_dtype="bf16", dim=128, n_heads=8, n_kv_heads=2, ffn_dim=384),
]


def measured_transient_peak(trainer: Trainer) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        trainer.train_step()
    entries = _profile_to_snapshot(prof)["device_traces"][0]
    events = pl.DataFrame({
        "rank": [0] * len(entries), "seq": list(range(len(entries))),
        "action": [e["action"] for e in entries], "addr": [e["addr"] for e in entries],
        "size": [e["size"] for e in entries], "category": [e.get("category") for e in entries],
    })
    pk = analyse(events).peaks.row(0, named=True)
    # blocks from before the recording that it freed (the previous step's leftovers) count in the
    # baseline; the activations are what the step added on top of them
    return pk["peak_allocated"] - pk["baseline_allocated"]


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, changes in enumerate(CONFIGS):
            cfg = TrainConfig(steps=1, micro_batches=2, backend="gloo", **changes).validate()
            manifest = write_manifest(cfg, Path(tmp) / f"run{i}", "gloo", [])
            trainer = Trainer(cfg, Comm.single())
            trainer.train_step()  # warm-up: the optimizer's buffers exist from here on
            measured = measured_transient_peak(trainer)
            est = trainer_estimate(manifest, 0)
            scores = est.detail["act_attention_matrices"]
            paper = est.activations - scores
            rows.append({"seq": cfg.seq_len, "dim": cfg.dim, "dtype": cfg.compute_dtype,
                         "measured_MiB": measured / 2**20, "paper_terms_MiB": paper / 2**20,
                         "measured/paper": measured / paper,
                         "with_attention_matrices_MiB": est.activations / 2**20,
                         "measured/estimate": measured / est.activations})
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=160, float_precision=2):
        print(pl.DataFrame(rows))


if __name__ == "__main__":
    main()
