"""The sequential reference reproduces real 4-rank gloo runs of the reference trainer bit for bit
(loss, every reduced gradient, every updated parameter) over TP, CP, PP and DP layouts, bf16 and fp32
gradient buffers, native (gloo ring) and canonical reduction orders, ZeRO-1 and ZeRO-2; each planted
bug is detected and localized. One spawned world of 4 ranks runs every config (launch_many)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numerics.check import CheckReport, RunStateError, check_run, compare_states, load_states, reference_states
from numerics.plan import AccumulationPlan
from reference_trainer.config import TrainConfig
from reference_trainer.launch import launch_many

BASE = TrainConfig(n_layers=4, dim=64, seq_len=128, micro_batches=3, steps=1, dump_state=True, timeout_s=300)
BF16_BUFFERS = dict(grad_accum_dtype="bf16", reduce_dtype="bf16")

EXACT = {
    "tp2_dp2_bf16buf_native": BASE.replace(tp=2, dp=2, **BF16_BUFFERS),
    "cp2_pp2_fp32buf_canonical": BASE.replace(cp=2, pp=2, reduce_order="canonical"),
    "tp2_cp2_bf16buf_canonical_zero2": BASE.replace(tp=2, cp=2, zero_stage=2, reduce_order="canonical", **BF16_BUFFERS),
    "pp2_dp2_interleaved_fp32compute": BASE.replace(pp=2, dp=2, vstages=2, consecutive=1, compute_dtype="fp32"),
    "tp2_pp2_afab_bf16buf": BASE.replace(tp=2, pp=2, schedule="afab", **BF16_BUFFERS),
    "cp2_dp2_docshard_zero2_native": BASE.replace(cp=2, dp=2, cp_sharding="document", zero_stage=2),
    "dp4_bf16buf_native_2steps": BASE.replace(dp=4, steps=2, **BF16_BUFFERS),
    "tp2_cp2_mbs2_native": BASE.replace(tp=2, cp=2, micro_batch_size=2, micro_batches=2),
}
BUGS = {
    "cp-chunk": BASE.replace(cp=2, dp=2, plant_bug="cp-chunk"),
    "doc-mask-off-by-one": BASE.replace(cp=2, dp=2, plant_bug="doc-mask-off-by-one"),
    "tp-bwd-reduce": BASE.replace(tp=2, dp=2, plant_bug="tp-bwd-reduce"),
    "dp-double-scale": BASE.replace(tp=2, dp=2, plant_bug="dp-double-scale"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[TrainConfig, Path]]:
    root = tmp_path_factory.mktemp("numerics_check")
    jobs = {name: (cfg, root / name) for name, cfg in {**EXACT, **{f"bug_{k}": v for k, v in BUGS.items()}}.items()}
    launch_many(list(jobs.values()))
    return jobs


@pytest.mark.parametrize("name", list(EXACT))
def test_parallel_run_matches_reference_bit_for_bit(runs, name):
    cfg, out = runs[name]
    report = check_run(cfg, out)
    assert report.bit_exact, report.summary()
    table = report.table()
    n_params = len(AccumulationPlan.from_config(cfg).params)
    assert table.height == cfg.steps * (1 + 2 * n_params)  # loss, every gradient, every parameter
    assert table["mismatches"].sum() == 0 and table["max_ulp"].max() == 0
    assert report.first_divergent is None and report.diagnosis.startswith("bit-exact")


def test_reduction_order_is_not_vacuous(runs):
    """Emulating the 4-rank gloo-ring run with the canonical order instead misses bits (and
    nothing else changes), so the bit-exact match above really pins the accumulation order."""
    cfg, out = runs["dp4_bf16buf_native_2steps"]
    plan = AccumulationPlan.from_config(cfg)
    wrong = reference_states(cfg.replace(reduce_order="canonical"))
    report = CheckReport(cfg, compare_states(load_states(out, cfg.steps), wrong, plan))
    assert not report.bit_exact
    first = report.steps[0].comparison
    assert first.buffers[0].name == "loss"  # the 4-way loss sum already associates differently
    grads = [b for b in first.buffers if b.name.startswith("grad/")]
    assert sum(not b.bit_exact for b in grads) >= len(grads) // 2
    assert max(b.rel_err for b in grads) < 1e-2  # rounding-sized, not a bug


def test_cp_chunk_bug_changes_the_forward(runs):
    report = check_run(*runs["bug_cp-chunk"])
    assert report.first_divergent == (0, "loss")
    assert report.diagnosis.startswith("forward")


def test_doc_mask_bug_changes_the_forward(runs):
    report = check_run(*runs["bug_doc-mask-off-by-one"])
    assert report.first_divergent == (0, "loss")
    assert report.table()["mismatches"].sum() > 0


def test_missing_tp_backward_reduction_is_localized_to_the_last_mlp(runs):
    cfg, out = runs["bug_tp-bwd-reduce"]
    report = check_run(cfg, out)
    assert report.first_divergent == (0, f"grad/layers.{cfg.n_layers - 1}.mlp_norm.weight")
    rows = {r["buffer"]: r for r in report.table().iter_rows(named=True)}
    # the loss and every gradient computed before the bug in backward order stay exact
    last = cfg.n_layers - 1
    for name in ("loss", "grad/head.weight", "grad/norm.weight", f"grad/layers.{last}.w2.weight",
                 f"grad/layers.{last}.w3.weight", f"grad/layers.{last}.w1.weight"):
        assert rows[name]["mismatches"] == 0, name
    assert report.diagnosis == f"backward: the loss matches; the first wrong gradient in backward order is layers.{last}.mlp_norm.weight"


def test_double_scaled_dp_gradient_is_a_reduction_bug(runs):
    report = check_run(*runs["bug_dp-double-scale"])
    rows = report.table()
    assert rows.filter(rows["buffer"] == "loss")["mismatches"].item() == 0
    grads = rows.filter(rows["buffer"].str.starts_with("grad/"))
    # dividing by dp*cp = 2 is exact: every nonzero gradient element is exactly half
    assert set(round(r, 9) for r in grads["norm_ratio"].to_list()) == {0.5}
    assert report.first_divergent == (0, "grad/head.weight")
    assert report.diagnosis.startswith("gradient reduction")


def test_missing_state_is_a_clear_error(runs, tmp_path):
    cfg, _ = runs["tp2_dp2_bf16buf_native"]
    with pytest.raises(RunStateError, match="step0.pt: missing"):
        check_run(cfg, tmp_path)
    (tmp_path / "state").mkdir()
    torch.save({"loss": 1.0}, tmp_path / "state" / "step0.pt")
    with pytest.raises(RunStateError, match="expected a dict with loss, grads and params"):
        check_run(cfg, tmp_path)
