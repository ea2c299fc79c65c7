"""Straggler analysis on real reference-trainer runs, one per fault kind (4 gloo ranks, tiny model,
an emulated device per rank as in the demo): one spawned world trains every run, profiled by the trainer
(``--profile-steps``); each is ingested from the trainer's run-directory layout, then analysed, and
one is reported through the CLI. Each run's culprit and cause are checked against the fault the
manifest records; the run without a fault must blame nothing."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

import tracekit
from tracekit.cli import main
from tracekit.demo_run import DEMO_CONFIG, FaultSpec, Scenario, SlowFault, run_scenarios
from tracekit.ingest import ingest

CFG = {**DEMO_CONFIG, "tp": 2, "pp": 1, "dp": 2, "steps": 6, "micro_batches": 2}
PP = {**CFG, "tp": 1, "pp": 2}
CP = {**CFG, "tp": 1, "cp": 2}
SLOW = SlowFault(rank=3, factor=1.5)
RUNS = {
    "slow": (CFG, SLOW),
    "clean": (CFG, None),
    "link": (CFG, FaultSpec("link:a=1,b=3,delay_ms=20")),  # the dp group of tp rank 1
    "cp_imbalance": (CP, FaultSpec("cp_imbalance:ranks=1")),  # CP rank 1 = ranks 1 and 3
    # one slow device cycling 0 -> 3 -> 1: replica 0 is late in two steps of three, so no level
    # alternates cleanly and the moving straggler is seen rank by rank
    "moving": (CFG, FaultSpec("moving:ranks=0+3+1,factor=2")),
    "pp_slow": (PP, SlowFault(rank=2, factor=2.0)),  # stage 0 of replica 1
    "transient": (CFG, SlowFault(rank=1, factor=2.0, steps=(3, 4))),  # two of the six profiled steps
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trainer_runs")
    run_scenarios([Scenario(cfg, str(root / name), (f,) if f else ()) for name, (cfg, f) in RUNS.items()])
    stores = {}
    for name in RUNS:
        db = root / f"{name}.duckdb"
        assert not ingest([root / name], db).failed
        stores[name] = db
    return {"slow_run": root / "slow", "clean_run": root / "clean", "cp_run": root / "cp_imbalance", **stores}


def diagnose(runs, name: str):
    with tracekit.open(runs[name]) as s:
        return s.diagnose()


def test_manifest_records_the_injected_fault(runs) -> None:
    truth = json.loads((runs["slow_run"] / "manifest.json").read_text())["faults"]
    assert len(truth) == 1 and truth[0]["kind"] == "slow" and truth[0]["ranks"] == [3]
    assert truth[0]["magnitude"] == {"compute_factor": 1.5}
    assert json.loads((runs["clean_run"] / "manifest.json").read_text())["faults"] == []


def test_slow_rank_computes_far_longer_than_its_peer(runs) -> None:
    with tracekit.open(runs["slow"]) as s:
        per = s.steps().per_rank.group_by("rank").agg(pl.col("compute_ns").median()).sort("rank")
    c = dict(per.iter_rows())
    assert c[3] > 1.35 * c[1]  # same position (tp 1) in the other replica


def test_slow_replica_has_the_top_dp_score(runs) -> None:
    with tracekit.open(runs["slow"]) as s:
        d = s.diagnose()
    dp = next(lv for lv in d.localization.levels if lv.level == "dp")
    assert max(dp.scores_ns, key=dp.scores_ns.get) == 1  # rank 3 lives in replica 1


def test_slow_rank_is_the_culprit_with_slow_compute(runs) -> None:
    with tracekit.open(runs["slow"]) as s:
        d = s.diagnose()
    assert d.localization.verdict == "straggler", d.headline
    assert d.localization.culprit_rank == 3 and d.localization.coords == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
    assert d.cause.kind == "slow_compute", d.headline


def test_clean_run_blames_no_rank(runs) -> None:
    d = diagnose(runs, "clean")
    loc = d.localization
    assert loc.culprit_rank is None and not any(f.kind in ("straggler", "transient", "moving") for f in d.findings)
    if loc.verdict == "no_straggler":
        assert loc.culprit_ranks == () and d.cause.kind == "none", d.headline
        # the rank nearest a finding (on 2 cores, rank 0 is about 1% slower in every step: above the
        # bar in noise units, half the effect floor away) does not make "no straggler" unsure (a
        # link measurably slower below the cost floor may, at 0.5: that caps the answer, not this)
        assert d.compute.none_confidence() > 0.5, d.headline
    else:
        # four processes share two cores: a CI run had replica 1's TP group 1.22x slower than replica
        # 0's, 2% of a step. A "link" between two processes of one host is that host's cores, said
        # in doubt, never a confident answer
        assert loc.verdict == "group" and loc.confidence <= 0.5, d.headline
        assert all(f.kind == "slow_link" and f.evidence["cpu_host"] and f.confidence <= 0.5 for f in d.findings)


def test_slow_link_names_the_pair(runs) -> None:
    d = diagnose(runs, "link")
    # both ends arrive on time and the transfer is slow: no compute is blamed, the link is
    assert d.cause.kind == "slow_link" and set(d.cause.ranks) == {1, 3}, d.headline
    assert d.localization.culprit_rank is None or d.localization.culprit_rank in (1, 3)


def test_cp_imbalance_is_data_imbalance_on_the_loaded_cp_rank(runs) -> None:
    truth = json.loads((runs["cp_run"] / "manifest.json").read_text())
    assert set(truth["faults"][0]["ranks"]) == {1, 3}
    work = truth["attention_work"]["1"]  # the trainer records each rank's attention work
    assert work["1"] > 3 * work["0"] and work["1"] == work["3"]
    d = diagnose(runs, "cp_imbalance")
    loc = d.localization
    # CP rank 1 of either replica, or the loaded CP rank of every replica as one group
    assert loc.culprit_rank in (1, 3) or (loc.verdict == "group" and set(loc.culprit_ranks) == {1, 3}), d.headline
    assert d.cause.kind == "data_imbalance" and d.cause.category == "data", d.headline
    assert set(d.cause.ranks) <= {1, 3}


def test_moving_straggler_has_no_single_culprit_and_is_a_slow_device(runs) -> None:
    d = diagnose(runs, "moving")
    assert d.localization.verdict == "moving" and d.localization.culprit_rank is None, d.headline
    # the documents give no replica more work than its compute shows: a slow device that moves
    assert d.cause.kind == "slow_compute" and d.cause.category == "worker", d.headline


def test_slow_pipeline_rank_is_named_not_its_stage(runs) -> None:
    d = diagnose(runs, "pp_slow")
    loc = d.localization
    assert loc.verdict == "straggler" and loc.culprit_rank == 2, d.headline
    assert loc.coords == {"dp": 1, "pp": 0, "cp": 0, "tp": 0}
    assert d.cause.kind == "slow_compute", d.headline


def test_transient_straggler_is_named_with_its_steps(runs) -> None:
    d = diagnose(runs, "transient")
    loc = d.localization
    assert loc.verdict in ("transient", "straggler") and loc.culprit_rank == 1, d.headline
    named = loc.per_step.filter(pl.col("culprit_rank") == 1)["step"].to_list()
    assert {3, 4} <= set(named), loc.per_step
    # the episode is the slow steps, not the steps that jitter happened to give rank 1
    assert {3, 4} <= set(loc.episode_steps) and len(loc.episode_steps) <= 3, loc.per_step
    assert d.cause.kind == "slow_compute", d.headline


def test_cli_report_on_the_run_directory(runs) -> None:
    res = CliRunner().invoke(main, ["report", str(runs["slow_run"]), "--json"])
    assert res.exit_code == 0, res.output
    blob = json.loads(res.output)
    assert blob["run_id"] == "slow" and blob["layout_source"] == "manifest"
    assert len(blob["steps"]["per_step"]) == CFG["steps"]
    assert blob["hangs"]["hung"] is False and blob["cp_wait"]["cause"] == "no_cp"
