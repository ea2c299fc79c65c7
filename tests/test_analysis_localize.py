"""Top-down localization and root cause on a modelled 16-rank (dp2 x pp2 x cp2 x tp2) job with a
fault placed at a chosen position."""

from __future__ import annotations

import json
from dataclasses import replace

import polars as pl
import pytest
from synthetic_job import Faults, make_job

from tracekit.analysis.localize import localize
from tracekit.analysis.diagnosis import diagnose
from tracekit.analysis.rootcause import explain
from tracekit.analysis.work import attention_work
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables
from tracekit.topology import Layout

LAYOUT = Layout(tp=2, cp=2, pp=2, dp=2)


def run(faults: Faults = Faults(), seed: int = 0, **kw):
    tables = RunTables.from_mapping(make_job(LAYOUT, faults=faults, seed=seed, **kw))
    return tables, diagnose(tables)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_fault_is_no_straggler(seed):
    _, d = run(seed=seed)
    assert d.localization.verdict == "no_straggler"
    assert d.localization.culprit_rank is None
    assert d.localization.per_step["culprit_rank"].null_count() == d.localization.per_step.height
    assert d.cause.kind == "none" and d.cause.category == "none"
    assert all(lv.verdict in ("none", "skipped") for lv in d.localization.levels)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_timing_noise_alone_is_not_a_straggler_or_imbalance(seed):
    # 10% jitter on every compute op: per-step "slowest" members come and go, but by little
    _, d = run(seed=seed, noise=0.10)
    assert d.localization.verdict == "no_straggler"
    assert d.cause.kind == "none"


def test_a_10pct_straggler_stands_out_of_5pct_noise():
    _, d = run(Faults(slow_rank=5, slow_factor=1.1), seed=42, noise=0.05)
    assert d.localization.verdict == "straggler" and d.localization.culprit_rank == 5


@pytest.mark.parametrize("rank,factor", [(0, 1.1), (6, 1.1), (9, 1.05), (15, 1.05), (13, 1.3)])
def test_slow_rank_is_found_with_cause(rank, factor):
    tables, d = run(Faults(slow_rank=rank, slow_factor=factor), seed=rank)
    loc = d.localization
    assert loc.verdict == "straggler"
    assert loc.culprit_rank == rank
    assert loc.coords == LAYOUT.coords(rank).as_dict()
    assert loc.confidence > 0.5
    dp = next(lv for lv in loc.levels if lv.level == "dp")
    assert dp.chosen == LAYOUT.coords(rank).dp and dp.margin >= 4 and dp.steps_agree >= 6
    assert dp.scores_ns[dp.chosen] == max(dp.scores_ns.values())
    # most steps name the same rank on their own
    assert loc.per_step["culprit_rank"].to_list().count(rank) >= 6
    assert d.cause.kind == "slow_compute" and d.cause.category == "worker"
    assert d.cause.ranks == (rank,)
    assert d.cause.evidence["compute_ratio"] == pytest.approx(factor, abs=0.02)


def test_slow_p2p_link_names_the_pair():
    _, d = run(Faults(slow_link=(9, 13)))
    assert d.localization.verdict in ("straggler", "group")
    assert set(d.localization.culprit_ranks) <= {9, 13}
    assert d.cause.kind == "slow_link" and d.cause.category == "link"
    assert set(d.cause.ranks) == {9, 13}
    assert d.cause.evidence["compute_ratio"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("group,members", [("tp:4", {4, 5}), ("cp:8", {8, 10}), ("dp:3", {3, 11})])
def test_slow_collective_link_names_the_group(group, members):
    _, d = run(Faults(slow_group=group))
    loc = d.localization
    assert loc.verdict == "group" and set(loc.culprit_ranks) == members  # its members are late together
    assert d.cause.kind == "slow_link" and set(d.cause.ranks) == members
    assert d.cause.evidence["link"] == group and d.cause.evidence["ratio"] > 5


def test_cpu_launch_gaps_are_cpu_bound():
    _, d = run(Faults(cpu_bound_rank=3))
    assert d.localization.culprit_rank == 3
    assert d.cause.kind == "cpu_bound"
    assert d.cause.evidence["gap_excess_frac"] > 0.1
    assert d.cause.evidence["compute_ratio"] == pytest.approx(1.0, abs=0.02)


def test_heavy_stage_is_stage_imbalance_not_a_rank():
    _, d = run(Faults(heavy_stage=1, heavy_factor=1.6))
    loc = d.localization
    assert loc.verdict == "stage" and loc.culprit_rank is None
    assert loc.coords == {"pp": 1}
    assert set(loc.culprit_ranks) == {r for r in range(16) if LAYOUT.coords(r).pp == 1}
    assert d.cause.kind == "stage_imbalance" and d.cause.category == "pipeline"
    assert d.cause.evidence["stage_compute_ratio"] > 1.15


def test_data_imbalance_moves_and_has_no_single_culprit():
    tables, d = run(Faults(data_imbalance=0.3), steps=10)
    loc = d.localization
    # the waits see the slowest replica move ...
    picks = loc.per_step["dp"].drop_nulls()
    assert picks.n_unique() == 2 and picks.len() >= 5
    # ... but no rank's compute stands out (every replica's work varies alike, an imbalance degree of
    # about 1.05, which WLB-LLM calls balanced): no single culprit, and no finding on waits alone
    assert loc.culprit_rank is None and d.localization.verdict == "no_straggler" and not d.findings


def test_extra_work_on_some_microbatches_is_data_imbalance_not_a_slow_device():
    _, d = run(Faults(uneven_rank=10, uneven_factor=1.6))
    assert d.localization.verdict == "straggler" and d.localization.culprit_rank == 10
    assert d.cause.kind == "data_imbalance" and d.cause.ranks == (10,)
    assert d.cause.evidence["microbatch_cv"] > d.cause.evidence["peers_microbatch_cv"] + 0.1


def test_transient_straggler_is_visible_per_step():
    _, d = run(Faults(slow_rank=5, slow_steps=(2, 3, 4)))
    loc = d.localization
    assert loc.verdict == "transient" and loc.culprit_rank == 5
    assert loc.per_step.filter(pl.col("culprit_rank") == 5)["step"].to_list() == [2, 3, 4]
    assert loc.per_step.filter(pl.col("culprit_rank") != 5).height == 0
    assert d.cause.kind == "slow_compute"


def test_known_attention_work_turns_slow_compute_into_data_imbalance():
    tables, d = run(Faults(slow_rank=13, slow_factor=1.3), seed=13)
    assert attention_work([3, 4, 1]) == 26
    work = pl.DataFrame({"rank": list(range(16)) * 8, "step": [s for s in range(8) for _ in range(16)]})
    work = work.with_columns(pl.when(pl.col("rank") == 13).then(attention_work([120, 40]))
                             .otherwise(attention_work([100, 30, 20])).alias("work"))
    cause = explain(tables, d.localization, work=work)
    assert cause.kind == "data_imbalance"
    assert cause.evidence["work_ratio"] == pytest.approx(16000 / 11300)


def test_thresholds_live_in_tunables_and_results_serialize():
    tables, d = run(Faults(slow_rank=6, slow_factor=1.1), seed=6)
    blob = json.loads(json.dumps(d.to_dict()))
    assert blob["localization"]["culprit_rank"] == 6 and blob["cause"]["kind"] == "slow_compute"
    assert {lv["level"] for lv in blob["localization"]["levels"]} == {"dp", "pp", "cp", "tp"}
    strict = replace(Tunables(), margin_min=1e6, compute_margin_min=1e6)
    assert localize(tables, strict).verdict == "no_straggler"


def test_no_cross_rank_records_is_no_data():
    job = make_job(LAYOUT, steps=2, microbatches=1)
    job["collectives"] = job["collectives"].head(0)
    job["p2p"] = job["p2p"].head(0)
    d = diagnose(RunTables.from_mapping(job))
    assert d.localization.verdict == "no_data"
    assert d.cause.kind == "insufficient_data"


def test_group_dimension_named_from_members_when_not_recorded():
    job = make_job(LAYOUT, faults=Faults(slow_rank=11, slow_factor=1.2), seed=11)
    job["groups"] = job["groups"].with_columns(pl.lit(None, dtype=pl.Utf8).alias("dim"))
    d = diagnose(RunTables.from_mapping(job))
    assert d.localization.verdict == "straggler" and d.localization.culprit_rank == 11


def test_localizes_without_groups_table_steps_or_microbatches():
    # sparse ingest: no groups table, no step spans, no micro-batch on p2p records, steps unknown
    job = make_job(LAYOUT, faults=Faults(slow_rank=6, slow_factor=1.2), seed=6)
    job["groups"] = job["groups"].head(0)
    job["steps"] = job["steps"].head(0)
    job["p2p"] = job["p2p"].with_columns(pl.lit(None, dtype=pl.Int32).alias("microbatch"))
    d = diagnose(RunTables.from_mapping(job))
    assert d.localization.verdict == "straggler" and d.localization.culprit_rank == 6
    assert d.cause.kind == "slow_compute"


def test_host_clock_skew_does_not_move_the_culprit():
    skew = {0: 0, 1: 4_000_000, 2: -7_000_000, 3: 2_500_000}  # milliseconds between hosts
    _, d = run(Faults(slow_rank=10, slow_factor=1.1, host_skew_ns=skew), seed=10)
    assert d.localization.verdict == "straggler" and d.localization.culprit_rank == 10
    assert d.cause.kind == "slow_compute"


def test_weak_outer_signal_is_recovered_group_by_group():
    # 5% slower in 5% jitter: the replica and stage levels show nothing over the whole job, but
    # the suspect's own CP group does once the TP level has narrowed the range
    _, d = run(Faults(slow_rank=9, slow_factor=1.05), seed=105, noise=0.05)
    loc = d.localization
    assert loc.verdict == "straggler" and loc.culprit_rank == 9
    by_level = {lv.level: lv for lv in loc.levels}
    assert by_level["dp"].verdict == "none" and by_level["pp"].verdict == "none"
    assert by_level["cp"].verdict == "culprit" and by_level["cp"].within == {"dp": 1, "pp": 0, "tp": 1}


def test_last_open_coordinate_resolved_by_lateness_in_own_groups():
    # the pipeline level cannot tell the stage of a 5% straggler in 5% jitter; among the two
    # remaining ranks (one per stage) the one late in its own TP/CP groups is the culprit
    _, d = run(Faults(slow_rank=0, slow_factor=1.05), seed=300, noise=0.05, steps=16)
    loc = d.localization
    assert loc.verdict == "straggler" and loc.culprit_rank == 0
    pp = next(lv for lv in loc.levels if lv.level == "pp")
    assert pp.basis == "own-groups" and pp.chosen == 0 and pp.within == {"dp": 0, "cp": 0, "tp": 0}
