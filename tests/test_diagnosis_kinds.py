"""The cause kinds of the straggler analysis that no other test pinned (hang, unexplained), on a
modelled 16-rank job (tests/synthetic_job.py: dp2 x pp2 x cp2 x tp2, in-process); the confidence
stays below 1 and falls with a weaker fault; a finding's cost is how much the step grows (against
the same job without the fault), and its share of the step within [0, 1].

Where the other kinds are pinned: slow_compute, slow_link, cpu_bound, stage_imbalance,
data_imbalance, insufficient_data, none: test_analysis_localize.py; CP-wait's
document_mask_imbalance, compute_imbalance, unexplained, none, no_cp: test_analysis_bounds.py."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_job import Faults, make_job  # noqa: E402

from tracekit.analysis.diagnosis import diagnose  # noqa: E402
from tracekit.analysis.localize import Localization  # noqa: E402
from tracekit.analysis.rootcause import explain  # noqa: E402
from tracekit.analysis.tables import RunTables  # noqa: E402
from tracekit.topology import Layout  # noqa: E402

LAYOUT = Layout(tp=2, cp=2, pp=2, dp=2)


def _diagnose(faults: Faults = Faults(), seed: int = 0, **kw):
    job = make_job(LAYOUT, faults=faults, seed=seed, **kw)
    return job, diagnose(RunTables.from_mapping(job))


def test_traces_ending_inside_incomplete_collectives_are_a_hang() -> None:
    """Every group's last collective lacks its first member (the traces end in a hang): no
    performance verdict, cause 'hang', confidence 0."""
    job = make_job(LAYOUT, seed=1)
    c = job["collectives"]
    top = c.group_by("pg_name").agg(pl.col("seq").max().alias("top"))
    first = job["groups"].select("pg_name", pl.col("ranks").list.first().alias("first"))
    job["collectives"] = c.join(top, on="pg_name").join(first, on="pg_name").filter(
        ~((pl.col("seq") == pl.col("top")) & (pl.col("rank") == pl.col("first")))).drop("top", "first")
    d = diagnose(RunTables.from_mapping(job))
    assert (d.localization.verdict, d.cause.kind, d.findings) == ("hang", "hang", [])
    assert d.localization.confidence == 0.0 and "24 groups' last collectives are missing members" in d.headline


@pytest.mark.parametrize("verdict, ranks, coords", [
    ("straggler", (5,), {"dp": 0, "pp": 1, "cp": 0, "tp": 1}),
    ("group", (4, 5), {"dp": 0, "pp": 1, "cp": 0}),
    ("stage", (2, 3, 6, 7, 10, 11, 14, 15), {"pp": 1}),
])
def test_a_late_rank_group_or_stage_with_nothing_behind_it_is_unexplained(verdict, ranks, coords) -> None:
    """A clean job with a localization that blames someone anyway: compute, gaps and links are
    normal, so explain says 'unexplained' (never a made-up cause)."""
    tables = RunTables.from_mapping(make_job(LAYOUT, seed=1))
    loc = Localization(verdict, ranks[0] if verdict == "straggler" else None, ranks, coords, 0.9, 1e8)
    cause = explain(tables, loc)
    assert cause.kind == "unexplained" and set(cause.ranks) == set(ranks), cause.summary


def test_confidence_is_below_1_and_falls_with_a_weaker_fault() -> None:
    def confidence(factor: float, noise: float) -> float:
        _, d = _diagnose(Faults(slow_rank=5, slow_factor=factor), seed=5, noise=noise)
        assert d.localization.verdict == "straggler" and d.localization.culprit_rank == 5, d.headline
        (f,) = d.findings
        assert 0.0 < f.confidence < 1.0 and 0.0 < d.localization.confidence < 1.0
        return d.localization.confidence

    assert confidence(1.3, 0.10) > confidence(1.1, 0.10) > 0.5
    assert confidence(1.05, 0.05) > confidence(1.03, 0.05) > 0.0


@pytest.mark.parametrize("factor", [1.5, 1.1])
def test_a_slow_rank_costs_what_the_step_grows_by(factor: float) -> None:
    """Rank 5 computes ``factor`` times as long. The step grows by less than its extra compute
    (the spans in the modelled trace, times 1 - 1/factor): the slowest of the other ranks' noisy
    kernels already set part of the pace (1.1x: 7.3 ms of extra compute, the step 2.4 ms longer).
    Its cost is how long its peers waited on it: nearer the step's growth, within 2% of a step, and
    never above the extra compute; its share is of the median step."""
    job, d = _diagnose(Faults(slow_rank=5, slow_factor=factor), seed=5, noise=0.05)
    clean = make_job(LAYOUT, faults=Faults(), seed=5, noise=0.05)  # the same noise, no fault
    step = lambda j: j["steps"].group_by("step").agg((pl.col("end_ns") - pl.col("start_ns")).mean())["end_ns"].mean()
    grew = step(job) - step(clean)
    ev = job["events"].filter((pl.col("rank") == 5) & pl.col("name").str.starts_with("tk.compute"))
    extra = ev["dur_ns"].sum() / job["steps"]["step"].n_unique() * (1 - 1 / factor)
    (f,) = d.findings
    assert abs(f.cost_ns - grew) < abs(extra - grew) and abs(f.cost_ns - grew) <= 0.02 * d.localization.step_time_ns
    assert f.cost_ns <= f.evidence["extra_compute_ns"] and f.evidence["extra_compute_ns"] == pytest.approx(extra, rel=0.15)
    assert f.cost_share == pytest.approx(f.cost_ns / d.localization.step_time_ns)
    assert 0.0 < f.cost_share < 1.0


def test_a_slow_link_finding_is_bounded_and_costs_its_excess() -> None:
    _, d = _diagnose(Faults(slow_link=(9, 13)), seed=3)
    (link,) = [f for f in d.findings if f.kind == "slow_link"]
    assert set(link.ranks) == {9, 13} and link.cause == "slow_link"
    assert 0.0 < link.confidence < 1.0
    assert 0.0 < link.cost_share < 1.0 and link.cost_share == pytest.approx(link.cost_ns / d.localization.step_time_ns)
