"""Group assignment of unlabelled gloo collectives on synthetic rows: 4 ranks (tp 2 x dp 2), two
groups per dimension, every op the same kind and size (order and shape cannot tell dp from tp)."""

from __future__ import annotations

import random

import polars as pl
import pytest

from tracekit.analysis.assign_groups import assign, needs_assignment
from tracekit.analysis.tables import conform

# rank = tp + 2 * dp
GROUPS = {"t0": ("tp", [0, 1]), "t1": ("tp", [2, 3]), "d0": ("dp", [0, 2]), "d1": ("dp", [1, 3])}
US = 1000


def _job(n_tp: int = 6, n_dp: int = 6, seed: int = 0) -> dict[str, pl.DataFrame]:
    """Each group's k-th instance completes at one time on all its members (a few us of jitter);
    each rank runs each of its groups on a worker thread of its own."""
    rnd = random.Random(seed)
    coll, events, truth = [], [], []
    for name, (dim, members) in GROUPS.items():
        n = n_tp if dim == "tp" else n_dp
        for k in range(n):
            # instances of different groups interleave, 150-400 us apart
            end = (10_000 * US + k * 1000 * US + (0 if dim == "tp" else 500 * US)
                   + (150 * US if name[1] == "1" else 0))
            for r in members:
                e = end + rnd.randint(0, 5) * US
                s = e - rnd.randint(50, 300) * US
                tid = f"{100 + r * 10 + (0 if dim == 'tp' else 1)}"
                coll.append({"run_id": "x", "rank": r, "pg_name": None, "seq": 0, "op": "all_reduce", "start_ns": s,
                             "end_ns": e, "nbytes": None, "dtype": None, "step": 1, "source": "gloo"})
                events.append({"run_id": "x", "rank": r, "ts_ns": s, "dur_ns": e - s, "kind": "user_annotation",
                               "name": "gloo:all_reduce", "tid": tid, "step": 1, "is_comm": True})
                truth.append((r, s, name, k))
    groups = pl.DataFrame([{"run_id": "x", "pg_name": n, "pg_desc": f"mesh_{d}", "dim": d, "ranks": m, "size": 2}
                           for n, (d, m) in GROUPS.items()])
    steps = pl.DataFrame([{"run_id": "x", "rank": r, "step": 1, "start_ns": 0, "end_ns": 10**12} for r in range(4)])
    coords = pl.DataFrame({"rank": [0, 1, 2, 3], "dp": [0, 0, 1, 1], "pp": [0] * 4, "cp": [0] * 4, "tp": [0, 1, 0, 1]},
                          schema={"rank": pl.Int32, "dp": pl.Int64, "pp": pl.Int64, "cp": pl.Int64, "tp": pl.Int64})
    return {"collectives": conform(pl.DataFrame(coll), "collectives"),
            "events": conform(pl.DataFrame(events), "events"),
            "groups": conform(groups, "groups"), "steps": conform(steps, "steps"), "coords": coords,
            "p2p": conform(pl.DataFrame(schema={"rank": pl.Int32}), "p2p"),
            "truth": pl.DataFrame(truth, schema={"rank": pl.Int32, "start_ns": pl.Int64, "want_pg": pl.Utf8,
                                                 "want_seq": pl.Int64}, orient="row")}


def _fr(job: dict, counts: dict[str, int]) -> pl.DataFrame:
    rows = []
    for name, (_, members) in GROUPS.items():
        for r in members:
            for k in range(counts[name]):
                rows.append({"run_id": "x", "rank": r, "pg_name": name, "profiling_name": "gloo:all_reduce",
                             "is_p2p": False, "time_created_ns": 10_000 * US + k * 1000 * US})
    return pl.DataFrame(rows)


def _check(job: dict, coll: pl.DataFrame) -> None:
    got = coll.join(job["truth"], on=["rank", "start_ns"])
    assert got.height == job["truth"].height
    assert (got["pg_name"] == got["want_pg"]).all()
    assert (got["seq"] == got["want_seq"]).all()


def _run(job: dict, fr: pl.DataFrame | None = None):
    return assign(job["collectives"], job["p2p"], job["events"], job["groups"], job["coords"], job["steps"], fr)


def test_timing_tells_groups_apart_where_order_kind_and_shape_cannot() -> None:
    job = _job()
    assert needs_assignment(job["collectives"], job["p2p"])
    coll, _, how = _run(job)
    assert how.method == "timing" and how.collectives_left == 0 and how.consistency == 1.0
    _check(job, coll)
    assert how.threads[0] == {"100": "t0", "101": "d0"} and how.threads[3] == {"130": "t1", "131": "d1"}


def test_flight_recorder_counts_decide_without_timing() -> None:
    job = _job(n_tp=8, n_dp=4)
    # completions that say nothing: every rank's ops end at its own unrelated times
    shuffled = job["collectives"].with_columns(pl.col("end_ns") + pl.col("rank").cast(pl.Int64) * 333 * US)
    job = {**job, "collectives": shuffled}
    counts = {"t0": 8, "t1": 8, "d0": 4, "d1": 4}
    coll, _, how = _run(job, _fr(job, counts))
    assert how.method == "flight_recorder"
    _check(job, coll)


def test_flight_recorder_with_equal_counts_falls_back_to_timing() -> None:
    job = _job(n_tp=6, n_dp=6)
    coll, _, how = _run(job, _fr(job, {"t0": 6, "t1": 6, "d0": 6, "d1": 6}))
    assert how.method == "timing"
    _check(job, coll)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_labelled_rows_are_left_alone(seed: int) -> None:
    job = _job(seed=seed)
    labelled = job["collectives"].with_columns(pl.lit("t9").alias("pg_name"), pl.lit("annotation").alias("source"))
    assert not needs_assignment(labelled, job["p2p"])
    coll, _, how = assign(labelled, job["p2p"], job["events"], job["groups"], job["coords"], job["steps"])
    assert coll.sort("rank", "start_ns").equals(labelled.sort("rank", "start_ns")) and how.collectives_labelled == 0
