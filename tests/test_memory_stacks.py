"""Whole allocation stacks in the store (memory_events.frames, memory_blocks.frames): read from a
real CUDA snapshot (an H100 FSDP2 run, tests/gpu_fixtures/native_fsdp2_h100), bounded in length,
and a store written before the column existed still opens (NULL stacks) and gains the column when
ingested into again. The oracle reads the pickle itself: a frame is Python when its file ends .py."""

from __future__ import annotations

import pickle
from pathlib import Path

import duckdb
import pytest

import tracekit
from tracekit.ingest import pipeline
from tracekit.schema import TABLES

SNAPSHOT = Path(__file__).parent / "gpu_fixtures" / "native_fsdp2_h100" / "memory" / "rank0.pickle"


def _python_stack(frames: list) -> list[str]:
    return [f"{f['filename']}:{f['line']}:{f['name']}" for f in frames if str(f["filename"]).endswith(".py")]


def test_a_real_cuda_snapshot_keeps_each_allocation_s_python_stack(tmp_path):
    with open(SNAPSHOT, "rb") as f:
        raw = pickle.load(f)  # our own committed fixture
    trace = raw["device_traces"][0]
    pipeline.ingest([SNAPSHOT], tmp_path / "s.duckdb")
    with tracekit.open(tmp_path / "s.duckdb") as s:
        rows = s.sql("SELECT seq, frame, frames FROM memory_events ORDER BY seq")
        blocks = s.sql("SELECT address, frames FROM memory_blocks WHERE state = 'active_allocated'")
    assert rows.height == len(trace)
    checked = 0
    for (seq, top, stack), entry in zip(rows.iter_rows(), trace):
        want = _python_stack(entry.get("frames") or [])
        if want:
            assert stack.split("\n") == want[:32], seq
            assert top in want or top.startswith("<autograd>:0:")  # a stack frame, or backward work's node
            checked += 1
        elif stack is not None:  # backward work: no Python frame, its autograd node
            assert stack.startswith("<autograd>:0:") and stack == top
    assert checked > 100
    # the first allocation of the FSDP2 run: all-gather outputs, called from the script's main
    first = next(s for s in rows["frames"] if s and "init_all_gather_outputs" in s).split("\n")
    assert first[0].endswith("_fsdp_param.py:477:init_all_gather_outputs")
    assert any(line.endswith("gpu_native_nccl.py:53:main") for line in first)
    by_addr = {b["address"]: b for seg in raw["segments"] for b in _blocks(seg)}
    for addr, stack in blocks.iter_rows():  # the blocks live at the snapshot keep theirs too
        want = _python_stack(by_addr[addr].get("frames") or [])
        if want:
            assert stack.split("\n") == want[:32]


def _blocks(seg: dict) -> list[dict]:
    out, addr = [], seg["address"]
    for b in seg["blocks"]:
        out.append({**b, "address": b.get("address", addr)})
        addr += b["size"]
    return out


def test_a_deep_stack_is_cut_to_32_frames(tmp_path):
    deep = [{"name": f"recurse{i}", "filename": "model.py", "line": i} for i in range(100)]
    long_name = [{"name": "x" * 5000, "filename": "gen.py", "line": 1}]
    snap = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 1, "frames": deep},
        {"action": "alloc", "addr": 2, "size": 512, "stream": 0, "time_us": 2, "frames": long_name}]]}
    path = tmp_path / "rank0.pickle"
    path.write_bytes(pickle.dumps(snap))
    pipeline.ingest([path], tmp_path / "s.duckdb")
    with tracekit.open(tmp_path / "s.duckdb") as s:
        stacks = s.sql("SELECT frames FROM memory_events ORDER BY seq")["frames"].to_list()
    lines = stacks[0].split("\n")
    assert lines[:32] == [f"model.py:{i}:recurse{i}" for i in range(32)]
    assert lines[32:] == ["... 68 more frames"]
    assert len(stacks[1]) == 240 and stacks[1].startswith("gen.py:1:xxx")


def test_a_store_from_before_the_stacks_opens_and_gains_the_column(tmp_path):
    old = tmp_path / "old.duckdb"
    con = duckdb.connect(str(old))
    for table, cols in TABLES.items():  # the schema as it was: no frames columns
        kept = [(n, t) for n, t in cols if n != "frames"]
        con.execute(f"CREATE TABLE {table} ({', '.join(f'{n} {t}' for n, t in kept)})")
    con.execute("INSERT INTO runs (run_id) VALUES ('before')")
    con.execute("INSERT INTO memory_events (run_id, rank, seq, action, size) VALUES ('before', 0, 0, 'alloc', 512)")
    con.close()
    with tracekit.open(old) as s:  # read-only: opens as it is
        assert "frames" not in s.sql("SELECT * FROM memory_events").columns
    pipeline.ingest([SNAPSHOT], old)  # writing into it adds the column; the old rows read NULL
    with tracekit.open(old) as s:
        got = dict(s.sql("SELECT run_id, count(frames) AS n FROM memory_events GROUP BY run_id").iter_rows())
    assert got["before"] == 0 and got[next(r for r in got if r != "before")] > 100


