"""The sequential reference reproduces real 4-rank gloo runs of the reference trainer bit for bit
(every micro-batch's per-layer forward activations, loss, every reduced gradient, every updated
parameter) over TP, CP, PP and DP layouts, bf16 and fp32 gradient buffers, native (gloo ring) and
canonical reduction orders, ZeRO-1 and ZeRO-2; each planted bug is detected and localized (forward
bugs to the first diverging activation and its tokens). One spawned world of 4 ranks runs every
config (launch_many)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from numerics.check import CheckReport, RunStateError, check_run, compare_states, load_states, reference_states
from numerics.plan import AccumulationPlan
from numerics.run_config import RunConfigError
from numerics.verdict import classify
from numerics.check import flatten_state
from reference_trainer.activations import activation_points
from reference_trainer.config import TrainConfig
from reference_trainer.data import Corpus
from reference_trainer.launch import launch_many

BASE = TrainConfig(n_layers=4, dim=64, seq_len=128, micro_batches=3, steps=1, dump_state=True,
                   record_activations=True, timeout_s=300)
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
    report = check_run(out, cfg)
    assert report.bit_exact, report.summary()
    table = report.table()
    n_params = len(AccumulationPlan.from_config(cfg).params)
    n_points = len(activation_points(cfg))  # embed, 4 per layer, norm, logits, token_loss
    assert n_points == 3 + 4 * cfg.n_layers + 1
    # activations, loss, every gradient, every parameter
    assert table.height == cfg.steps * (n_points + 1 + 2 * n_params)
    assert table["mismatches"].sum() == 0 and table["max_ulp"].max() == 0
    acts = table.filter(table["buffer"].str.starts_with("act/"))
    assert acts.height == cfg.steps * n_points
    # full tensors: every micro-batch of every DP replica, the whole sequence
    per_token = cfg.dp * cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len
    sizes = dict(zip(acts["buffer"], acts["numel"]))
    assert sizes["act/embed"] == sizes["act/layers.0.attention.heads"] == per_token * cfg.dim
    assert sizes["act/logits"] == per_token * cfg.vocab_size and sizes["act/token_loss"] == per_token * cfg.tp
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
    # step 0's forward does not depend on the DP reduction order: its activations stay exact
    assert [b.name for b in first.buffers if not b.name.startswith("act/")][0] == "loss"
    assert all(b.bit_exact for b in first.buffers if b.name.startswith("act/"))
    assert report.first_divergent[0] == 0 and report.first_divergent[1] != "loss"
    grads = [b for b in first.buffers if b.name.startswith("grad/")]
    assert sum(not b.bit_exact for b in grads) >= len(grads) // 2
    assert max(b.rel_err for b in grads) < 1e-2  # rounding-sized, not a bug
    # judged against that canonical belief, every mismatch is explained by a reordering (the DP
    # reduce-scatter in gloo's ring order, bit for bit; step 1 also the loss all-reduce): order, not bug
    verdicts = classify(AccumulationPlan.from_config(cfg.replace(reduce_order="canonical")), report.steps,
                        load_states(out, cfg.steps), wrong, flatten_state)
    assert len(verdicts) == sum(not b.bit_exact for s in report.steps for b in s.comparison.buffers)
    assert {v.kind for v in verdicts} == {"order"}, [v for v in verdicts if v.kind != "order"][:2]
    causes = {v.buffer: v.cause for v in verdicts if v.step == 0}
    assert causes["grad/head.weight"] == "dp (DP x CP gradient reduce-scatter) in gloo_ring order"


def test_a_run_missing_a_layer_is_a_bug_not_a_crash(runs, tmp_path):
    """A pipeline split that drops a layer: the run's manifest and dumps lack it. The check names
    the split and the missing buffers as findings instead of failing on a missing key."""
    cfg, out = runs["dp4_bf16buf_native_2steps"]
    run = tmp_path / "run"
    shutil.copytree(out, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stage_layers"] = [[0, 1, 2]]
    (run / "manifest.json").write_text(json.dumps(manifest))
    for k in range(cfg.steps):
        state = torch.load(run / "state" / f"step{k}.pt", weights_only=True)
        for key in ("grads", "params"):
            state[key] = {n: t for n, t in state[key].items() if not n.startswith("layers.3.")}
        state["activations"] = {n: t for n, t in state["activations"].items() if not n.startswith("layers.3")}
        torch.save(state, run / "state" / f"step{k}.pt")
    report = check_run(run)
    assert report.status == "bug" and not report.bit_exact
    assert report.findings[0] == ("pipeline split: the run placed layers [[0, 1, 2]], the config gives "
                                  "[[0, 1, 2, 3]]; layer(s) [3] on no stage")
    assert "layers [3] missing" in report.findings[1]


def test_other_tokens_on_one_rank_are_named_by_rank_and_micro_batch(runs, tmp_path):
    cfg, out = runs["tp2_dp2_bf16buf_native"]
    run = tmp_path / "run"
    shutil.copytree(out, run)
    state = torch.load(run / "state" / "step0.pt", weights_only=True)
    assert len(state["data_hashes"]) == cfg.world_size * cfg.micro_batches
    state["data_hashes"]["dp1/cp0/tp1/pp0/mb2"] = "0" * 64
    torch.save(state, run / "state" / "step0.pt")
    report = check_run(run)
    assert report.status == "bug"
    assert report.findings == ("data: step 0 micro-batch 2: rank 3 (dp 1, pp 0, cp 0, tp 1) trained on other "
                               "tokens than the config specifies",)


def test_cp_chunk_bug_is_localized_to_the_embedding_of_the_misassigned_chunks(runs):
    """CP rank 0 embeds chunk 2 where the plan puts chunk 3, CP rank 1 chunk 1 twice where the plan
    puts chunks 1 and 2: the first activation already holds wrong tokens, at positions 64..127 only."""
    cfg, out = runs["bug_cp-chunk"]
    report = check_run(out, cfg)
    assert report.first_divergent == (0, "act/embed")
    step = report.steps[0]
    where = step.divergence["act/embed"]
    chunk = cfg.seq_len // (2 * cfg.cp)
    assert (where.dp, where.micro_batch, where.sequence) == (0, 0, 0)
    assert min(where.tokens) >= 2 * chunk and len(where.tokens) > chunk  # chunks 0 and 1 are right
    assert where.micro_batches_differing == where.micro_batches_total == cfg.dp * cfg.micro_batches
    assert step.sharding[0] == (f"micro-batch 0 (dp 0) CP rank 0 held positions 0..{chunk - 1}, {2 * chunk}.."
                                f"{3 * chunk - 1} of sequence 0 (repeats: 0); the plan gives 0..{chunk - 1}, "
                                f"{3 * chunk}..{4 * chunk - 1}")
    assert f"(repeats: {chunk})" in step.sharding[1]  # CP rank 1 holds chunk 1 twice
    assert report.diagnosis.startswith("forward: the first diverging activation is the embed output, micro-batch 0")
    assert "input sharding differs from the plan" in report.diagnosis


def test_doc_mask_bug_is_localized_to_layer_0_attention_from_the_first_document_end(runs):
    """The key's document read one position late puts every document's preceding eos into its
    attention window (and takes an eos out of its own): attention of layer 0 is the first
    activation to differ, from the first eos of the sequence on; the embedding is exact."""
    cfg, out = runs["bug_doc-mask-off-by-one"]
    report = check_run(out, cfg)
    assert report.first_divergent == (0, "act/layers.0.attention.heads")
    rows = {r["buffer"]: r for r in report.table().iter_rows(named=True)}
    assert rows["act/embed"]["mismatches"] == 0
    where = report.steps[0].divergence["act/layers.0.attention.heads"]
    assert (where.dp, where.micro_batch, where.sequence) == (0, 0, 0)
    first_eos = int((Corpus(cfg).global_batch(0)[0, :-1] == cfg.eos_id).nonzero()[0])
    assert where.tokens[0] == first_eos
    assert len(where.tokens) >= 0.9 * (cfg.seq_len - first_eos)
    assert report.steps[0].sharding == ()  # the sharding itself is right
    assert report.diagnosis.startswith(f"forward: the first diverging activation is the layers.0.attention.heads "
                                       f"output, micro-batch 0 (dp 0), sequence 0: tokens {first_eos}..")


def test_missing_tp_backward_reduction_is_localized_to_the_last_mlp(runs):
    cfg, out = runs["bug_tp-bwd-reduce"]
    report = check_run(out, cfg)
    assert report.first_divergent == (0, f"grad/layers.{cfg.n_layers - 1}.mlp_norm.weight")
    rows = {r["buffer"]: r for r in report.table().iter_rows(named=True)}
    # the loss and every gradient computed before the bug in backward order stay exact
    last = cfg.n_layers - 1
    for name in ("loss", "grad/head.weight", "grad/norm.weight", f"grad/layers.{last}.w2.weight",
                 f"grad/layers.{last}.w3.weight", f"grad/layers.{last}.w1.weight"):
        assert rows[name]["mismatches"] == 0, name
    assert all(r["mismatches"] == 0 for n, r in rows.items() if n.startswith("act/"))  # a backward bug
    assert report.diagnosis.startswith(f"backward: the loss matches; the first wrong gradient in backward order is layers.{last}.mlp_norm.weight")
    # located: the last layer's mlp_norm weight is replicated over TP; its first wrong element's shard and rank
    assert report.status == "bug" and report.first_bug.buffer == f"grad/layers.{last}.mlp_norm.weight"
    assert "every TP rank (replicated), dp x cp shard" in report.first_bug.location


def test_double_scaled_dp_gradient_is_a_reduction_bug(runs):
    report = check_run(runs["bug_dp-double-scale"][1])
    rows = report.table()
    assert rows.filter(rows["buffer"] == "loss")["mismatches"].item() == 0
    grads = rows.filter(rows["buffer"].str.starts_with("grad/"))
    # dividing by dp*cp = 2 is exact: every nonzero gradient element is exactly half
    assert set(round(r, 9) for r in grads["norm_ratio"].to_list()) == {0.5}
    assert report.first_divergent == (0, "grad/head.weight")
    assert rows.filter(rows["buffer"].str.starts_with("act/"))["mismatches"].sum() == 0
    assert report.diagnosis.startswith("gradient reduction")


def test_missing_state_is_a_clear_error(runs, tmp_path):
    cfg, _ = runs["tp2_dp2_bf16buf_native"]
    with pytest.raises(RunConfigError, match="manifest.json: cannot read"):
        check_run(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"config": cfg.as_dict()}))
    with pytest.raises(RunStateError, match="step0.pt: missing"):
        check_run(tmp_path)
    (tmp_path / "state").mkdir()
    torch.save({"loss": 1.0}, tmp_path / "state" / "step0.pt")
    with pytest.raises(RunStateError, match="expected a dict with loss, grads and params"):
        check_run(tmp_path)
    torch.save({"loss": 1.0, "grads": {}, "params": {}}, tmp_path / "state" / "step0.pt")
    with pytest.raises(RunStateError, match="step0.pt: no activation records .*--record-activations"):
        check_run(tmp_path)


def test_a_missing_activation_shard_is_named(runs):
    cfg, out = runs["tp2_dp2_bf16buf_native"]
    plan = AccumulationPlan.from_config(cfg)
    state = load_states(out, 1, activations=True)[0]
    del state["activations"]["layers.1.mlp/dp1/cp0/tp1/mb2"]
    with pytest.raises(RunStateError, match="parallel step 0: no activation record 'layers.1.mlp/dp1/cp0/tp1/mb2'"):
        compare_states([state], reference_states(cfg), plan)


def test_an_order_only_difference_exits_4_or_0_when_accepted(runs, tmp_path):
    """The gloo-ring run with a manifest claiming the canonical order: every mismatch is a reordering."""
    from click.testing import CliRunner

    from numerics.cli import check_exit_code, main

    cfg, out = runs["dp4_bf16buf_native_2steps"]
    run = tmp_path / "run"
    shutil.copytree(out, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["reduce_order"] = "canonical"
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["check", "--run", str(run), "--json"])
    assert result.exit_code == 4, result.output
    report = json.loads(result.output)
    assert report["status"] == "order" and report["first_bug"] is None and report["verdicts"]
    assert report["summary"].startswith("ORDER ONLY: first diverging buffer")
    assert check_exit_code("order", accept_order=True) == 0 and check_exit_code("bug", accept_order=True) == 1
