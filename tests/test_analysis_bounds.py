"""Bounded figures on toy cases with hand-computed values: the CP-wait shares (waiting of exposed
time, explained of waiting) stay in [0, 1] and equal the arithmetic below."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_job import make_job  # noqa: E402

from tracekit.analysis.cp_wait import cp_wait  # noqa: E402
from tracekit.analysis.tables import RunTables  # noqa: E402
from tracekit.topology import Layout  # noqa: E402

STEP_NS = 1000


def _cp_pair(compute: dict[int, int], coll: dict[int, tuple[int, int]]) -> RunTables:
    """Two CP ranks, one step [0, STEP_NS): rank r computes [0, compute[r]) then sits in one CP
    all-gather from coll[r][0] to coll[r][1]."""
    job = make_job(layout=Layout(cp=2), steps=1, microbatches=1)  # the other tables' shapes
    job["events"] = pl.DataFrame(
        [("t", r, 0, c, "user_annotation", "tk.compute phase=fwd vstage=0 mb=0", "main", 0, "fwd", 0, 0, None, False)
         for r, c in compute.items()], schema=job["events"].schema, orient="row")
    job["collectives"] = pl.DataFrame(
        [("t", r, "cp:0", 0, "all_gather", s, e, 64, "bfloat16", 0, "annotation") for r, (s, e) in coll.items()],
        schema=job["collectives"].schema, orient="row")
    job["steps"] = pl.DataFrame([("t", r, 0, 0, STEP_NS) for r in compute], schema=job["steps"].schema, orient="row")
    job["p2p"] = job["p2p"].clear()
    job = {k: v.with_columns(pl.lit("t").alias("run_id")) for k, v in job.items()}
    return RunTables.from_mapping(job)


def test_cp_wait_split_of_one_all_gather() -> None:
    # rank 0 computes 100 ns and arrives at 100; rank 1 computes 400 and arrives at 400; both end at 500.
    w = cp_wait(_cp_pair({0: 100, 1: 400}, {0: (100, 500), 1: (400, 500)}))
    assert (w.exposed_ns, w.wait_ns, w.transfer_ns) == (400 + 100, 300, 100 + 100)
    assert w.wait_frac == pytest.approx(300 / 500)
    assert w.explained_ns == 300 and w.explained_frac == 1.0  # min(300 waited, 400 - 100 less compute)
    assert w.exposed_frac == pytest.approx(500 / (2 * STEP_NS))
    assert w.compute_ratio == pytest.approx(4.0)
    assert w.cause == "compute_imbalance"
    assert "60.0% of it is waiting" in w.headline and "100% of the waiting explained" in w.headline


def test_cp_wait_explained_is_the_compute_gap_when_smaller_than_the_wait() -> None:
    # rank 0 computes 300 (gap 100 to rank 1's 400) but arrives at 100 (it idled 200 outside compute)
    tables = _cp_pair({0: 300, 1: 400}, {0: (350, 500), 1: (400, 500)})
    w = cp_wait(tables)
    assert w.wait_ns == 50 and w.explained_ns == 50  # min(50, 100)
    tables = _cp_pair({0: 300, 1: 400}, {0: (300, 500), 1: (400, 500)})
    w = cp_wait(tables)
    assert w.wait_ns == 100 and w.explained_ns == 100
    w = cp_wait(_cp_pair({0: 50, 1: 400}, {0: (100, 500), 1: (400, 500)}))
    assert (w.wait_ns, w.explained_ns) == (300, 300) and w.explained_frac == 1.0


def test_a_member_that_left_before_the_last_arrived_waits_at_most_its_span() -> None:
    """Rank 0's span (an enqueue, or clocks that disagree) ends at 150, before rank 1 arrives at
    400: it cannot have waited 300 ns inside 50. Its wait is its whole span (50), its transfer 0:
    waiting is 50 of 150 exposed, never more than all of it (the 1633% of issue 29)."""
    w = cp_wait(_cp_pair({0: 100, 1: 400}, {0: (100, 150), 1: (400, 500)}))
    assert (w.exposed_ns, w.wait_ns, w.transfer_ns) == (50 + 100, 50, 0 + 100)
    assert w.wait_frac == pytest.approx(50 / 150) and 0.0 <= w.wait_frac <= 1.0
    assert w.explained_ns == 50 and w.explained_frac == 1.0
    ranks = w.per_rank.sort("rank")
    assert ranks["wait_ns"].to_list() == [50, 0] and ranks["transfer_ns"].to_list() == [0, 100]
    assert "33.3% of it is waiting" in w.headline


def _cp_work(tables: RunTables, work: dict[int, float]) -> pl.DataFrame:
    return pl.DataFrame({"rank": list(work), "step": [0] * len(work), "work": list(work.values())})


def test_cp_wait_cause_kinds_on_toy_groups() -> None:
    """Each cause cp_wait can return, on the two-rank toy (one step of 1000 ns, effect_min_frac
    0.005: waits under 10 ns are noise; cp_explained_min 0.5)."""
    slow1 = _cp_pair({0: 100, 1: 400}, {0: (100, 500), 1: (400, 500)})  # rank 1 computes more
    # the slowest member (rank 1) also had the most attention work: document-mask imbalance
    w = cp_wait(slow1, work=_cp_work(slow1, {0: 1.0, 1: 3.0}))
    assert w.cause == "document_mask_imbalance" and w.work_ratio == pytest.approx(3.0)
    assert "document-mask (attention work) imbalance" in w.headline and "attention work ratio 3.00" in w.headline
    # the most work is on the other rank: the compute imbalance is not the documents'
    w = cp_wait(slow1, work=_cp_work(slow1, {0: 3.0, 1: 1.0}))
    assert w.cause == "compute_imbalance"
    # both compute 400, rank 0 still waits 300 (it arrived early, idle): nothing explains it
    w = cp_wait(_cp_pair({0: 400, 1: 400}, {0: (100, 500), 1: (400, 500)}))
    assert (w.wait_ns, w.explained_ns, w.cause) == (300, 0, "unexplained") and w.explained_frac == 0.0
    # a wait of 5 ns in 2000 ns of steps is noise
    w = cp_wait(_cp_pair({0: 395, 1: 400}, {0: (395, 500), 1: (400, 500)}))
    assert (w.wait_ns, w.cause) == (5, "none")


def test_cp_wait_without_cp_groups_is_no_cp() -> None:
    tables = _cp_pair({0: 100, 1: 400}, {0: (100, 500), 1: (400, 500)})
    job = {n: getattr(tables, n) for n in ("runs", "ranks", "groups", "events", "collectives", "p2p", "steps")}
    job["groups"] = job["groups"].with_columns(pl.lit("dp").alias("dim"))
    w = cp_wait(RunTables.from_mapping(job))
    assert w.cause == "no_cp" and w.headline == "no context-parallel collectives in this run"
