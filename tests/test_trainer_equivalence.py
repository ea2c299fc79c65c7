"""Parallel layouts of the reference trainer match a single-process run of the same model on the
same global batch (loss, every gradient, every updated parameter, two steps).

Tolerance (fp32 compute, fp32 accumulation and reduction): the runs differ only in the order of
floating-point additions: TP splits the contracted dimension of row-parallel GEMMs and the vocab
sum of the loss, CP splits the dK/dV sums over query chunks, DP x CP and the micro-batch
accumulation sum the per-token gradient contributions in another order, and GEMMs of other shapes
block their sums differently. Each such reordering moves a result by a few fp32 ulps of the
magnitudes summed, so after step 0 we allow |a - b| <= 5e-6 * max|b| per gradient tensor (about
40 ulps of the largest element; measured <= 6e-7), far below what a wrong or missing reduction
produces (O(1) relative). The loss must agree to 1e-6 relative (measured 1e-7). Updated
parameters allow 1e-4 absolute: Adam's first step moves every weight by about lr = 3e-3 times
sign(g), so an element whose gradient is ~0 in both runs may step differently (measured 1.5e-5); a
real error moves many weights by ~lr. Step 1's gradients are taken at those slightly different
weights, so they get 2e-4 * max|b| (measured 3e-5).
A bf16 run is checked against the fp32 reference at bf16 precision (3e-2 normwise).
"""

from __future__ import annotations

import pytest
import torch

from reference_trainer.compare import diff_states
from reference_trainer.config import TrainConfig
from reference_trainer.launch import launch_many, read_progress
from reference_trainer.train import run_single_process

BASE = TrainConfig(compute_dtype="fp32", n_layers=4, dim=64, seq_len=128, micro_batches=4,
                   steps=2, dump_state=True, timeout_s=300)

CASES = {
    "tp2_cp2_pp2_dp1": BASE.replace(tp=2, cp=2, pp=2),
    "tp2_pp2_dp2_interleaved_n1": BASE.replace(tp=2, pp=2, dp=2, vstages=2, consecutive=1),
    "cp2_pp2_dp2_docshard_zero2_canonical": BASE.replace(cp=2, pp=2, dp=2, cp_sharding="document",
                                                         zero_stage=2, reduce_order="canonical"),
    "tp2_cp2_dp2_mbs2_canonical": BASE.replace(tp=2, cp=2, dp=2, micro_batch_size=2,
                                               micro_batches=2, reduce_order="canonical"),
    "tp2_cp2_pp2_bf16": BASE.replace(tp=2, cp=2, pp=2, compute_dtype="bf16", reduce_dtype="bf16"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("equiv")
    results = launch_many([(cfg, root / name) for name, cfg in CASES.items()])
    states = {name: [torch.load(r.out / "state" / f"step{k}.pt") for k in range(BASE.steps)]
              for name, r in zip(CASES, results)}
    return {"results": dict(zip(CASES, results)), "states": states}


def reference(cfg: TrainConfig) -> list[dict]:
    return run_single_process(cfg.replace(compute_dtype="fp32", reduce_dtype="fp32").single_process())[1]


@pytest.mark.parametrize("name", [n for n in CASES if "bf16" not in n])
def test_layout_matches_single_process(runs, name):
    cfg = CASES[name]
    ref = reference(cfg)
    for step, (got, want) in enumerate(zip(runs["states"][name], ref)):
        d = diff_states(got, want)
        assert d.loss_diff <= 1e-6 * abs(d.loss_b), (name, step, d.loss_a, d.loss_b)
        for t in d.tensors:
            if t.kind == "grads":
                assert t.max_abs <= (5e-6 if step == 0 else 2e-4) * t.ref_max, (name, step, t)
            else:
                assert t.max_abs <= 1e-4, (name, step, t)
    assert len([t for t in d.tensors if t.kind == "grads"]) == 9 * cfg.n_layers + 3


def test_bf16_close_to_fp32_reference(runs):
    cfg = CASES["tp2_cp2_pp2_bf16"]
    d = diff_states(runs["states"]["tp2_cp2_pp2_bf16"][0], reference(cfg)[0])
    assert d.loss_diff <= 1e-2 * abs(d.loss_b)
    assert max(t.normwise for t in d.tensors if t.kind == "grads") < 3e-2
    assert not d.bit_identical  # bf16 really ran in bf16


def test_manifest_and_metrics(runs):
    r = runs["results"]["tp2_cp2_pp2_dp1"]
    m = r.manifest
    assert m["world_size"] == 8 and m["layout"] == {"tp": 2, "cp": 2, "pp": 2, "dp": 1}
    assert m["backend"] == "gloo" and m["torch_version"] == torch.__version__
    assert len(m["pids"]) == 8 and len(set(m["pids"])) == 8 and m["faults"] == []
    assert TrainConfig.from_dict(m["config"]).tp == 2
    assert (r.out / "manifest.json").exists()
    assert m["stage_layers"] == [[0, 1], [2, 3]]
    assert [len(s) for s in m["pipeline_schedule"]] == [8, 8] and m["pipeline_schedule"][1][:2] == ["F1.0", "B1.0"]
    steps = r.metrics["steps"]
    assert [s["step"] for s in steps] == [0, 1] and all(s["seconds"] > 0 for s in steps)
    assert read_progress(r.out) == steps  # the per-step progress log agrees with the summary
    assert steps[0]["loss"] == pytest.approx(runs["states"]["tp2_cp2_pp2_dp1"][0]["loss"])

