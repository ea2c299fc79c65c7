"""What-if replay (tracekit.analysis.whatif) against the what-if analyzer's published results on its
three real traces (AR, ST, SE: the oracle is its result-*.json, read here as plain JSON), on
trainer runs (replay as recorded, healing the injected fault), on hand-built graphs, and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from tracekit.analysis.tables import RunTables
from tracekit.analysis.whatif import WhatIfError, analyze, saving
from tracekit.analysis.whatif.graph import StepGraph, topological_order
from tracekit.analysis.whatif.replay import recorded, replay
from tracekit.cli import main as cli
from tracekit.ingest.optable import read_optable

ROOT = Path(__file__).resolve().parents[1]
_CANDIDATES = [ROOT / "tests" / "fixtures" / "real" / "wia"] + [
    p / "shared" / "fixtures" / "real" / "wia" for p in ROOT.parents]
WIA = next((p for p in _CANDIDATES if (p / "AR").is_dir()), _CANDIDATES[0])
needs_wia = pytest.mark.skipif(not (WIA / "AR").is_dir(), reason=f"real what-if traces not found at {WIA}")
SAMPLES = ROOT / "sample_traces"
TRIALS = ("AR", "ST", "SE")


def _close(ours: float, theirs: float, rel: float) -> bool:
    return abs(ours / theirs - 1.0) <= rel


@pytest.fixture(scope="module")
def wia() -> dict:
    out = {}
    for t in TRIALS:
        tables = RunTables.from_mapping(read_optable(WIA / t / f"trace-{t}.parquet", run_id=f"wia-{t}"))
        oracle = json.loads((WIA / t / f"result-{t}.json").read_text())
        out[t] = (analyze(tables), oracle)
    return out


@needs_wia
@pytest.mark.parametrize("trial", TRIALS)
def test_slowdown_and_ideal_step_match_the_analyzer(wia, trial):
    ours, theirs = wia[trial]
    ideal = np.mean(list(theirs["step_t_noblk"].values())) * 1e9
    assert _close(ours.ideal_ns, ideal, 0.05), (ours.ideal_ns, ideal)
    assert _close(ours.slowdown, theirs["blocking_slowdown"], 0.05)  # measured over ideal
    assert _close(ours.blocking_slowdown, theirs["blocking_slowdown"], 0.005)  # the same quantity
    assert ours.slowdown > 1.15  # every trace has a straggler problem


@needs_wia
@pytest.mark.parametrize("trial", TRIALS)
def test_decomposition_by_dp_rank_stage_and_op_type_match_the_analyzer(wia, trial):
    ours, theirs = wia[trial]
    for frame, key in ((ours.by_dp, "dp_rank"), (ours.by_stage, "stage"), (ours.by_optype, "optype")):
        mine = {str(k): v for k, v in frame.iter_rows()}
        ref = theirs[f"blocking_decompose_by_{key}"]
        assert set(mine) == set(ref), key
        bad = {k: (mine[k], ref[k]) for k in ref if not _close(mine[k], ref[k], 0.05)}
        assert not bad, (key, bad)


@needs_wia
def test_the_culprits_of_the_real_traces(wia):
    ar, st, se = (wia[t][0] for t in TRIALS)
    assert ar.by_dp["key"][0] == 0 and ar.by_stage["key"][0] == 0  # one slowed worker: dp 0, stage 0
    assert ar.by_dp["slowdown"][0] > 1.9 and ar.by_dp["slowdown"][1] < 1.05
    assert st.by_stage["key"][0] == 3  # the last stage is too long
    assert se.by_dp["slowdown"].max() < 1.3  # sequence imbalance: no single DP rank explains it


@needs_wia
@pytest.mark.parametrize("trial", TRIALS)
def test_replay_as_recorded_reproduces_each_step(wia, trial):
    ours, theirs = wia[trial]
    measured = dict(zip(ours.per_step["step"].to_list(), ours.per_step["replay_ns"].to_list()))
    for step, t in theirs["step_t_base"].items():
        assert _close(measured[int(step)], t * 1e9, 0.001), step


@pytest.fixture(scope="module")
def trainer_tables(tmp_path_factory) -> dict:
    import tracekit
    from tracekit.ingest import ingest

    out = {}
    for name in ("slow_rank_8", "cp_imbalance_8"):
        store = tmp_path_factory.mktemp("wi") / f"{name}.duckdb"
        ingest([SAMPLES / name], store, workers=1)
        s = tracekit.open(store)
        out[name] = s.run_tables(name)
        s.close()
    return out


def test_trainer_replay_reproduces_measured_steps_and_heals_the_slow_rank(trainer_tables):
    t = trainer_tables["slow_rank_8"]  # rank 5 computes 2x slower (stage 1 holds ranks 4-7)
    w = analyze(t, heal=("rank=5", "rank=4"), decompose=False)
    assert w.model == "program-order" and w.violations == 0
    err = (w.per_step["replay_ns"] / w.per_step["measured_ns"] - 1).abs().max()
    assert err < 0.03
    by = {s.name: s for s in w.scenarios}
    assert by["heal rank=5"].share > 0.10  # healing the culprit shortens every step
    assert abs(by["heal rank=4"].share) < 0.02  # healing a healthy peer changes nothing
    assert w.ideal_ns < by["heal rank=5"].step_ns < w.replay_ns
    ns, share = saving(t, [5])
    assert ns == pytest.approx(by["heal rank=5"].saving_ns) and share == pytest.approx(by["heal rank=5"].share)
    one = saving(t, [5], steps=[2])[0]
    per = w.per_step.filter(pl.col("step") == 2)
    assert one == pytest.approx(per["nodelay_ns"][0] - per["heal_rank=5_ns"][0])
    with pytest.raises(WhatIfError, match="none of steps"):
        saving(t, [5], steps=[99])


def test_balancing_cp_helps_the_cp_imbalanced_run_more_than_balancing_pp(trainer_tables):
    w = analyze(trainer_tables["cp_imbalance_8"], balance=("cp", "pp"), decompose=False)
    by = {s.name: s for s in w.scenarios}
    assert by["balance cp"].share > 0.05
    assert by["balance cp"].saving_ns > 2 * by["balance pp"].saving_ns


def _graph(start, end, preds, join, arrive=None) -> StepGraph:
    import polars as pl

    n = len(preds)
    nodes = pl.DataFrame({"node": range(n), "rank": [0] * n})
    s, e = np.array(start, float)[:, None], np.array(end, float)[:, None]
    return StepGraph([0], nodes, preds, np.array(join), s, e, np.array([e.max()]), arrive=arrive or [])


def test_a_collective_ends_a_transfer_after_its_last_member_arrives():
    # rank 0: compute 0-10, all-reduce 10-35; rank 1: compute 0-30, all-reduce 30-35; then compute 10 each
    g = _graph([0, 10, 35, 0, 30, 35], [10, 35, 45, 30, 35, 45], [[], [0], [1], [], [3], [4]], [-1, 0, -1, -1, 0, -1])
    p = recorded(g)
    assert p.violations == 0 and p.dur[1, 0] == p.dur[4, 0] == 5  # waiting is not transfer
    assert replay(g, p).step_ns[0] == 45
    p.dur[3, 0] = 10  # rank 1 computes as fast as rank 0
    assert replay(g, p).step_ns[0] == 25


def test_a_receive_waits_for_the_send_to_be_posted_but_the_sender_goes_on():
    # sender: post 2-3 then work 3-4; receiver: recv posted at 0, data at 2 + 3
    g = _graph([2, 3, 0], [3, 4, 5], [[], [0], []], [-1, -1, -1], arrive=[[], [], [0]])
    p = recorded(g)
    assert p.dur[2, 0] == 3 and replay(g, p).step_ns[0] == 5
    p.delay[0, 0] = 10  # posted at 10, not 2: the data arrives at 13, the sender works 11-12
    r = replay(g, p)
    assert r.end[2, 0] == 13 and r.end[1, 0] == 12


def test_a_dependency_cycle_is_an_error():
    with pytest.raises(WhatIfError, match="cycle"):
        topological_order([[1], [0]], np.array([-1, -1]))


@needs_wia
def test_cli_json_and_bad_input(tmp_path):
    trial = tmp_path / "ST"
    shutil.copytree(WIA / "ST", trial)
    store = tmp_path / "st.duckdb"
    r = CliRunner().invoke(cli, ["whatif", str(trial), "--store", str(store), "--json", "--heal", "rank=3",
                                 "--balance", "pp"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["slowdown"] == pytest.approx(data["measured_ns"] / data["ideal_ns"])
    assert data["decomposition"]["stage"]["3"] > 1.2
    assert [s["name"] for s in data["scenarios"]] == ["ideal", "heal rank=3", "balance pp"]
    r = CliRunner().invoke(cli, ["whatif", str(store), "--check", "--no-decompose"])
    assert r.exit_code == 1 and "slowdown 1.20" in r.output
    for args, msg in ((["--heal", "rank=x"], "ranks must be integers"), (["--heal", "node=1"], "expected rank="),
                      (["--balance", "cp"], "fold CP")):
        r = CliRunner().invoke(cli, ["whatif", str(store), *args])
        assert r.exit_code == 2 and msg in r.output, r.output
    r = CliRunner().invoke(cli, ["whatif", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such file" in r.output


def test_cli_refuses_gpu_kernel_traces(tmp_path):
    run = tmp_path / "sim"
    assert CliRunner().invoke(cli, ["simulate", "--tp", "2", "--dp", "2", "--steps", "2", "--out", str(run)]).exit_code == 0
    r = CliRunner().invoke(cli, ["whatif", str(run), "--store", str(tmp_path / "s.duckdb")])
    assert r.exit_code == 2 and "GPU kernels" in r.output, r.output


def test_wlb_data_whatifs_on_the_cp_imbalanced_run(trainer_tables):
    t = trainer_tables["cp_imbalance_8"]  # long documents on CP rank 1 under sequence sharding
    truth = t.manifest["faults"][0]["magnitude"]["pair_ratio_by_step"]  # the trainer's own pair counts
    w = analyze(t, balance=("cp",), wlb=True, decompose=False)
    deg = w.data.per_step
    for step, before in zip(deg["step"], deg["cp_attention_degree_before"]):
        assert before == pytest.approx(max(truth[str(step)]), rel=0.01)
    assert deg["cp_attention_degree_after"].max() < 1.05  # per-document sharding splits every document
    assert 0.5 < w.data.attention_weight < 1.5  # the loaded ranks compute about as much longer as they attend more
    by = {s.name: s for s in w.scenarios}
    assert by["per-document CP sharding"].share > by["balance cp"].share > 0.05


@needs_wia
def test_wlb_needs_a_trainer_run(wia):
    tables = RunTables.from_mapping(read_optable(WIA / "ST" / "trace-ST.parquet"))
    with pytest.raises(WhatIfError, match="trainer run"):
        analyze(tables, wlb=True, decompose=False)


def test_heals_that_name_nothing_are_errors(trainer_tables):
    t = trainer_tables["slow_rank_8"]
    with pytest.raises(WhatIfError, match="no communication between ranks 0 and 7"):
        analyze(t, heal=("link=0,7",), decompose=False)  # different TP, CP and PP groups
    with pytest.raises(WhatIfError, match=r"ranks \[9\] have no compute"):
        analyze(t, heal=("rank=9",), decompose=False)
    healthy = analyze(t, heal=("link=0,4",), decompose=False).scenarios[-1]
    assert abs(healthy.share) < 0.02  # the pipeline link is not slow


def test_cli_on_a_trainer_run_with_data_whatifs(tmp_path):
    r = CliRunner().invoke(cli, ["whatif", str(SAMPLES / "cp_imbalance_8"), "--store", str(tmp_path / "s.duckdb"),
                                 "--balance", "cp", "--wlb", "--heal", "rank=3"])
    assert r.exit_code == 0, r.output
    assert "program-order model" in r.output and "per-document CP sharding" in r.output
    assert "1.495 -> 1.022" in r.output  # CP attention imbalance degree, before -> after
    assert "slowdown by stage" in r.output


def test_a_rank_without_a_trace_is_named(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "slow_rank_8", run)
    (run / "traces" / "rank3.json.gz").unlink()
    r = CliRunner().invoke(cli, ["whatif", str(run), "--store", str(tmp_path / "s.duckdb"), "--json", "--heal", "rank=5"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["missing_ranks"] == [3] and data["scenarios"][1]["share"] > 0.10


# -- interleaved pipelines (vpp > 1) and GPU-kernel traces ------------------------------------------

@needs_wia
def test_op_tables_of_interleaved_pipelines_are_refused_in_one_line(tmp_path):
    trial = tmp_path / "ST"
    shutil.copytree(WIA / "ST", trial)
    meta = trial / "meta-ST.yaml"
    meta.write_text(meta.read_text().replace("vpp_size: 1", "vpp_size: 2"))
    r = CliRunner().invoke(cli, ["whatif", str(trial), "--store", str(tmp_path / "s.duckdb")])
    assert r.exit_code == 2, r.output
    assert "vpp_size 2 > 1" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_an_interleaved_trainer_run_replays_and_heals(tmp_path):
    """vstages=2 (interleaved 1F1B): the program-order model needs no schedule of its own; the last
    stage's forward sends feed the first stage's second chunk, and the replay must still fit."""
    import tracekit
    from tracekit.demo_run import DEVICE, FaultSpec, Scenario, run_scenarios
    from tracekit.ingest import ingest

    cfg = {"tp": 1, "cp": 1, "pp": 2, "dp": 2, "vstages": 2, "n_layers": 4, "dim": 32, "n_heads": 2, "n_kv_heads": 1,
           "ffn_dim": 64, "seq_len": 32, "micro_batches": 4, "steps": 2, "profile_memory": False, **DEVICE}
    run = tmp_path / "vpp"  # rank 3 (stage 1 of replica 1) computes 2x slower
    run_scenarios([Scenario(cfg, str(run), (FaultSpec("slow:rank=3,factor=2"),))])
    store = tmp_path / "vpp.duckdb"
    ingest([run], store, workers=1)
    s = tracekit.open(store)
    t = s.run_tables(None)
    s.close()
    assert t.manifest["config"]["vstages"] == 2
    w = analyze(t, heal=("rank=3", "rank=1"), decompose=False)
    assert w.model == "program-order" and w.violations == 0
    assert (w.per_step["replay_ns"] / w.per_step["measured_ns"] - 1).abs().max() < 0.03
    by = {s.name: s for s in w.scenarios}
    assert by["heal rank=3"].share > 0.15 and abs(by["heal rank=1"].share) < 0.05
    # per micro-batch, stage 1 sends stage 0 the forward of chunk 1 -> 2 and the gradients of chunks 3 -> 2
    # and 1 -> 0 (three sends; one without interleaving): each was replayed as a join
    coords = t.coords()
    first, last = (int(coords.filter((pl.col("dp") == 0) & (pl.col("pp") == p))["rank"][0]) for p in (0, 1))
    sends = t.p2p.filter((pl.col("rank") == last) & (pl.col("peer") == first) & (pl.col("direction") == "send"))
    assert sends.group_by("step").len()["len"].to_list() == [3 * cfg["micro_batches"]] * 2


def _gpu_run(tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    shutil.copytree(ROOT / "tests" / "gpu_fixtures" / name, run)
    return run


@pytest.mark.parametrize("name,missing", [
    ("native_fsdp2_h100", "its 6 communication records (6 from the flight recorder) have no step (1 rank, 320 GPU kernels)"),
    ("trainer_nccl_h100", "it recorded no communication (1 rank, 6232 GPU kernels)"),
])
def test_real_h100_traces_are_refused_naming_what_is_missing(tmp_path, name, missing):
    r = CliRunner().invoke(cli, ["whatif", str(_gpu_run(tmp_path, name)), "--store", str(tmp_path / "s.duckdb")])
    assert r.exit_code == 2, r.output
    assert missing in r.output and "program order" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_real_nccl_kernel_traces_are_refused_in_one_line(tmp_path):
    run = tmp_path / "hta"
    shutil.copytree(ROOT / "tests" / "fixtures" / "real" / "hta" / "two_rank_train", run)
    r = CliRunner().invoke(cli, ["whatif", str(run), "--store", str(tmp_path / "s.duckdb")])
    assert r.exit_code == 2 and "GPU kernels" in r.output and len(r.output.strip().splitlines()) == 1, r.output


# -- the steady step and the healed rank's peers (hand-built graphs, hand-computed times) -------------

def _two_rank_allreduce(w1: list[float], transfer: list[float]) -> StepGraph:
    """Per step: rank 0 works 0-10, rank 1 works 0-w1, then both all-reduce for ``transfer``."""
    S = len(w1)
    start = np.array([[0.0] * S, [max(10.0, w) for w in w1], [0.0] * S, [max(10.0, w) for w in w1]])
    end = np.array([[10.0] * S, [max(10.0, w) + t for w, t in zip(w1, transfer)], list(w1),
                    [max(10.0, w) + t for w, t in zip(w1, transfer)]])
    nodes = pl.DataFrame({"node": range(4), "rank": [0, 0, 1, 1]})
    return StepGraph([1, 2, 3], nodes, [[], [0], [], [2]], np.array([-1, 0, -1, 0]), start, end, end.max(axis=0))


def test_the_steady_step_drops_a_disturbance_that_hits_one_step():
    from tracekit.analysis.whatif import counterfactual as cf

    g = _two_rank_allreduce([10, 30, 10], [2, 2, 4])  # step 2: rank 1 descheduled for 20
    rec = [recorded(g)]
    assert list(replay(g, rec[0]).step_ns) == [12, 32, 14]
    steady = cf.steady([g], rec, {1, 2, 3})
    assert list(replay(g, steady[0]).step_ns) == [12, 12, 12]  # medians: work 10 and 10, transfer 2
    steady = cf.steady([g], rec, {2, 3})  # the first step left out as warm-up
    assert list(replay(g, steady[0]).step_ns) == [23, 23, 23]  # work 10 and (30 + 10) / 2, transfer (2 + 4) / 2


def _tp2dp2_compute(fwd: list[float]) -> StepGraph:
    """Four ranks (tp 2 x dp 2, rank = 2 * dp + tp), one forward compute node each, one step."""
    nodes = pl.DataFrame({"node": range(4), "rank": [0, 1, 2, 3], "kind": ["work"] * 4, "label": ["fwd"] * 4,
                          "pp": [0] * 4, "tp": [0, 1, 0, 1], "cp": [0] * 4, "dp": [0, 0, 1, 1],
                          "peer_key": ["0|0"] * 4, "is_comm": [False] * 4})
    end = np.array(fwd, float)[:, None]
    return StepGraph([1], nodes, [[], [], [], []], np.full(4, -1), np.zeros((4, 1)), end, np.array([end.max()]))


def test_a_healed_rank_takes_its_dp_replicas_compute_else_its_stages():
    from tracekit.analysis.whatif import counterfactual as cf

    g = _tp2dp2_compute([10, 14, 10, 30])  # TP rank 1 does more work; rank 3 (its DP replica: rank 1) is slow
    rec = [recorded(g)]
    assert cf.heal_rank([g], rec, {3})[0].dur[:, 0].tolist() == [10, 14, 10, 14]  # not the stage's median, 10
    assert cf.heal_rank([g], rec, {1, 3})[0].dur[:, 0].tolist() == [10, 10, 10, 10]  # no healthy replica: the stage


def test_a_warmup_that_leaves_no_step_is_refused(trainer_tables, tmp_path):
    t = trainer_tables["slow_rank_8"]  # 4 replayed steps
    with pytest.raises(WhatIfError, match="--warmup 4: the run has 4 replayed steps"):
        analyze(t, warmup=4, decompose=False)
    w = analyze(t, heal=("rank=5",), warmup=3, decompose=False)  # the steady step is the last step, as recorded
    last = w.per_step.sort("step").tail(1)
    assert w.steady_ns == pytest.approx(last["nodelay_ns"][0]) and w.scenarios[1].steady_ns == pytest.approx(
        last["heal_rank=5_ns"][0])
