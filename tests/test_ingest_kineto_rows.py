"""kineto_rows against an oracle: the events, steps and pids of a trace as plain SQL over DuckDB's
own JSON reader (the derivation ingest used before it moved to Arrow), on hypothesis-generated
traces full of edge cases: fractional and large timestamps, missing durations, correlation ids
that are not plain integers, overlapping and malformed ProfilerStep spans, GPU events launched in
one step and run in the next, the profiler's own 'Trace' span, null names and categories."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracekit import classify
from tracekit.conventions import parse_compute
from tracekit.ingest import kineto, kineto_rows
from tracekit.ingest.common import IngestError
from tracekit.ingest.pipeline import ingest

BASE = 1_716_000_000_000_000_000
CATS = ["cpu_op", "user_annotation", "kernel", "cuda_runtime", "cuda_driver", "gpu_memcpy", "gpu_user_annotation",
        "python_function", "Trace", "some_new_category", None]
NAMES = ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#99999999999", "ProfilerStep#x",
         "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "record_param_comms", "gloo:all_reduce", "tk.comm bad",
         "tk.compute phase=fwd vstage=1 mb=3", "tk.compute nonsense", "aten::mm", "cudaLaunchKernel",
         "sm90_xmma_gemm", None]
CORRELATIONS = st.one_of(st.integers(0, 40), st.sampled_from(["7", "+5", " 12 ", "1.5", "1e1", "abc", "", None]))

events = st.lists(st.fixed_dictionaries(
    {"ph": st.sampled_from(["X", "X", "X", "X", "i"]), "cat": st.sampled_from(CATS), "name": st.sampled_from(NAMES),
     "pid": st.sampled_from([1, 2, "1", "host", None]), "tid": st.sampled_from([1, 7, "stream 7", None]),
     "ts": st.one_of(st.integers(0, 3000), st.floats(0, 3000, allow_nan=False).map(lambda x: round(x, 4)),
                     st.sampled_from([1.0005, 2.0015, 1e12 + 0.0005, 0.0004999, 0.0025, 0.0125, 3.0])),
     "dur": st.one_of(st.none(), st.integers(0, 1500), st.floats(0, 1500, allow_nan=False),
                      st.sampled_from([0.0005, 0.0015, 0.0025, 1002.5e-3])),  # exact halves of a ns
     "correlation": CORRELATIONS}), min_size=1, max_size=60)


def _write(path: Path, evs: list[dict]) -> None:
    out = []
    for e in evs:
        ev = {k: v for k, v in e.items() if v is not None and k not in ("correlation", "dur")}
        if e["dur"] is not None:
            ev["dur"] = e["dur"]
        if e["correlation"] is not None:
            ev["args"] = {"correlation": e["correlation"]}
        out.append(ev)
    path.write_text(json.dumps({"traceEvents": out, "baseTimeNanoseconds": BASE}))
    path.with_suffix(".array").write_text(json.dumps(out))  # for the oracle's reader


def _oracle(path: Path) -> tuple[list[tuple], list[tuple], list[int]]:
    """events (ts_ns, dur_ns, kind, name, tid, step, phase, vstage, microbatch, correlation,
    is_comm), steps and pids by SQL, as ingest derived them before kineto_rows."""
    con = duckdb.connect()
    kinds = " ".join(f"WHEN '{k}' THEN '{v}'" for k, v in kineto_rows.KINDS.items())
    con.execute(f"""
        CREATE TABLE raw AS SELECT (CASE cat {kinds} ELSE cat END) AS kind, name, tid,
               TRY_CAST(pid AS BIGINT) AS pid,
               CAST(floor(ts) AS BIGINT) * 1000 + CAST(round((ts - floor(ts)) * 1000) AS BIGINT) AS ts_ns,
               CAST(round(coalesce(dur, 0) * 1000) AS BIGINT) AS dur_ns,
               TRY_CAST(args.correlation AS BIGINT) AS correlation, {classify.sql_is_comm('name')} AS is_comm
        FROM {kineto._reader(str(path.with_suffix(".array")))} WHERE ph = 'X' AND cat IS DISTINCT FROM 'Trace'""")
    con.execute(r"""
        CREATE TABLE steps AS SELECT step, min(ts_ns) AS start_ns, max(ts_ns + dur_ns) AS end_ns
        FROM (SELECT TRY_CAST(regexp_extract(name, '^ProfilerStep#(\d+)$', 1) AS INTEGER) AS step, ts_ns, dur_ns
              FROM raw WHERE kind IN ('cpu_op', 'user_annotation') AND starts_with(name, 'ProfilerStep#'))
        WHERE step IS NOT NULL GROUP BY step""")
    spans = con.execute("SELECT step, start_ns, end_ns FROM steps WHERE start_ns IS NOT NULL "
                        "ORDER BY start_ns, step").fetchall()
    by_time = ("(CASE " + " ".join(f"WHEN ts_ns >= {a} AND ts_ns < {b} THEN {s}" for s, a, b in spans) + " END)"
               if spans else "CAST(NULL AS INTEGER)")
    con.execute(f"CREATE TABLE rt AS SELECT correlation, min({by_time}) AS step FROM raw "
                "WHERE kind = 'runtime' AND correlation IS NOT NULL GROUP BY correlation")
    names = [n for (n,) in con.execute("SELECT DISTINCT name FROM raw WHERE starts_with(name, 'tk.compute ')").fetchall()]
    comp = {}
    for n in names:
        try:
            p = parse_compute(n)
        except Exception:  # noqa: BLE001 - a malformed annotation is a plain event
            p = None
        if p is not None:
            comp[n] = (p.phase, p.vstage, p.mb)
    con.execute("CREATE TABLE comp (name VARCHAR, phase VARCHAR, vstage INTEGER, mb INTEGER)")
    for n, v in comp.items():
        con.execute("INSERT INTO comp VALUES (?, ?, ?, ?)", [n, *v])
    gpu = "('kernel', 'memcpy', 'memset', 'gpu_annotation')"
    ev = con.execute(f"""
        SELECT e.ts_ns + {BASE}, e.dur_ns,
               CASE WHEN c.name IS NOT NULL THEN 'compute' WHEN starts_with(e.name, 'tk.comm ') THEN 'comm'
                    ELSE e.kind END,
               e.name, e.tid,
               CASE WHEN e.kind IN {gpu} AND rt.step IS NOT NULL THEN rt.step
                    ELSE {by_time.replace('ts_ns', 'e.ts_ns')} END,
               c.phase, c.vstage, c.mb, e.correlation, e.is_comm
        FROM raw e LEFT JOIN rt ON e.correlation = rt.correlation LEFT JOIN comp c ON e.name = c.name
        ORDER BY ALL""").fetchall()
    steps = con.execute(f"SELECT step, start_ns + {BASE}, end_ns + {BASE} FROM steps ORDER BY ALL").fetchall()
    pids = [p for (p,) in con.execute("SELECT pid FROM raw WHERE kind IN ('runtime', 'cpu_op', 'user_annotation') "
                                      "AND pid IS NOT NULL GROUP BY pid ORDER BY count(*) DESC, pid").fetchall()]
    return ev, steps, pids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(evs=events)
def test_rows_match_the_sql_oracle(evs: list[dict], tmp_path: Path) -> None:
    path = tmp_path / "rank0.json"
    _write(path, evs)
    want_events, want_steps, want_pids = _oracle(path)
    con = duckdb.connect()
    parsed = kineto.parse(path, con)
    con.register("events", parsed.tables["events"])
    con.register("steps", parsed.tables["steps"])
    got = con.execute("SELECT * FROM events ORDER BY ALL").fetchall()
    assert got == want_events
    assert con.execute("SELECT * FROM steps ORDER BY ALL").fetchall() == want_steps
    assert parsed.pids == want_pids


def test_gpu_events_take_the_step_of_their_launch(tmp_path: Path) -> None:
    """A kernel launched at the end of step 0 and run in step 1's time belongs to step 0; one
    without a matching launch falls back to its own time."""
    evs = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "ts": 100 * s, "dur": 100}
           for s in range(2)]
    evs += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 95, "dur": 2,
             "args": {"correlation": 41}},
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 120, "dur": 30, "args": {"correlation": 41}},
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 130, "dur": 30, "args": {"correlation": 42}},
            {"ph": "X", "cat": "kernel", "name": "late", "ts": 250, "dur": 1}]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": evs}))
    con = duckdb.connect()
    ev = kineto.parse(path, con).tables["events"]
    steps = dict(zip(zip(ev.column("name").to_pylist(), ev.column("ts_ns").to_pylist()), ev.column("step").to_pylist()))
    assert steps[("gemm", 120_000)] == 0
    assert steps[("gemm", 130_000)] == 1
    assert steps[("late", 250_000)] is None


@pytest.mark.parametrize("ts", [1e300, -1e300])
def test_a_time_out_of_range_names_the_file(tmp_path: Path, ts: float) -> None:
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": ts, "dur": 1}]}))
    con = duckdb.connect()
    with pytest.raises(IngestError, match=r"rank0\.json: malformed trace events \(a time out of range"):
        kineto.parse(path, con)


def test_base_time_overflow_is_a_bad_file_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1e6, "dur": 1}],
                                "baseTimeNanoseconds": (1 << 63) - 10}))
    rep = ingest([path], tmp_path / "s.duckdb", run_id="r")
    assert [f.status for f in rep.files] == ["failed"]
    assert "a time out of range" in rep.files[0].error


GROUP_RANKS = ["[]", "[0]", "[00]", "[01]", "[1,2]", "[ 1, 2]", "[1, 2 ]", "[1,  2]", "[-1]", "[+1]", "[999999999]",
               "[2147483647]", "[2147483648]", "[9999999999]", "[1, null]", "[1, 2", "1, 2", "", "[1.5]", "[1e1]"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(
    st.lists(st.one_of(st.integers(0, 2**31), st.sampled_from([0, 999_999_999, 2**31 - 1, 2**31, 10**10])), max_size=6)
    .map(lambda r: "[" + ", ".join(map(str, r)) + "]"), st.sampled_from(GROUP_RANKS)), min_size=1, max_size=8))
def test_group_ranks_are_read_as_duckdb_casts_them(texts: list[str]) -> None:
    """'Process Group Ranks' as INTEGER[]: the plain spelling is read without a query; every value,
    plain or not, comes out as DuckDB's TRY_CAST gives it, alone or among others."""
    con = duckdb.connect()
    want = [con.execute("SELECT TRY_CAST(? AS INTEGER[])", [t]).fetchone()[0] for t in texts]
    assert kineto_rows.try_cast_values(con, texts, "INTEGER[]") == want
    for t, w in zip(texts, want):
        assert kineto_rows.try_cast_values(con, [t], "INTEGER[]") == [w]
