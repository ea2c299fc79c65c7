"""The simulator's tables written straight (for large worlds) are what an ingest of its traces gives.

The oracle is the real ingest of the simulator's Kineto traces and flight-recorder pickles (the
path every real job takes); the straight tables must agree with it row for row, up to the
nanosecond the profiler's microsecond timestamps round away.
"""

from __future__ import annotations

import duckdb
import pytest

from tracekit.ingest import ingest
from tracekit.simulate.config import SimConfig
from tracekit.simulate.run import simulate
from tracekit.simulate.tables import write_duckdb

CASES = {
    "skewed": SimConfig(tp=2, cp=2, pp=2, dp=2, steps=3, seed=2, noise=0.05, skew_ms=800, drift_ppm=20,
                        faults=("slow:rank=5,factor=1.3",)),
    "hang": SimConfig(tp=2, cp=1, pp=2, dp=2, steps=3, seed=1, faults=("hang:rank=3,step=1",)),
    # PP outermost (torchtitan's, Megatron-LM's rank order): both paths number ranks alike
    "pp_outermost": SimConfig(tp=2, cp=1, pp=2, dp=2, steps=3, seed=4, faults=("link:a=1,b=5,delay_ms=10",),
                              order=("tp", "cp", "dp", "pp")),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def both(request, tmp_path_factory):
    cfg = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    simulate(cfg, d / "run")
    ingest([d / "run"], d / "ingested.duckdb", workers=1)
    write_duckdb(cfg, d / "straight.duckdb", "run", fr_tail=10_000)
    a = duckdb.connect(str(d / "ingested.duckdb"), read_only=True)
    b = duckdb.connect(str(d / "straight.duckdb"), read_only=True)
    yield a, b
    a.close()
    b.close()


def _same(a, b, query: str, times: tuple[str, ...] = ()) -> None:
    x, y = a.sql(query).pl(), b.sql(query).pl()
    assert x.height == y.height and x.height > 0, query
    for c in x.columns:
        if c in times:  # the profiler writes microseconds with 3 decimals: a nanosecond of rounding
            assert (x[c] - y[c]).abs().max() <= 2, (query, c)
        else:
            assert x[c].equals(y[c]), (query, c, x.filter(x[c] != y[c]).head(3), y.filter(x[c] != y[c]).head(3))


def test_compute_kernels_match(both):
    a, b = both
    _same(a, b, "SELECT rank, ts_ns, dur_ns, kind, name, tid, step FROM events WHERE kind = 'kernel' AND NOT is_comm "
                "ORDER BY rank, ts_ns", times=("ts_ns", "dur_ns"))


def test_collectives_and_p2p_match(both):
    a, b = both
    _same(a, b, "SELECT rank, pg_name, op, start_ns, end_ns, nbytes, dtype, step FROM collectives "
                "WHERE source = 'kernel' ORDER BY rank, start_ns, pg_name", times=("start_ns", "end_ns"))
    _same(a, b, "SELECT rank, peer, direction, pg_name, start_ns, end_ns, nbytes, step FROM p2p "
                "WHERE source = 'kernel' ORDER BY rank, start_ns, direction", times=("start_ns", "end_ns"))


def test_steps_ranks_groups_match(both):
    a, b = both
    _same(a, b, "SELECT rank, step, start_ns, end_ns FROM steps ORDER BY rank, step", times=("start_ns", "end_ns"))
    _same(a, b, "SELECT rank, dp, pp, cp, tp, host, pid FROM ranks ORDER BY rank")
    _same(a, b, "SELECT pg_name, pg_desc, dim, ranks, size FROM groups ORDER BY pg_name")
    _same(a, b, "SELECT world_size, tp, cp, pp, dp, layout_source, backend FROM runs")


def test_flight_recorder_entries_match(both):
    a, b = both
    _same(a, b, "SELECT rank, pg_name, pg_desc, collective_seq_id, p2p_seq_id, op_id, is_p2p, profiling_name, "
                "state, retired, time_created_ns, duration_ms IS NULL AS open FROM fr_entries "
                "ORDER BY rank, time_created_ns, op_id", times=("time_created_ns",))


def test_the_tail_keeps_each_ranks_newest_entries(tmp_path):
    cfg = CASES["hang"]
    write_duckdb(cfg, tmp_path / "t.duckdb", "run", fr_tail=5)
    con = duckdb.connect(str(tmp_path / "t.duckdb"), read_only=True)
    per = con.sql("SELECT rank, count(*) AS n, max(record_id) - min(record_id) AS span FROM fr_entries GROUP BY rank"
                  ).pl()
    assert per.height == cfg.world_size and (per["n"] == 5).all() and (per["span"] == 4).all()
    # the hung rank's peers end in an open entry: the tail keeps it
    open_ = con.sql("SELECT DISTINCT rank FROM fr_entries WHERE state <> 'completed'").pl()["rank"].to_list()
    assert open_ and 3 not in open_
    con.close()


def test_a_diagnosis_of_the_straight_tables_names_the_slow_rank(tmp_path):
    import tracekit

    write_duckdb(CASES["skewed"], tmp_path / "s.duckdb", "run")
    with tracekit.open(tmp_path / "s.duckdb") as s:
        d = s.diagnose()
    assert [f.ranks for f in d.findings if f.kind == "straggler"] == [(5,)], d.headline
    assert d.findings[0].cost_ns > 0 and 0 < d.findings[0].cost_share < 1


def test_simulate_parquet_then_stragglers_through_the_cli(tmp_path):
    """`tracekit simulate --format parquet` writes a dataset store that `tracekit stragglers` opens."""
    import json
    import subprocess
    import sys

    run = [sys.executable, "-c", "import sys; from tracekit.cli import main; sys.argv[0] = 'tracekit'; main()"]
    out = tmp_path / "ds"
    sim = subprocess.run([*run, "simulate", "--tp", "2", "--pp", "2", "--dp", "4", "--steps", "6", "--skew-ms", "900",
                          "--fault", "slow:rank=13,factor=1.3", "--format", "parquet", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr
    assert (out / "_tracekit_dataset.json").exists() and not (out / "traces").exists()
    res = subprocess.run([*run, "stragglers", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)["stragglers"]
    assert [f["ranks"] for f in d["findings"]] == [[13]], d["headline"]
    truth = json.loads(duckdb.connect().sql(
        f"SELECT manifest FROM read_parquet('{out}/runs/**/*.parquet', hive_partitioning = true)").fetchall()[0][0])
    assert truth["faults"][0]["ranks"] == [13]
