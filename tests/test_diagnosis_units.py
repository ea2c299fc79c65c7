"""The diagnosis's small decisions against hand-computed values: confidence, the link test's bar and
its tie correction, a stage's persistence, a one-step standout. Each expected value is computed here
from the formula the docs state (docs/analysis.md), not by calling the code under test twice."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import polars as pl
import pytest
from synthetic_job import Faults, make_job

from tracekit.analysis.culprits import margin_confidence
from tracekit.analysis.stage_findings import stage_findings
from tracekit.analysis.link_findings import link_findings
from tracekit.analysis.links import _transfer_instances, link_transfers
from tracekit.analysis.standout import standout
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables
from tracekit.topology import Layout

TUN = Tunables()


@pytest.fixture(scope="module")
def tables() -> RunTables:
    return RunTables.from_mapping(make_job(Layout(tp=2, cp=1, pp=2, dp=2), faults=Faults(), seed=0))


def test_confidence_is_a_coin_flip_at_the_bar_and_firm_only_well_past_it():
    # share / (1 + exp(-4 (margin - bar) / bar)), capped at 0.99
    assert margin_confidence(5.0, 5.0, 1.0) == pytest.approx(0.5)
    assert margin_confidence(6.25, 5.0, 1.0) == pytest.approx(1 / (1 + math.exp(-1.0)))  # 0.731
    assert margin_confidence(6.25, 5.0, 0.5) == pytest.approx(0.5 / (1 + math.exp(-1.0)))
    assert margin_confidence(50.0, 5.0, 1.0) == 0.99


def test_a_link_just_over_its_bar_is_not_a_confident_finding(tables):
    row = {"link": "group", "name": "7", "ranks": [4, 5], "kind": "tp:all_reduce", "instances": 40,
           "transfer_ns": 2e6, "ratio": 1.3, "z": 4.5, "z_bar": 4.0, "excess_per_step_ns": 3e6, "slow": True}
    links = pl.DataFrame([row])
    metrics = pl.DataFrame({"rank": [4, 5], "step": [0, 0], "compute_ns": [1e8, 1e8]},
                           schema={"rank": pl.Int32, "step": pl.Int64, "compute_ns": pl.Float64})
    (f,) = link_findings(tables, links, 100e6, metrics)
    assert f.confidence == pytest.approx(1 - 2 ** -1.5)  # 0.646: 1 - 2^-(z - bar + 1)
    assert f.where == "TP group [4, 5]" and f.cost_share == pytest.approx(0.03)



def test_a_slow_link_within_one_host_over_gloo_is_put_in_doubt(tables):
    # gloo moves data through the CPUs: between two processes of one host there is no link to
    # test, and a slower one is their share of the cores (4 of 14 clean torch-native runs on a
    # loaded machine). Hosts of 4 ranks here: [4, 5] share host1, [3, 4] do not
    from dataclasses import replace

    row = {"link": "group", "name": "7", "ranks": [4, 5], "kind": "tp:all_reduce", "instances": 40,
           "transfer_ns": 2e6, "ratio": 1.6, "z": 9.0, "z_bar": 4.0, "excess_per_step_ns": 3e6, "slow": True}
    metrics = pl.DataFrame({"rank": [3, 4, 5], "step": [0, 0, 0], "compute_ns": [1e8, 1e8, 1e8]},
                           schema={"rank": pl.Int32, "step": pl.Int64, "compute_ns": pl.Float64})
    gloo = replace(tables, runs=tables.runs.with_columns(pl.lit("gloo").alias("backend")))
    (nccl_like,) = link_findings(tables, pl.DataFrame([row]), 100e6, metrics)
    (same_host,) = link_findings(gloo, pl.DataFrame([row]), 100e6, metrics)
    (two_hosts,) = link_findings(gloo, pl.DataFrame([{**row, "ranks": [3, 4]}]), 100e6, metrics)
    assert nccl_like.confidence == pytest.approx(1 - 2 ** -6) and two_hosts.confidence == nccl_like.confidence
    assert same_host.confidence == 0.5 and same_host.evidence["cpu_host"] == "host1"
    assert "host host1" in same_host.next_step and "nccl-tests" in nccl_like.next_step
    assert same_host.kind == "slow_link" and same_host.cost_share == pytest.approx(0.03)

def test_the_link_bar_is_bonferroni_over_the_links_compared(tables):
    links = link_transfers(tables, 100e6, TUN)
    n = links.height
    expected = max(TUN.link_z_min, NormalDist().inv_cdf(1 - TUN.link_alpha / n))
    assert n > 1 and links["z_bar"].to_list() == pytest.approx([expected] * n)


def _mann_whitney_by_hand(x: list[float], y: list[float]) -> float:
    """Textbook U with mid-ranks and the tie-corrected variance n1 n2 / 12 ((n + 1) - sum(t^3 - t) / (n (n - 1)))."""
    both = sorted(x + y)
    rank = {v: (both.index(v) + 1 + len(both) - both[::-1].index(v)) / 2 for v in both}
    n1, n2, n = len(x), len(y), len(x) + len(y)
    u = sum(rank[v] for v in x) - n1 * (n1 + 1) / 2
    ties = sum(both.count(v) ** 3 - both.count(v) for v in set(both))
    return (u - n1 * n2 / 2) / math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))


def test_each_links_rank_test_is_the_textbook_test_against_all_other_links(tables):
    """link_transfers ranks every instance once for all links; each link's z must equal the textbook
    one-sided test of its normalised instances against every other link's (ties mid-ranked)."""
    inst = _transfer_instances(tables).with_columns(pl.format("{}|{}", "link", "name").alias("key"))
    refs = {}  # (key, kind) -> median transfer of the kind on the other links, recomputed here
    for key, kind in inst.select("key", "kind").unique().iter_rows():
        rest = inst.filter((pl.col("kind") == kind) & (pl.col("key") != key))["t"]
        if rest.len():
            refs[(key, kind)] = float(rest.median())
    rows = [(k, math.log(max(t, 1.0) / max(refs[(k, c)], 1.0))) for k, c, t in inst.select("key", "kind", "t").iter_rows()
            if (k, c) in refs]
    links = link_transfers(tables, 100e6, TUN)
    assert links.height > 1
    for row in links.iter_rows(named=True):
        key = f"{row['link']}|{row['name']}"
        x, y = [v for k, v in rows if k == key], [v for k, v in rows if k != key]
        assert row["z"] == pytest.approx(_mann_whitney_by_hand(x, y), rel=1e-9, abs=1e-9), key


def test_a_stage_heavy_in_barely_half_the_steps_is_not_stage_imbalance(tables):
    # stage 1's least loaded rank computes 1.4e8 against stage 0's 1e8 in 6 of 11 steps: 1.167x the
    # median of the two stages (1.2e8), so its median ratio clears a 1.1 bar; its share of steps
    # (6/11 = 0.545) stays below persist_min (0.6)
    lay = tables.layout
    late = [r for r in range(lay.world_size) if lay.coords(r).pp == 1]

    def metrics(heavy_steps: set[int]) -> pl.DataFrame:
        rows = [(r, t, 1.4e8 if r in late and t in heavy_steps else 1e8) for t in range(11) for r in range(lay.world_size)]
        return pl.DataFrame(rows, schema={"rank": pl.Int32, "step": pl.Int64, "compute_ns": pl.Float64}, orient="row")

    tun = Tunables(stage_compute_ratio=1.1)
    assert stage_findings(tables, metrics(set(range(6))), tun, 1e9) == []
    (f,) = stage_findings(tables, metrics(set(range(11))), tun, 1e9)  # heavy in every step
    assert f.kind == "stage_imbalance" and "stage 1" in f.where and f.cost_ns == pytest.approx(0.2e8)
    # a whole stage of slow devices reads the same in step times (grid draw 23): the next step says so
    assert f.next_step.startswith("rebalance the pipeline") and "test its nodes" in f.next_step
    assert f.evidence["stage_compute_ratio"] == pytest.approx(1.4 / 1.2)


def test_a_step_stands_out_only_beyond_noise_and_a_share_of_the_step():
    # peers without spread: the noise unit is its floor, 0.1% of the step (1 ms of 1 s), and the bar
    # margin_min (4) of those, 4 ms; 4.5 ms clears it but stays below effect_min_frac (0.5%, 5 ms)
    row = np.array([0.0, 0.0, 0.0, 4.5e6])
    step_ns = 1e9
    assert standout(row, step_ns, TUN, TUN.effect_min_frac) == (3, 4.5e6, False)
    assert standout(row * 10, step_ns, TUN, TUN.effect_min_frac) == (3, 4.5e7, True)


def test_a_moving_finding_from_waits_alone_names_no_rank_and_leads_a_moving_verdict(tables):
    # a torch-native dp 1 x pp 2 job without compute spans: the waits saw the slowest stage move,
    # beside a heavier stage; this crashed with an IndexError (nothing to lead with)
    from tracekit.analysis.diagnosis import Finding, _primary
    from tracekit.analysis.localize import localize

    loc = localize(tables)
    moving = Finding("moving", (), "the job", (), 5e6, 0.02, 0.6, "slow_compute", "the slowest stage changes", "")
    stage = Finding("stage_imbalance", (1,), "pipeline stage 1", (), 9e6, 0.04, 0.8, "stage_imbalance", "stage", "")
    out = _primary(loc, [stage, moving], tables)
    assert (out.verdict, out.culprit_rank, out.culprit_ranks) == ("moving", None, ())




def test_a_lateness_from_waits_alone_is_a_finding_only_when_a_level_measured_its_cost(monkeypatch):
    # one rank per stage (dp 1 x pp 2): no compute peers, so the waits alone speak. A moving top
    # stage within its noise (0.48 noise units) cost "0.0 ms per step (0.0%)" and was reported as a
    # finding on a clean torch-native job; one whose lateness clears its noise is one, with that cost
    from dataclasses import replace

    import tracekit.analysis.diagnosis as diagnosis
    from tracekit.analysis.localize import LevelFinding, localize

    one_per_stage = RunTables.from_mapping(make_job(Layout(tp=1, cp=1, pp=2, dp=1), faults=Faults(), seed=3))
    real = localize(one_per_stage)
    step = real.step_time_ns

    def moving_pp(margin: float) -> LevelFinding:
        return LevelFinding("pp", (0, 1), {0: 0.0, 1: 0.04 * step}, None, 0.04 * step, 0.04 * step / margin, margin,
                            4, 2, 3, "moving")

    for margin, expected in ((0.48, []), (3.0, [0.04])):
        loc = replace(real, verdict="moving", confidence=0.5, levels=[moving_pp(margin)], culprit_rank=None,
                      culprit_ranks=())
        monkeypatch.setattr(diagnosis, "localize", lambda tables, tun=None, loc=loc: loc)
        d = diagnosis.diagnose(one_per_stage)
        assert not d.compute.has_data
        assert [round(f.cost_share, 3) for f in d.findings] == expected, d.headline


def test_a_rank_alone_at_its_position_is_never_called_slow_or_cpu_bound(monkeypatch):
    # dp 1 x pp 2, one rank per stage: the last stage idles between ops more than the first by the
    # schedule's design; with no peer to compare with, a clean torch-native job's rank 1 was called
    # "CPU-bound: idles 44.4% of the step more than its same" at confidence 0.90. Its lateness is a
    # finding only in doubt, and "no straggler" there says what it could not see
    from dataclasses import replace

    import tracekit.analysis.diagnosis as diagnosis
    from tracekit.analysis.localize import localize
    from tracekit.analysis.rootcause import explain

    job = RunTables.from_mapping(make_job(Layout(tp=1, cp=1, pp=2, dp=1), faults=Faults(cpu_bound_rank=1), seed=3))
    real = localize(job)
    step = real.step_time_ns
    per_step = pl.DataFrame({"step": [1, 2], "culprit_rank": [1, 1], "effect_ns": [0.1 * step, 0.2 * step]})
    late = replace(real, verdict="transient", culprit_rank=1, culprit_ranks=(1,), confidence=1.0,
                   episode_steps=(1, 2), per_step=per_step, levels=[])  # its cost: the steps it stood out in
    cause = explain(job, late)
    assert (cause.kind, cause.evidence["peers"]) == ("unexplained", 0), cause.summary
    monkeypatch.setattr(diagnosis, "localize", lambda tables, tun=None: late)
    d = diagnosis.diagnose(job)
    assert [(f.kind, f.ranks, f.steps, f.confidence) for f in d.findings] == [("transient", (1,), (1, 2), 0.5)]
    assert d.findings[0].cost_ns == pytest.approx(0.15 * step)
    quiet = replace(real, verdict="no_straggler", culprit_rank=None, culprit_ranks=(), confidence=1.0)
    monkeypatch.setattr(diagnosis, "localize", lambda tables, tun=None: quiet)
    d = diagnosis.diagnose(job)
    assert not d.findings and d.localization.confidence == 0.5
    assert "no two ranks' compute could be compared" in d.headline

def test_a_slow_rank_does_not_make_its_stage_peers_look_fast():
    # rank 5 (stage 0, with ranks 0, 1, 4) computes 1.5x: its peers' reference leaves the largest of
    # their others out, so they stay level with stage 1's ranks (a plain mean moved them 4-7%)
    from tracekit.analysis.compute_speed import compute_speed

    job = make_job(Layout(tp=2, cp=1, pp=2, dp=2), faults=Faults(slow_rank=5, slow_factor=1.5), seed=2, noise=0.02)
    speed = compute_speed(RunTables.from_mapping(job))
    med = speed.group_by("rank", "pp").agg(pl.col("log_ratio").median())
    assert sorted(med.filter(pl.col("pp") == 0)["rank"].to_list()) == [0, 1, 4, 5]
    level = {st: float(med.filter((pl.col("pp") == st) & (pl.col("rank") != 5))["log_ratio"].median())
             for st in (0, 1)}
    assert abs(level[0] - level[1]) < 0.01, level
    culprit = float(med.filter(pl.col("rank") == 5)["log_ratio"][0])
    assert culprit - level[1] == pytest.approx(math.log(1.5), abs=0.05)


@pytest.mark.parametrize("steps, ranks", [(8, 4), (8, 8), (8, 16), (20, 16)])
def test_the_cell_bars_scatter_reads_the_noise_it_was_given(steps, ranks):
    """step_scatter (a MAD of median-polish residuals) reads 0.63-0.87 of the noise on such small
    tables; divided by scatter_bias it reads the noise itself (here 3%, on tables of another seed)."""
    from tracekit.analysis.compute_speed import scatter_bias, step_scatter

    rng = np.random.default_rng(12345)
    read = np.mean([step_scatter(rng.normal(0.0, 0.03, (steps, ranks))) for _ in range(300)])
    assert read / scatter_bias(steps, ranks) == pytest.approx(0.03, rel=0.03)
@pytest.mark.parametrize("held", [40, 24])  # the recorder's ring kept the last `held` of 48 ops, or all
def test_profiled_p2p_ops_take_their_peers_from_the_recorder_entries_they_lie_along(held):
    """A middle stage alternates its peers; the recorder stamps each op 0.2-0.4 ms before the
    profiler's kernel. Ops the ring no longer holds keep no peer rather than a wrong one."""
    from tracekit.analysis.tables import _align

    rng = np.random.default_rng(7)
    prof = np.cumsum(rng.uniform(5e6, 9e6, 48)).astype(np.int64)
    peers = np.array([3, 5] * 24)
    fr_t = prof - rng.uniform(2e5, 4e5, 48).astype(np.int64)
    got = _align(prof, fr_t[-held:], peers[-held:])
    assert got == [None] * (48 - held) + peers[-held:].tolist()
    # and a recorder that holds more than was profiled (it ran on after the profiler stopped)
    more = np.concatenate([fr_t, fr_t[-1] + np.cumsum(rng.uniform(5e6, 9e6, 10)).astype(np.int64)])
    assert _align(prof, more, np.concatenate([peers, [3] * 10])) == peers.tolist()


def test_with_two_groups_of_a_kind_a_slow_ones_ratio_is_its_transfer_over_the_others():
    """Two TP groups (and two DP groups): each is measured against the other, so the slow one's
    mirror image must not count against it a second time (its ratio read 100x for 10x, and
    45,188x on a fault-grid TP link). Oracle: per group, the median over instances of the fastest
    member's duration, from the collectives table itself."""
    tables = RunTables.from_mapping(make_job(Layout(tp=2, cp=1, pp=1, dp=2), faults=Faults(slow_group="tp:2"), seed=0))
    inst = tables.collectives.group_by("pg_name", "seq").agg((pl.col("end_ns") - pl.col("start_ns")).min().alias("t"))
    med = dict(inst.group_by("pg_name").agg(pl.col("t").median()).iter_rows())
    links = link_transfers(tables, 100e6, TUN)
    slow = links.filter(pl.col("name") == "tp:2").row(0, named=True)
    assert slow["ratio"] == pytest.approx(med["tp:2"] / med["tp:0"], rel=0.1)
    assert slow["ratio"] == pytest.approx(10.0, rel=0.25)  # the fault's factor


def test_a_group_search_over_no_split_coordinates_searches_the_whole_range():
    """The localizer's group search skips the combinations of split coordinates that hold no scored
    rank; with no split coordinates there is one combination, the range itself, which holds them
    all (a first version skipped it and lost a culprit on the fault grid)."""
    from tracekit.analysis.collectives import match_collectives
    from tracekit.analysis.localize import _search_groups, step_time_ns
    from tracekit.analysis.scores import collective_scores

    lay = Layout(tp=2, cp=1, pp=1, dp=2)
    tables = RunTables.from_mapping(make_job(lay, faults=Faults(slow_rank=3, slow_factor=1.5), seed=1))
    scores = collective_scores(tables, "dp", match_collectives(tables))
    found = _search_groups("dp", scores, tables.coords(), {}, [], lay, step_time_ns(tables), TUN)
    assert found is not None and found.verdict == "culprit" and found.chosen == lay.coords(3).dp
