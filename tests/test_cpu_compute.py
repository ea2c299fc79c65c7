"""Compute from CPU ops (tables.compute_events' fallback) on hand-made events with known answers."""

from __future__ import annotations

import polars as pl

from tracekit.analysis.tables import compute_events, conform


def _ev(rank, ts, dur, name, tid="1", kind="cpu_op", phase=None, is_comm=None):
    comm = name.startswith(("c10d::", "gloo:")) if is_comm is None else is_comm
    return {"run_id": "x", "rank": rank, "ts_ns": ts, "dur_ns": dur, "kind": kind, "name": name, "tid": tid,
            "step": 1, "phase": phase, "is_comm": comm}


def _events() -> pl.DataFrame:
    rows = [
        _ev(0, 0, 200, "ProfilerStep#1", kind="user_annotation"),
        _ev(0, 0, 100, "aten::linear"),            # top level
        _ev(0, 10, 50, "aten::mm"),                #   leaf
        _ev(0, 60, 10, "c10d::allreduce_"),        #   nested enqueue: 10 of comm
        #                                             70-95: no op runs; the worker's collective ends at 94
        _ev(0, 95, 5, "aten::add"),                #   leaf
        _ev(0, 100, 50, "_c10d_functional::wait_tensor"),  # top-level communication: not compute
        _ev(0, 150, 20, "aten::mul"),              # top level, a leaf
        _ev(0, 62, 32, "gloo:all_reduce", tid="9", kind="user_annotation"),
        _ev(0, 63, 5, "aten::copy_", tid="9"),     # worker thread ops: not the main thread
        _ev(1, 0, 80, "tk.compute phase=fwd", kind="compute", phase="fwd"),
        _ev(1, 5, 20, "aten::mm"),
    ]
    return conform(pl.DataFrame(rows), "events")


def test_top_level_main_thread_ops_minus_nested_comm_and_waits() -> None:
    comp = compute_events(_events()).sort("rank", "ts_ns")
    r0 = comp.filter(pl.col("rank") == 0)
    assert r0["name"].to_list() == ["aten::linear", "aten::mul"]
    # linear: the enqueue (10) and the wait on the worker's collective from 70 to the next op at 95 (25)
    assert r0["nested_comm_ns"].to_list() == [35, 0]
    r1 = comp.filter(pl.col("rank") == 1)  # an annotated rank keeps its annotations only
    assert r1["name"].to_list() == ["tk.compute phase=fwd"] and r1["nested_comm_ns"].is_null().all()


def test_a_gap_the_worker_did_not_end_is_compute() -> None:
    ev = _events().with_columns(  # the worker's collective ends long before the main thread resumes
        pl.when(pl.col("name") == "gloo:all_reduce").then(pl.lit(5)).otherwise(pl.col("dur_ns")).alias("dur_ns"))
    r0 = compute_events(ev).filter(pl.col("rank") == 0).sort("ts_ns")
    assert r0["nested_comm_ns"].to_list() == [10, 0]


def test_without_thread_ids_there_is_no_fallback() -> None:
    comp = compute_events(_events().drop("tid"))
    assert comp["rank"].to_list() == [1]
