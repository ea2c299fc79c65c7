"""The estimator's model-state bytes equal the reference trainer's real tensors, rank by rank.

One spawned world of 8 gloo ranks builds the trainer for three configs (TP/CP/PP/DP mixes, virtual
stages, uneven layer splits, bf16/fp32 compute and accumulation, ZeRO-1/2, a bucket that needs
padding), runs one optimizer step, and reports the bytes of every parameter and optimizer tensor.
``tracekit.memory_trainer.trainer_estimate`` sees only the manifest the trainer writes and must
match them exactly. Skipped where the trainer package is not importable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# (a bare reference_trainer/ folder imports as a namespace package: ask for a real module)
pytest.importorskip("reference_trainer.train", reason="needs reference_trainer (the trainer branch)")

import torch  # noqa: E402

from reference_trainer.comm import Comm  # noqa: E402
from reference_trainer.config import TrainConfig  # noqa: E402
from reference_trainer.launch import free_port, run_world, write_manifest  # noqa: E402
from reference_trainer.train import Trainer  # noqa: E402
from tracekit.llama_dims import EstimateError  # noqa: E402
from tracekit.memory_trainer import trainer_estimate, trainer_state  # noqa: E402

WORLD = 8
CONFIGS = {
    # 6 layers over 2 x 2 virtual stages: the trainer's split is [1, 2, 2, 1]
    "tp2_pp2_dp2_v2": dict(tp=2, pp=2, dp=2, vstages=2, n_layers=6, compute_dtype="bf16",
                           grad_accum_dtype="fp32"),
    # 5 layers on 2 stages ([3, 2]); fp32 compute, bf16 accumulation, ZeRO-2
    "cp2_pp2_dp2": dict(cp=2, pp=2, dp=2, n_layers=5, compute_dtype="fp32", grad_accum_dtype="bf16",
                        zero_stage=2, micro_batches=2),
    # one bucket of 9216 + 2*13032 + 9252 = 44532 = 8*5566 + 4 parameters over dp x cp = 8: padded
    "cp2_dp4_pad": dict(cp=2, dp=4, dim=36, n_heads=2, n_kv_heads=2, ffn_dim=72, n_layers=2,
                        seq_len=64, compute_dtype="bf16", grad_accum_dtype="bf16"),
}


def _config(changes: dict) -> TrainConfig:
    return TrainConfig(steps=1, micro_batches=changes.pop("micro_batches", 4), backend="gloo",
                       **changes).validate()


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _worker(rank: int, world: int, jobs: dict[str, dict], init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    comm = Comm.init_world("gloo", rank, world, init_method, 120.0, "native", torch.device("cpu"))
    report = {}
    try:
        for name, changes in jobs.items():
            trainer = Trainer(_config(dict(changes)), comm)
            trainer.train_step()
            buckets = list(trainer.optimizer.buckets.values())
            report[name] = {
                "params": sum(p.numel() for st in trainer.stages.values() for p in st.params.values()),
                "weights": _bytes(*(p for st in trainer.stages.values() for p in st.params.values())),
                "gradients": sum(_bytes(b.grad, b.grad_shard, b.reduced) for b in buckets),
                "optimizer": sum(_bytes(b.master, b.exp_avg, b.exp_avg_sq) for b in buckets),
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        comm.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_mem")
    manifests = {name: write_manifest(_config(dict(ch)), out / name, "gloo", [])
                 for name, ch in CONFIGS.items()}
    run_world(_worker, WORLD, (CONFIGS, f"tcp://127.0.0.1:{free_port()}", str(out)), timeout_s=300)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return manifests, reports


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_state_bytes_equal_the_trainers_tensors(run, name):
    manifests, reports = run
    for rank in range(WORLD):
        real = reports[rank][name]
        est = trainer_estimate(manifests[name], rank)
        assert est.params == real["params"], (name, rank)
        assert (est.weights, est.gradients, est.optimizer) == (
            real["weights"], real["gradients"], real["optimizer"]), (name, rank)


def test_padding_and_stage_split_are_exercised(run):
    manifests, reports = run
    pad = trainer_estimate(manifests["cp2_dp4_pad"], 0)
    assert pad.params == 44532 and pad.detail["shard_params"] == 5567  # ceil(44532 / 8)
    assert manifests["tp2_pp2_dp2_v2"]["stage_layers"] == [[0], [1, 2], [3, 4], [5]]
    # rank 0 holds virtual stages 0 (embedding + 1 layer) and 2 (2 layers); the last PP stage the head
    first, last = (trainer_estimate(manifests["tp2_pp2_dp2_v2"], r) for r in (0, 2))
    assert first.detail["act_embedding"] > 0 and first.detail["act_head"] == 0
    assert last.detail["act_head"] > 0 and last.detail["act_embedding"] == 0


def test_bad_manifests_raise_clearly(run):
    manifests, _ = run
    m = dict(manifests["cp2_pp2_dp2"])
    with pytest.raises(EstimateError, match="stage_layers has 1 stages and 5 layers; expected 2"):
        trainer_estimate({**m, "stage_layers": [[0, 1, 2, 3, 4]]}, 0)
    with pytest.raises(EstimateError, match="manifest lacks 'stage_layers'"):
        trainer_estimate({k: v for k, v in m.items() if k != "stage_layers"}, 0)
    with pytest.raises(EstimateError, match="unknown dtype 'fp8'"):
        trainer_state("fp8", "fp32")
