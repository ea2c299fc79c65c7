"""The one classifier, and flight-recorder records that carry times (hand-built in torch's schema)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import duckdb
import pytest

import tracekit
from tracekit import classify
from tracekit.conventions import CommAnnotation
from tracekit.ingest.pipeline import ingest

NAMES = [
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "collective", "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "collective", "reduce_scatter"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "p2p", "sendrecv"),
    ("gloo:all_reduce", "collective", "all_reduce"),
    ("gloo:send", "p2p", "send"),
    ("c10d::allgather_", "collective", "all_gather"),
    ("c10d::_reduce_scatter_base_", "collective", "reduce_scatter"),
    ("nccl:recv 1<-0", "p2p", "recv"),
    (CommAnnotation("all_gather", "5", "cp", 3, (0, 2), 64, "bfloat16").span_name(), "collective", "all_gather"),
    (CommAnnotation("send", "9", "pp", 1, (0, 4), 64, "bfloat16", peer=4).span_name(), "p2p", "send"),
    ("aten::mm", "none", None),
    ("ampere_sgemm_128x64_nn", "none", None),
    ("ProfilerStep#3", "none", None),
]


@pytest.mark.parametrize("name,kind,op", NAMES)
def test_classify_python(name: str, kind: str, op: str | None) -> None:
    assert classify.classify(name) == kind
    assert classify.comm_op(name) == op
    assert classify.is_comm(name) == (kind != "none")


def test_classify_record_param_comms_by_arg() -> None:
    assert classify.classify("record_param_comms", "allreduce") == "collective"
    assert classify.classify("record_param_comms", "send") == "p2p"


def test_sql_rendering_agrees_with_python() -> None:
    con = duckdb.connect()
    con.execute("CREATE TABLE n (name VARCHAR)")
    con.executemany("INSERT INTO n VALUES (?)", [[n] for n, _, _ in NAMES])
    rows = con.execute(f"SELECT name, {classify.sql_is_comm('name')}, "
                       f"coalesce({classify.sql_kernel_op('name')}, {classify.sql_span_op('name')}) FROM n").fetchall()
    for name, is_comm, op in rows:
        assert is_comm == classify.is_comm(name), name
        if not name.startswith("tk.comm"):  # tk spans are parsed by conventions, not in SQL
            assert op == classify.comm_op(name), name


def _entry(rid: int, pname: str, seq: int, p2p_seq: int, start: int | None, end: int | None,
           is_p2p: bool = False, pg: tuple = ("7", "tp")) -> dict:
    return {"record_id": rid, "pg_id": 7, "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": p2p_seq,
            "op_id": rid + 1, "profiling_name": pname, "input_sizes": [[4, 8]], "input_dtypes": ["BFloat16"],
            "output_sizes": [[4, 8]], "output_dtypes": ["BFloat16"], "time_created_ns": 1000 + rid,
            "time_discovered_started_ns": start, "time_discovered_completed_ns": end,
            "duration_ms": None if end is None else (end - start) / 1e6, "state": "completed" if end else "started",
            "retired": end is not None, "timeout_ms": 600000, "is_p2p": is_p2p,
            "frames": [{"name": "step", "filename": "train.py", "line": 12}], "thread_id": "1",
            "thread_name": "pt_main"}


def test_timed_flight_recorder_records(tmp_path: Path) -> None:
    dump = {"version": "2.10", "comm_lib_version": "2.21.5",
            "pg_config": {"7": {"name": "7", "desc": "tp", "ranks": "[4, 5]"}},
            "pg_status": {}, "entries": [
                _entry(0, "nccl:all_reduce", 1, 0, 5000, 9000),
                _entry(1, "nccl:send 0->1", 1, 1, 10000, 12000, is_p2p=True),
                _entry(2, "nccl:all_gather", 2, 1, 13000, None),  # hung: started, never completed
            ]}
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "rank4").write_bytes(pickle.dumps(dump))
    (tmp_path / "fr" / "rank5.json").write_text(json.dumps({**dump, "entries": dump["entries"][:1]}))
    rep = ingest([tmp_path / "fr"], tmp_path / "s.duckdb", run_id="hand")
    assert [(f.rank, f.format) for f in rep.ok] == [(4, "fr"), (5, "fr")]
    with tracekit.open(tmp_path / "s.duckdb") as s:
        c = s.sql("SELECT rank, pg_name, seq, op, start_ns, end_ns, nbytes, dtype, source FROM collectives "
                  "ORDER BY rank").rows()
        assert c == [(4, "7", 1, "all_reduce", 5000, 9000, 64, "BFloat16", "fr"),
                     (5, "7", 1, "all_reduce", 5000, 9000, 64, "BFloat16", "fr")]
        p = s.sql("SELECT rank, peer, direction, seq, end_ns - start_ns FROM p2p").rows()
        assert p == [(4, 5, "send", 1, 2000)]  # group-local 1 -> global rank 5
        hung = s.sql("SELECT state, time_started_ns, time_completed_ns FROM fr_entries "
                     "WHERE rank = 4 AND record_id = 2").row(0)
        assert hung == ("started", 13000, None)
        # world inferred as 6 (highest rank + 1); the pg desc "tp" hint names the dimension
        assert s.sql("SELECT dim, ranks FROM groups").row(0) == ("tp", [4, 5])
