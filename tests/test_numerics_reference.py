"""The accumulation plan, the sequential reference against the single-process trainer (no spawn),
the `numerics check` / `numerics precision --model-config` command lines and the planted-bug flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from numerics.check import compare_states
from numerics.cli import main
from numerics.model_precision import gradient_terms, load_config
from numerics.plan import AccumulationPlan, PlanError
from numerics.reference_step import ReferenceRun
from reference_trainer.config import ConfigError, TrainConfig
from reference_trainer.context_parallel import shard_positions
from reference_trainer.data import document_ids
from reference_trainer.train import run_single_process

TINY = TrainConfig(n_layers=2, dim=64, seq_len=128, micro_batches=2, steps=2, dump_state=True)


def test_sequence_sharding_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i():
    plan = AccumulationPlan.from_config(TINY.replace(cp=2, seq_len=16))
    pos = plan.cp_positions(torch.zeros(1, 16, dtype=torch.long))[0]
    assert pos.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("sharding", ["sequence", "document"])
def test_cp_positions_agree_with_the_trainer_on_packed_documents(sharding):
    cfg = TINY.replace(cp=2, cp_sharding=sharding)
    from reference_trainer.data import Corpus

    doc = document_ids(Corpus(cfg).global_batch(0)[:, :-1], cfg.eos_id)
    pos = AccumulationPlan.from_config(cfg).cp_positions(doc)
    for row, p in zip(doc, pos):
        assert torch.equal(p, shard_positions(row, 2, sharding))
        assert sorted(p.flatten().tolist()) == list(range(cfg.seq_len))  # a partition


def test_buckets_are_padded_to_the_dp_cp_group_and_list_every_parameter():
    cfg = TINY.replace(tp=2, cp=2, dp=2, pp=2, n_layers=4, dim=60, n_heads=2, n_kv_heads=2)
    plan = AccumulationPlan.from_config(cfg)
    assert sorted(plan.backward_order()) == sorted(p.name for p in plan.params)
    for bp in plan.buckets:
        assert bp.padded % 4 == 0 and bp.padded - sum(bp.shard_numels) < 4
        kinds = [p.tp_dim is None for p in bp.params]
        assert kinds == sorted(kinds)  # TP-sharded first, then the norm weights
        assert bp.replicated.stop == sum(bp.shard_numels)


def test_native_nccl_reductions_are_refused():
    with pytest.raises(PlanError, match="canonical"):
        AccumulationPlan.from_config(TINY.replace(backend="nccl"))


@pytest.mark.parametrize("changes", [{}, {"compute_dtype": "fp32", "grad_accum_dtype": "bf16"},
                                     {"zero_stage": 2, "reduce_dtype": "bf16", "record_activations": True}])
def test_reference_matches_the_single_process_trainer_bit_for_bit(changes):
    cfg = TINY.replace(**changes)
    _, trainer = run_single_process(cfg)
    ours = ReferenceRun(AccumulationPlan.from_config(cfg))
    checks = compare_states(trainer, [ours.step() for _ in range(cfg.steps)], AccumulationPlan.from_config(cfg))
    assert all(c.comparison.bit_exact for c in checks), [c.comparison.first_divergent for c in checks]
    assert trainer[1]["loss"] < trainer[0]["loss"]  # it trains
    n_acts = sum(b.name.startswith("act/") for b in checks[0].comparison.buffers)
    assert n_acts == (3 + 4 * cfg.n_layers + 1 if cfg.record_activations else 0)


def test_recording_activations_changes_no_bit_of_training():
    plain = run_single_process(TINY)[1]
    recorded = run_single_process(TINY.replace(record_activations=True))[1]
    for a, b in zip(plain, recorded):
        assert a["loss"] == b["loss"] and "activations" not in a and len(b["activations"]) == 2 * (3 + 4 * 2 + 1)
        for key in ("grads", "params"):
            assert all(torch.equal(a[key][n].view(torch.int32), b[key][n].view(torch.int32)) for n in a[key])


def test_record_activations_needs_dump_state():
    with pytest.raises(ConfigError, match="record_activations needs dump_state"):
        TINY.replace(dump_state=False, record_activations=True).validate()


def test_gradient_terms_sum_to_the_reduced_gradient():
    cfg = TINY.replace(cp=2, tp=2, dp=2, compute_dtype="fp32", steps=1)
    terms = gradient_terms(cfg)
    ref = ReferenceRun(AccumulationPlan.from_config(cfg)).step()
    for name, t in terms.items():
        assert t.shape[:2] == (cfg.micro_batches, 4)
        exact = t.sum(dim=(0, 1)).view(ref["grads"][name].shape)
        assert torch.allclose(exact, ref["grads"][name].double(), rtol=1e-4, atol=1e-7), name


def test_plant_bug_is_validated():
    with pytest.raises(ConfigError, match="plant_bug"):
        TINY.replace(plant_bug="typo").validate()


def test_check_cli_rejects_bad_config_with_exit_code_2():
    result = CliRunner().invoke(main, ["check", "--tp", "3"])
    assert result.exit_code == 2 and "not divisible by tp 3" in result.output


def test_check_cli_exit_codes_and_json(tmp_path):
    args = ["--tp", "2", "--n-layers", "2", "--steps", "1", "--micro-batches", "2", "--json"]
    ok = CliRunner().invoke(main, ["check", *args, "--out", str(tmp_path / "ok")])
    assert ok.exit_code == 0, ok.output
    ok_report = json.loads(ok.output)
    assert ok_report["bit_exact"] is True and ok_report["first_divergent_where"] is None
    assert any(r["buffer"] == "act/layers.1.attention.heads" for r in ok_report["buffers"])
    bad = CliRunner().invoke(main, ["check", *args, "--plant-bug", "tp-bwd-reduce", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 1, bad.output
    report = json.loads(bad.output)
    assert report["first_divergent"] == {"step": 0, "buffer": "grad/layers.1.mlp_norm.weight"}
    assert sum(r["count"] for r in report["first_divergent_ulp_histogram"]) == 64
    assert report["diagnosis"].startswith("backward")
    kept = json.loads((tmp_path / "bad" / "numerics.json").read_text())
    bad_rows = [r for r in kept if r["mismatches"] > 0]
    assert any(r["buffer"] == "grad/layers.1.mlp_norm.weight" for r in bad_rows)
    assert all(r["mismatches"] == 0 for r in json.loads((tmp_path / "ok" / "numerics.json").read_text()))


def test_check_cli_names_the_layer_of_a_forward_bug(tmp_path):
    args = ["--cp", "2", "--n-layers", "2", "--steps", "1", "--micro-batches", "2", "--plant-bug", "doc-mask-off-by-one"]
    human = CliRunner().invoke(main, ["check", *args])
    assert human.exit_code == 1, human.output
    assert "first diverging buffer 'act/layers.0.attention.heads'" in human.output
    assert "where the differing activations differ first, in forward order:" in human.output
    assert "step 0 layers.0.attention.heads: micro-batch 0 (dp 0), sequence 0: tokens 6..127 differ" in human.output
    blind = CliRunner().invoke(main, ["check", *args, "--no-activations", "--json"])
    assert blind.exit_code == 1, blind.output
    report = json.loads(blind.output)  # without records only the loss can say "forward"
    assert report["first_divergent"] == {"step": 0, "buffer": "loss"} and report["first_divergent_where"] is None
    assert not any(r["buffer"].startswith("act/") for r in report["buffers"])


def test_precision_model_config_measures_accumulation_and_reduce_apart(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("n_layers: 1\ndim: 32\nseq_len: 64\ndp: 2\nmicro_batches: 8\n")
    assert load_config(path).n_layers == 1
    result = CliRunner().invoke(main, ["precision", "--model-config", str(path), "--steps", "2", "--seeds", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    n_buffers = len(AccumulationPlan.from_config(load_config(path)).params)
    rows = report["buffers"]
    assert len(rows) == n_buffers and {r["terms"] for r in rows} == {16}  # the config's dp x micro-batches
    for r in rows:
        # fp32 accumulation of bf16 gradients and an fp32 two-rank reduce sit far below the bf16 floor
        assert r["accum_fp32"] < 1e-5 * r["floor"] + 1e-12 and r["reduce_fp32"] < 1e-5 * r["floor"] + 1e-12
        assert r["accum_bf16"] > r["floor"] / 2 and r["reduce_bf16"] > 0
        assert r["accumulation"] in ("needs FP32", "bf16 ok") or r["accumulation"].startswith("borderline (1/2")
    assert report["summary"].startswith(("accumulate in FP32", "accumulate in BF16"))
    assert "dp 2 x cp 1 x 8 micro-batches, 2 steps" in report["summary"] and "Llama 3" in report["summary"]
    assert set(report["loss_divergence"]) == {"bf16/bf16", "bf16/fp32", "fp32/bf16", "fp32/fp32"}
    assert report["loss_divergence"]["bf16/bf16"] > report["loss_divergence"]["fp32/fp32"]
    human = CliRunner().invoke(main, ["precision", "--model-config", str(path), "--steps", "1", "--seeds", "1",
                                      "-m", "2"])
    assert human.exit_code == 0, human.output
    assert human.output.startswith("accumulate in") and "x 2 micro-batches" in human.output.splitlines()[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layers: 2\nwarp: 9\n")
    result = CliRunner().invoke(main, ["precision", "--model-config", str(bad)])
    assert result.exit_code == 2 and "bad.yaml" in result.output and "warp" in result.output


def test_a_run_manifest_is_a_model_config():
    # a trainer manifest is JSON with floats like 1e-05, which YAML 1.1 would read as strings
    manifest = Path(__file__).resolve().parents[1] / "sample_traces" / "slow_rank_8" / "manifest.json"
    cfg = load_config(manifest)
    assert isinstance(cfg.norm_eps, float) and cfg.norm_eps == 1e-5 and (cfg.tp, cfg.cp, cfg.pp) == (2, 2, 2)


def test_pytest_api_raises_with_the_first_diverging_buffer(tmp_path):
    import numerics

    cfg = TINY.replace(cp=2, steps=1, plant_bug="cp-chunk")
    with pytest.raises(AssertionError, match=r"first diverging buffer 'act/embed'[\s\S]*"
                                             r"forward: the first diverging activation is the embed output"):
        numerics.assert_parallel_matches_reference(cfg, tmp_path)
    assert (tmp_path / "state" / "step0.pt").exists()
