"""Bit-exact match of 8-rank layouts that combine three dimensions (tp2 cp2 pp2, tp2 cp2 dp2,
cp2 pp2 dp2 with interleaving) in one spawned world. Marked slow: the default suite covers every
dimension pairwise on 4 ranks (test_numerics_check.py); benchmarks/numerics_all_layouts.py covers
all 16 layouts."""

from __future__ import annotations

import pytest

from numerics.check import check_run
from reference_trainer.config import TrainConfig
from reference_trainer.launch import launch_many

pytestmark = pytest.mark.slow

BASE = TrainConfig(n_layers=4, dim=64, seq_len=128, micro_batches=4, steps=2, dump_state=True,
                   record_activations=True, timeout_s=600)
CASES = {
    "tp2_cp2_pp2_bf16buf_native": BASE.replace(tp=2, cp=2, pp=2, grad_accum_dtype="bf16", reduce_dtype="bf16"),
    "tp2_cp2_dp2_canonical_zero2": BASE.replace(tp=2, cp=2, dp=2, reduce_order="canonical", zero_stage=2),
    "cp2_pp2_dp2_interleaved_docshard": BASE.replace(cp=2, pp=2, dp=2, vstages=2, consecutive=1,
                                                     cp_sharding="document"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("numerics_check_8rank")
    jobs = {name: (cfg, root / name) for name, cfg in CASES.items()}
    launch_many(list(jobs.values()))
    return jobs


@pytest.mark.parametrize("name", list(CASES))
def test_eight_rank_layout_is_bit_exact(runs, name):
    report = check_run(runs[name][1])
    assert report.bit_exact, report.summary()
    assert report.table()["mismatches"].sum() == 0
