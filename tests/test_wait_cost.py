"""What a slow rank costs where the what-if replay cannot run (GPU kernel traces): how much the step
grows, not its extra compute. The oracle is the simulator's own step times (manifest), faulted
against clean with the same seed and noise; tracekit only ingests and diagnoses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import tracekit
from tracekit.analysis.findings import Finding
from tracekit.ingest import ingest
from tracekit.report import gather, markdown
from tracekit.simulate.config import SimConfig
from tracekit.simulate.run import simulate

CASES = {
    # a 1.3x rank of stage 1 of 4: the heavier last stage sets the pace, and stage 1 has slack
    # (its extra compute is 29.8 ms a step, the step grows by 3.5 ms)
    "slack": dict(tp=2, pp=4, dp=2, seed=3, faults=("slow:rank=3,factor=1.3",)),
    # one replica: only the pipeline gates the stages, whose slack no group's waits show
    "one_replica": dict(tp=4, pp=4, dp=1, seed=4, faults=("slow:rank=5,factor=1.3",)),
    # a 1.3x rank in each replica of dp 2: each one's DP peer is the other's late replica
    "two_replicas": dict(tp=2, pp=1, dp=2, seed=5, faults=("slow:rank=1,factor=1.3", "slow:rank=2,factor=1.3")),
}


def _step_ms(run: Path) -> list[float]:
    return json.loads((run / "manifest.json").read_text())["simulated"]["step_ms"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wait_cost")
    out = {}
    for name, kw in CASES.items():
        faults = kw.pop("faults")
        clean = simulate(SimConfig(steps=8, **kw), root / f"{name}_clean")
        slow = simulate(SimConfig(steps=8, faults=faults, **kw), root / name)
        kw["faults"] = faults
        ingest([slow], root / f"{name}.duckdb", workers=1)
        with tracekit.open(root / f"{name}.duckdb") as s:
            d = s.diagnose()
        grew = [b - a for a, b in zip(_step_ms(clean), _step_ms(slow))][1:]
        out[name] = {"d": d, "grew_ns": sum(grew) / len(grew) * 1e6, "store": root / f"{name}.duckdb"}
    return out


def _ranked(d) -> dict[int, Finding]:
    return {f.ranks[0]: f for f in d.findings if f.kind == "straggler" and len(f.ranks) == 1}


def test_a_rank_with_slack_costs_the_steps_growth_not_its_extra_compute(runs):
    d, grew = runs["slack"]["d"], runs["slack"]["grew_ns"]
    f = _ranked(d)[3]
    assert f.evidence["extra_compute_ns"] > 5 * grew  # what it used to report
    assert abs(f.cost_ns - grew) <= max(0.4 * grew, 1.5e6), (f.cost_ns, grew)
    assert f.evidence["cost_from"] == "waits in its DP groups" and not f.cost_upper_bound
    assert f"costs {f.cost_ns / 1e6:.1f} ms per step ({f.cost_share:.1%})" in d.headline
    assert "at most" not in d.headline


def test_with_one_replica_the_cost_is_said_to_be_an_upper_bound(runs):
    d, grew = runs["one_replica"]["d"], runs["one_replica"]["grew_ns"]
    f = _ranked(d)[5]
    assert f.cost_upper_bound and f.cost_ns >= grew
    assert f"costs at most {f.cost_ns / 1e6:.1f} ms per step" in d.headline
    with tracekit.open(runs["one_replica"]["store"]) as s:
        report = markdown(gather(s))
    assert f"| <= {f.cost_ns / 1e6:.1f} |" in report
    from apps.views.overview import findings_frame  # the dashboard's table says it as well

    table = findings_frame(d)
    assert table.loc[table["ranks"] == "5", "share"].item() == f"at most {f.cost_share:.1%}"


def test_a_second_culprit_is_not_a_peer_the_first_is_measured_against(runs):
    d = runs["two_replicas"]["d"]
    found = _ranked(d)
    assert sorted(found) == [1, 2], d.headline
    for f in found.values():  # each one's DP peer is the other's late replica: it read 0 ms there
        assert f.cost_ns >= 0.7 * f.evidence["extra_compute_ns"], (f.ranks, f.cost_ns, f.evidence)
        assert not f.cost_upper_bound


def test_cost_text_says_at_most_only_for_an_upper_bound():
    f = Finding("straggler", (1,), "rank 1", (), 15.4e6, 0.138, 0.99, "slow_compute", "s", "n")
    assert f.cost_text() == "15.4 ms per step (13.8%)"
    assert replace(f, cost_upper_bound=True).cost_text() == "at most 15.4 ms per step (13.8%)"
