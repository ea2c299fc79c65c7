"""kineto_comm (numpy) against its oracle (tests/kineto_comm_sql.py: SQL over the trace file, written
from the format, sharing no code with tracekit), on
hypothesis-generated traces: NCCL kernels with metadata on themselves, on the record_param_comms
that launched them or nowhere (several launchers per External id among them); p2p peers from
Dst/Src Rank, the group-local Rank, a global start and stride, or a two-rank group; args that are
not plain integers (" 12 ", "1e1", "abc"), sizes and ranks that overflow, unreadable group ranks;
tk.comm spans, or gloo:* spans without them. Every event has its own start time, so that the
order of ops within a group is the same for both (SQL leaves ties in any order)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracekit.conventions import CommAnnotation
from tracekit.ingest import kineto_comm, kineto_rows
from tracekit.ingest.common import IngestError, RankDependent, arrow_schema
from tracekit.ingest.kineto import read_events

sys.path.insert(0, str(Path(__file__).parent))
import kineto_comm_sql as oracle  # noqa: E402

BASE = 1_716_000_000_000_000_000
KERNELS = ["ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ncclDevKernel_SendRecv", "ncclKernel_Broadcast_RING_LL",
           "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"]
ARG_VALUES = {
    "Collective name": ["allreduce", "send", "recv", "sendrecv", "_allgather_base", "Broadcast", " ", "weird_op"],
    "Process Group Name": ["0", "1", "tp", "stream 20"],
    "Process Group Description": ["tp", "dp"],
    "Process Group Ranks": ["[0, 1]", "[0, 2]", "[0, 2, 4, 6]", "[3]", "[]", "[0, 1"],
    "In msg nelems": [256, 0, -1, " 12 ", "1e1", "abc", 2**62, 2**40],
    "Out msg nelems": [256, 1024, "7"],
    "dtype": ["Float", "BFloat16", "float8_e4m3fn", "Unknown"],
    "Seq": [0, 1, 5, "abc", " 3"],
    "seq_num": [2, 9],
    "Dst Rank": [0, 1, 2, 2**40, -1, "x"],
    "Src Rank": [0, 2, 3],
    "Rank": [0, 1, 2, 3, -1, 5],
    "Global rank start": [0, 4, 2**62],
    "Global rank stride": [1, 2, 0, -1, 2**62],
}
args = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in ARG_VALUES.items()})
ops = st.lists(st.fixed_dictionaries({
    "ext": st.one_of(st.none(), st.integers(1, 6)),
    "launcher": st.one_of(st.none(), args),  # a record_param_comms op, with these args
    "kernel": st.one_of(st.none(), st.tuples(st.sampled_from(KERNELS), st.sampled_from([20, 21, "stream 7", None]), args)),
}), min_size=1, max_size=14)
annotations = st.lists(st.builds(
    CommAnnotation, op=st.sampled_from(["all_reduce", "send", "recv", "broadcast"]), pg=st.sampled_from(["0", "tp"]),
    dim=st.sampled_from(["tp", "dp"]), seq=st.integers(0, 5), ranks=st.sampled_from([(0, 1), (0, 2, 4, 6)]),
    nbytes=st.integers(0, 4096), dtype=st.just("float32"), peer=st.one_of(st.none(), st.integers(0, 3))), max_size=5)
gloo = st.lists(st.tuples(st.sampled_from(["gloo:all_reduce", "gloo:send", "gloo:recv", "gloo:sendrecv", "gloo:barrier"]),
                          st.sampled_from(["user_annotation", "cpu_op"])), max_size=6)


def _trace(draw_ops: list[dict], anns: list[CommAnnotation], gloo_spans: list[tuple[str, str]], steps: int,
           times: list[int]) -> list[dict]:
    t = iter(times)
    ev = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "ts": 1000 * (s + 1), "dur": 999}
          for s in range(steps)]
    for op in draw_ops:
        ext = {} if op["ext"] is None else {"External id": op["ext"]}
        if op["launcher"] is not None:
            ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": next(t), "dur": 3,
                       "args": {**op["launcher"], **ext}})
        if op["kernel"] is not None:
            name, stream, kargs = op["kernel"]
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": next(t), "dur": 40,
                       **({} if stream is None else {"tid": stream}), "args": {**kargs, **ext}})
    for a in anns:
        ev.append({"ph": "X", "cat": "user_annotation", "name": a.span_name(), "ts": next(t), "dur": 7})
    for name, cat in gloo_spans:
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": next(t), "dur": 5})
    return ev


def _built(path: Path, con: duckdb.DuckDBPyConnection) -> kineto_rows.Built:
    rows = kineto_rows.EventRows(con, str(path))
    read_events(con, path, None, rows.add)
    return rows.build()


def _by_oracle(path: Path, con: duckdb.DuckDBPyConnection, rank: int) -> dict[str, list]:
    """The oracle's tables, from the trace file itself, inserted into tables of the store's types."""
    con.execute("CREATE SCHEMA s")
    first, anns = oracle.comm_args(con, "s", path)
    ann = oracle.register_annotations(con, "s", anns)
    out = {}
    for name, q in oracle.tables(con, "s", BASE, first, ann).items():
        sch = arrow_schema(name)
        con.execute(f"CREATE TABLE s.typed_{name} ({', '.join(f'{f.name} {_sql_type(f.type)}' for f in sch)})")
        con.execute(f"INSERT INTO s.typed_{name} SELECT * FROM ({q.sql})", {"rank": rank} if "$rank" in q.sql else {})
        out[name] = con.execute(f"SELECT * FROM s.typed_{name} ORDER BY ALL").fetchall()
    out["groups"] = sorted(_group_key(g) for g in oracle.groups(con, "s", {}, Path("x")))
    return out


def _by_numpy(built: kineto_rows.Built, con: duckdb.DuckDBPyConnection, path: Path, rank: int) -> dict[str, list]:
    ev = kineto_comm.CommEvents(built.comm, con, path)
    first = built.steps[0].start_ns if built.steps else None
    out = {}
    for name, t in kineto_comm.tables(ev, BASE, first, built.comm_annotations).items():
        t = t.build(rank) if isinstance(t, RankDependent) else t
        assert t.schema == arrow_schema(name), name
        con.register("got", t)
        out[name] = con.execute("SELECT * FROM got ORDER BY ALL").fetchall()
        con.unregister("got")
    out["groups"] = sorted(_group_key(g) for g in kineto_comm.groups(ev, built.comm_annotations, {}, path))
    return out


def _sql_type(t: pa.DataType) -> str:
    return {pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.string(): "VARCHAR"}[t]


def _group_key(g: dict) -> tuple:
    return (g["pg_name"] or "", g["pg_desc"] or "", tuple(g["ranks"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(draw_ops=ops, anns=annotations, gloo_spans=gloo, steps=st.integers(0, 2), rank=st.integers(0, 3),
       data=st.data())
def test_comm_tables_match_the_sql_oracle(draw_ops: list[dict], anns: list[CommAnnotation],
                                          gloo_spans: list[tuple[str, str]], steps: int, rank: int,
                                          data: st.DataObject, tmp_path: Path) -> None:
    n = 2 * len(draw_ops) + len(anns) + len(gloo_spans)
    times = data.draw(st.permutations(range(0, 3000, 3000 // max(n, 1))[:n]))
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": _trace(draw_ops, anns, gloo_spans, steps, times)}))
    # One connection each, closed with the example: hypothesis runs hundreds of examples (and many
    # more while shrinking) in one process, and an open connection keeps its tables in memory.
    with duckdb.connect() as con_oracle, duckdb.connect() as con:
        try:
            want = _by_oracle(path, con_oracle, rank)
        except (duckdb.Error, TypeError, ValueError):  # overflow, a bad cast, unreadable ranks
            with pytest.raises((IngestError, TypeError, ValueError)):
                _by_numpy(_built(path, con), con, path, rank)
            return
        assert _by_numpy(_built(path, con), con, path, rank) == want


def test_overflowing_sizes_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rank3.json"
    kernel = {"ph": "X", "cat": "kernel", "name": KERNELS[0], "ts": 10, "dur": 4,
              "args": {"Collective name": "allreduce", "In msg nelems": 2**62, "dtype": "Float"}}
    path.write_text(json.dumps({"traceEvents": [kernel]}))
    with duckdb.connect() as con:
        ev = kineto_comm.CommEvents(_built(path, con).comm, con, path)
        with pytest.raises(IngestError, match=r"rank3\.json: malformed trace events \(a message size out of"):
            kineto_comm.tables(ev, 0, None, [])


def test_a_peer_beyond_integer_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rank3.json"
    kernel = {"ph": "X", "cat": "kernel", "name": KERNELS[1], "ts": 10, "dur": 4,
              "args": {"Collective name": "send", "Dst Rank": 2**40}}
    path.write_text(json.dumps({"traceEvents": [kernel]}))
    with duckdb.connect() as con:
        ev = kineto_comm.CommEvents(_built(path, con).comm, con, path)
        with pytest.raises(IngestError, match=r"rank3\.json: malformed trace events"):
            kineto_comm.tables(ev, 0, None, [])


@pytest.mark.parametrize("rank_arg, peer", [(0, 4), (1, 6), (3, 10)])
def test_p2p_peer_from_global_start_and_stride(tmp_path: Path, rank_arg: int, peer: int) -> None:
    """Hand-computed: with no Dst/Src Rank and no group ranks to index, the peer is
    ``Global rank start + Rank * Global rank stride`` (4 + Rank * 2), Rank 0 included."""
    path = tmp_path / "rank0.json"
    kernel = {"ph": "X", "cat": "kernel", "name": KERNELS[1], "ts": 10, "dur": 4, "tid": 20,
              "args": {"Collective name": "send", "Rank": rank_arg, "Global rank start": 4, "Global rank stride": 2,
                       "In msg nelems": 8, "dtype": "Float", "Process Group Name": "1"}}
    path.write_text(json.dumps({"traceEvents": [kernel]}))
    with duckdb.connect() as con:
        got = _by_numpy(_built(path, con), con, path, 0)
    assert [(r[0], r[1], r[6]) for r in got["p2p"]] == [(peer, "send", 32)]


@pytest.mark.parametrize("rank, peer", [(0, 2), (2, 0)])
def test_p2p_peer_in_a_two_rank_group_is_the_other_member(tmp_path: Path, rank: int, peer: int) -> None:
    """Hand-computed: no Dst/Src Rank, no Rank arg, group ranks "[0, 2]": the file's rank is one
    member, its peer the other."""
    path = tmp_path / f"rank{rank}.json"
    kernel = {"ph": "X", "cat": "kernel", "name": KERNELS[1], "ts": 10, "dur": 4, "tid": 20,
              "args": {"Collective name": "recv", "Process Group Ranks": "[0, 2]", "Process Group Name": "3",
                       "In msg nelems": 4, "dtype": "BFloat16"}}
    path.write_text(json.dumps({"traceEvents": [kernel]}))
    with duckdb.connect() as con:
        got = _by_numpy(_built(path, con), con, path, rank)
    assert [(r[0], r[1], r[2], r[6]) for r in got["p2p"]] == [(peer, "recv", "3", 8)]
