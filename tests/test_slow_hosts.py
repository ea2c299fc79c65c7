"""A slow machine is one finding of the host, with one cost, not one "drain the node of rank r" per
GPU each costing its own share of the step (tracekit/analysis/hosts.py). Simulated NCCL jobs
(`tracekit simulate`), ingested without their manifest."""

from __future__ import annotations

import json

import pytest

import tracekit
from tracekit.ingest import ingest
from tracekit.simulate.config import SimConfig
from tracekit.simulate.run import simulate


def _diagnose(tmp_path, slow: list[int], factor: float = 1.2, handler_names: bool = True, layers: int = 1,
              **layout):
    """Simulate, ingest and diagnose. ``handler_names``: the traces named as
    torch.profiler.tensorboard_trace_handler names them (host_pid.ns.pt.trace.json.gz), the
    manifest gone, so that the hosts come from the file names as in a real job's directory."""
    cfg = SimConfig(**layout, steps=8, seed=11, noise=0.05, skew_ms=500, layers=layers,
                    faults=tuple(f"slow:rank={r},factor={factor}" for r in slow))
    run = tmp_path / "run"
    simulate(cfg, run)
    man = json.loads((run / "manifest.json").read_text())
    if handler_names:
        (run / "manifest.json").unlink()
        for r, (host, pid) in enumerate(zip(man["hosts"], man["pids"])):
            (run / f"traces/rank{r}.json.gz").rename(run / f"traces/{host}_{pid}.17320000{r:05d}.pt.trace.json.gz")
    ingest([run], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        return s.diagnose()


def test_every_rank_of_one_host_slow_is_one_finding_of_that_host(tmp_path):
    d = _diagnose(tmp_path, [4, 5, 6, 7], tp=4, pp=2, dp=2, ranks_per_host=4)
    assert len(d.findings) == 1, [f.summary for f in d.findings]
    f = d.findings[0]
    assert f.ranks == (4, 5, 6, 7) and f.kind == "straggler" and f.cause == "slow_compute"
    assert "host node0001" in f.where and "host node0001" in f.next_step and "each of its 4 ranks" in f.summary
    # they run side by side: the job loses about one rank's 20% of its compute, not four of them
    assert 0.05 < f.cost_share < 0.15, f.cost_share
    assert d.localization.verdict == "straggler" and d.localization.culprit_ranks == (4, 5, 6, 7)


def test_half_a_host_is_its_host_and_fewer_are_ranks(tmp_path):
    # the hosts from the trainer's manifest this time
    d = _diagnose(tmp_path / "half", [0, 1, 2, 3], handler_names=False, tp=8, dp=2, ranks_per_host=8)
    assert [f.ranks for f in d.findings] == [(0, 1, 2, 3)], [f.summary for f in d.findings]
    assert "4 of its 8 ranks" in d.findings[0].summary
    d = _diagnose(tmp_path / "two", [0, 5], handler_names=False, tp=8, dp=2, ranks_per_host=8)
    assert sorted(f.ranks for f in d.findings) == [(0,), (5,)], [f.summary for f in d.findings]
    assert all("node of rank" in f.next_step for f in d.findings)


def test_two_slow_ranks_of_a_host_of_four_stay_two_ranks(tmp_path):
    d = _diagnose(tmp_path, [4, 6], tp=4, pp=2, dp=2, ranks_per_host=4)
    assert sorted(f.ranks for f in d.findings) == [(4,), (6,)], [f.summary for f in d.findings]


def test_a_jobs_hosts_come_from_the_profilers_own_file_names(tmp_path):
    from tracekit.ingest.topo import host_from_name

    assert host_from_name("/x/node-1.dc.example_4567.1732000000123456789.pt.trace.json.gz", 4567) == "node-1.dc.example"
    assert host_from_name("gpu_box_3_99.17.pt.trace.json", 99) == "gpu_box_3"
    assert host_from_name("gpu_box_3_99.17.pt.trace.json", 98) is None  # not the trace's own pid
    assert host_from_name("rank_3.json.gz", None) is None


@pytest.mark.parametrize("layout,host", [
    (dict(tp=8, dp=2), 0),  # the host is a TP group, half of the job's one stage
    (dict(pp=8, dp=2), 1),  # the host is a whole pipeline replica: each stage's two ranks, one of them slow
])
def test_a_slow_host_that_is_half_of_every_stage_is_found_at_its_own_ratio(tmp_path, layout, host):
    ranks = list(range(8 * host, 8 * host + 8))
    d = _diagnose(tmp_path, ranks, **layout, ranks_per_host=8)
    # before the hosts were compared as wholes: 1.08-1.09x (the stage medians half slow), or each
    # rank of the replica called 'moving' at 0.99 (its stage's other rank its only reference)
    hosts = [f for f in d.findings if f.kind == "straggler"]
    assert [f.ranks for f in hosts] == [tuple(ranks)], [f.summary for f in d.findings]
    assert not [f for f in d.findings if f.kind in ("moving", "transient")], [f.summary for f in d.findings]
    ratios = hosts[0].evidence["compute_ratios"].values()
    assert all(1.15 < r < 1.25 for r in ratios), ratios


def test_two_hosts_whose_chips_differ_name_no_host(tmp_path):
    cfg = SimConfig(tp=8, dp=2, steps=8, seed=3, noise=0.1, chip_spread=0.01)
    simulate(cfg, tmp_path / "run")
    ingest([tmp_path / "run"], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        d = s.diagnose()
    assert not [f for f in d.findings if "host" in f.where], [f.summary for f in d.findings]


def test_a_host_holding_whole_stages_of_a_single_replica_leaves_no_straggler_in_doubt(tmp_path):
    # tp 2 x cp 2 x pp 4, one replica: host node0001 holds stages 2 and 3 whole, 1.1x. Nothing does
    # their work elsewhere; the stages differ by design, so no test here can see it (grid draw 27's
    # kind host: "no straggler" at 0.87-0.91 before)
    d = _diagnose(tmp_path, list(range(8, 16)), factor=1.1, tp=2, cp=2, pp=4, ranks_per_host=8,
                  layers=4)
    assert not d.findings and d.localization.verdict == "no_straggler", [f.summary for f in d.findings]
    assert d.localization.confidence <= 0.5
    assert "with one replica, a whole pipeline stage" in d.cause.summary


def test_a_host_found_as_a_whole_is_named_with_every_rank_even_those_short_of_their_own_bar(tmp_path):
    # grid draw 28 (schedules), kind host: cp 2 x dp 8, host node0001 (ranks 8-15) 1.1x at 15% kernel
    # noise, 2 micro-batches of 2 layers. Six of its ranks clear their own bar, two do not; before,
    # the host was named with six ranks and the other two (and a healthy rank beside them) 'moving'
    cfg = SimConfig(cp=2, dp=8, steps=8, seed=2801437, noise=0.15, spikes=0.01, drift_ppm=20.0, names="none",
                    microbatches=2, layers=2, ranks_per_host=8, trace_names="profiler",
                    faults=tuple(f"slow:rank={r},factor=1.1" for r in range(8, 16)))
    simulate(cfg, tmp_path / "run")
    (tmp_path / "run/manifest.json").unlink()
    ingest([tmp_path / "run"], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        d = s.diagnose()
    assert [f.ranks for f in d.findings] == [tuple(range(8, 16))], [f.summary for f in d.findings]
    assert "host node0001" in d.findings[0].where and d.findings[0].confidence >= 0.9


def test_ranks_of_one_host_taking_turns_are_a_moving_straggler_not_a_slow_host(tmp_path):
    # three ranks of a host of four, 1.5x in turn: their trimmed means over the steps read high
    # enough to pass as a slow host, and the moving straggler was then "no straggler"
    cfg = SimConfig(tp=2, pp=2, dp=4, steps=8, seed=4, noise=0.05, ranks_per_host=4, layers=4,
                    trace_names="profiler", faults=("moving:ranks=0+1+2,factor=1.5",))
    simulate(cfg, tmp_path / "run")
    (tmp_path / "run/manifest.json").unlink()
    ingest([tmp_path / "run"], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        d = s.diagnose()
    assert d.localization.verdict == "moving", d.headline
    assert {r for f in d.findings for r in f.ranks} <= {0, 1, 2} and not any("host" in f.where for f in d.findings)


@pytest.mark.parametrize("dp, sure", [(1, False), (2, True)])
def test_a_stage_slower_on_all_its_ranks_is_an_imbalance_in_doubt_where_no_replica_repeats_it(tmp_path, dp, sure):
    # a host of 2 holding stage 1 of a tp 2 x pp 4 pipeline, 1.5x: with one replica nothing else does
    # that stage's work, and it read "stage imbalance" at 0.95 (fault grid draws 29 and 30, kind host);
    # with two replicas the host holds the stage of one of them and is named itself
    d = _diagnose(tmp_path, [2, 3], factor=1.5, tp=2, pp=4, dp=dp, ranks_per_host=2)
    stage = [f for f in d.findings if f.kind == "stage_imbalance" and 2 in f.ranks]
    if sure:
        assert not stage and d.findings[0].ranks == (2, 3) and d.findings[0].confidence > 0.9, d.headline
    else:
        assert [f.ranks for f in stage] == [(2, 3)] and stage[0].confidence <= 0.7, d.headline
        assert "one slow host" in stage[0].summary and "in doubt" in stage[0].summary


def test_a_stage_of_two_ranks_in_all_slower_on_both_is_an_imbalance_in_doubt(tmp_path):
    # a hold-out grid case (kind two, draw 29): ranks 4 and 12 at 1.3x are stage 4 of both replicas
    # of tp 1 x cp 1 x pp 8 x dp 2, its only ranks; it read "stage imbalance" at 0.95, wrong
    cfg = SimConfig(tp=1, cp=1, pp=8, dp=2, steps=8, seed=2901335, noise=0.1, spikes=0.01, names="mesh", layers=4,
                    faults=("slow:rank=4,factor=1.3", "slow:rank=12,factor=1.3"))
    simulate(cfg, tmp_path / "run")
    (tmp_path / "run/manifest.json").unlink()
    ingest([tmp_path / "run"], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        d = s.diagnose()
    stage = [f for f in d.findings if f.kind == "stage_imbalance"]
    assert stage and set(stage[0].ranks) == {4, 12}, [f.summary for f in d.findings]
    assert stage[0].confidence <= 0.7 and "in doubt: the stage has 2 ranks in all (ranks 4, 12)" in stage[0].summary
