"""Allocation sites of the reference trainer's CPU memory snapshots: every ``[memory]`` event of a
profiler trace gets the spans open around it on its thread as frames (reference_trainer.alloc_sites),
the snapshot built from the trace carries them (and the trainer's name for each state buffer), and
tracekit reads them back as a site ('<profiler op>:0:aten::linear in fwd vstage=0') and a stack.

The traces here are hand-built Chrome traces in Kineto's shape; the expected frames and sites are
written out by hand from the spans' times."""

from __future__ import annotations

import json
import pickle

import duckdb
import pytest
from click.testing import CliRunner

from reference_trainer.alloc_sites import memory_frames
from reference_trainer.profiling import StateBuffer, snapshot_from_trace
from tracekit.cli import main
from tracekit.ingest import pipeline
from tracekit.ingest.memory_frames import top_user_frame

MAIN, COMM = 11, 22  # thread ids


def _span(cat: str, name: str, ts: float, dur: float, tid: int = MAIN) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def _mem(ts: float, addr: int, nbytes: int, tid: int = MAIN, idx: int = 0) -> dict:
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 1, "tid": tid, "ts": ts,
            "args": {"Addr": addr, "Bytes": nbytes, "Total Allocated": 0, "Total Reserved": 0,
                     "Device Id": -1, "Device Type": 0, "Ev Idx": idx}}


def _names(frames: list[dict]) -> list[str]:
    return [f"{f['filename']}|{f['name']}" for f in frames]


STEP = _span("user_annotation", "ProfilerStep#1", 0, 1000)
FWD = _span("user_annotation", "tk.compute phase=fwd vstage=0 mb=1", 100, 300)
MODULE = _span("user_annotation", "tk.module layers.0.attention", 105, 95)
LINEAR = _span("cpu_op", "aten::linear", 110, 50)
MM = _span("cpu_op", "aten::mm", 115, 40)
EMPTY = _span("cpu_op", "aten::empty", 120, 5)
BWD = _span("user_annotation", "tk.compute phase=bwd vstage=0 mb=1", 500, 200)
EVAL = _span("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 510, 40)
COMM_SPAN = _span("user_annotation", "tk.comm op=all_gather pg=5 dim=cp seq=17 ranks=0,2 bytes=64 dtype=float32",
                  300, 50, tid=COMM)
GATHER = _span("cpu_op", "c10d::_allgather_base_", 305, 30, tid=COMM)
# an async send's annotation: open from before the backward span until inside it (overlaps, does
# not nest), so it is no caller of what the backward span allocates
SEND = _span("user_annotation", "gloo:send", 450, 100)
# an async send's work annotation around a whole forward span: as long as its work, not a caller
LONG_SEND = _span("user_annotation", "gloo:send", 90, 320)
SPANS = [STEP, FWD, MODULE, LINEAR, MM, EMPTY, BWD, EVAL, COMM_SPAN, GATHER, SEND, LONG_SEND]


def test_each_event_gets_the_spans_around_it_on_its_own_thread_innermost_first():
    mem = [
        _mem(122, 0xA0, 4096),           # aten::empty in aten::mm in aten::linear in fwd in step
        _mem(150, 0xA8, 256),            # after aten::empty closed: aten::mm is innermost
        _mem(310, 0xB0, 512, tid=COMM),  # the comm thread: its own spans only (none of MAIN's)
        _mem(520, 0xC0, 1024),           # backward; gloo:send overlaps without nesting: left out
        _mem(2000, 0xD0, 8),             # after every span: no frames
        _mem(120, 0xE0, 16),             # exactly when aten::empty opens: inside it
        _mem(10, 0xF0, 32, tid=99),      # a thread without spans
        _mem(560, 0xC8, 64),             # gloo:send closed: inside bwd only
    ]
    frames = memory_frames(SPANS + mem, mem)
    fwd_stack = ["<profiler op>|aten::empty", "<profiler op>|aten::mm", "<profiler op>|aten::linear",
                 "<annotation>|tk.module layers.0.attention", "<annotation>|tk.compute phase=fwd vstage=0 mb=1",
                 "<annotation>|ProfilerStep#1"]
    assert _names(frames[0]) == fwd_stack
    assert _names(frames[1]) == fwd_stack[1:]
    assert _names(frames[2]) == ["<profiler op>|c10d::_allgather_base_", "<annotation>|" + COMM_SPAN["name"]]
    assert _names(frames[3]) == ["<profiler op>|autograd::engine::evaluate_function: MmBackward0",
                                 "<annotation>|tk.compute phase=bwd vstage=0 mb=1", "<annotation>|ProfilerStep#1"]
    assert frames[4] == [] and frames[6] == []
    assert _names(frames[5]) == fwd_stack
    assert _names(frames[7]) == ["<annotation>|tk.compute phase=bwd vstage=0 mb=1", "<annotation>|ProfilerStep#1"]
    assert all(f["line"] == 0 for fs in frames for f in fs)
    assert frames[0][1] is frames[1][0]  # one dict per span name: the pickle memoizes it


def test_python_function_spans_become_source_frames():
    py = _span("python_function", "reference_trainer/model.py(157): _layer", 105, 100)
    mem = [_mem(122, 0xA0, 4096)]
    frames = memory_frames([FWD, py, LINEAR, EMPTY, mem[0]], mem)
    assert frames[0][2] == {"filename": "reference_trainer/model.py", "line": 157, "name": "_layer"}


def _trace() -> dict:
    mem = [
        _mem(122, 0xA0, 4096, idx=1),      # activation: allocated in fwd, alive after it
        _mem(150, 0xA8, 256, idx=2),       # temporary: freed inside fwd
        _mem(160, 0xA8, -256, idx=3),
        _mem(520, 0xA0, -4096, idx=4),     # the activation is freed in backward
        _mem(530, 0x100, 2048, idx=5),     # the reduced shard's address is reused: its unseen free
        _mem(540, 0x200, -128, idx=6),     # a state buffer from before the trace, freed in backward
    ]
    return {"traceEvents": SPANS + mem, "baseTimeNanoseconds": 1_000_000_000}


def test_the_snapshot_carries_the_frames_and_names_each_state_buffer():
    before = {0x100: StateBuffer(2048, "gradient", "vstage 0 reduced"), 0x200: StateBuffer(128, "gradient", None),
              0x300: StateBuffer(64, "parameter", "layers.0.wq.weight")}
    after = {0x300: before[0x300], 0x100: StateBuffer(2048, "gradient", "vstage 0 reduced")}
    snap = snapshot_from_trace(_trace(), after, before)
    entries = snap["device_traces"][0]
    allocs = {e["addr"]: e for e in entries if e["action"] == "alloc"}
    assert _names(allocs[0xA0]["frames"])[:3] == ["<profiler op>|aten::empty", "<profiler op>|aten::mm",
                                                  "<profiler op>|aten::linear"]
    assert allocs[0xA0]["category"] == "activation" and allocs[0xA8]["category"] == "temporary"
    frees = [e for e in entries if e["action"] == "free_completed"]
    # the activation's free: the spans at the free (as a CUDA snapshot's free has the free's stack)
    assert _names(next(e for e in frees if e["addr"] == 0xA0)["frames"])[0] == \
        "<profiler op>|autograd::engine::evaluate_function: MmBackward0"
    # state buffers from before the trace have no allocation entry: their frees say what they were
    assert _names(next(e for e in frees if e["addr"] == 0x100)["frames"]) == ["<trainer state>|gradient vstage 0 reduced"]
    assert _names(next(e for e in frees if e["addr"] == 0x200)["frames"]) == ["<trainer state>|gradient"]
    blocks = {b["address"]: b for s in snap["segments"] for b in s["blocks"]}
    assert _names(blocks[0x300]["frames"]) == ["<trainer state>|parameter layers.0.wq.weight"]
    assert blocks[0x100]["frames"] is allocs[0x100]["frames"]  # live: its allocation's frames
    assert _names(blocks[0x100]["frames"])[0] == "<profiler op>|autograd::engine::evaluate_function: MmBackward0"


@pytest.fixture()
def store(tmp_path):
    before = {0x300: StateBuffer(64, "parameter", "layers.0.wq.weight"), 0x200: StateBuffer(128, "gradient")}
    snap = snapshot_from_trace(_trace(), {0x300: before[0x300]}, before)
    run = tmp_path / "run"
    (run / "memory").mkdir(parents=True)
    with open(run / "memory" / "rank0.pickle", "wb") as f:
        pickle.dump(snap, f)
    pipeline.ingest([run / "memory" / "rank0.pickle"], tmp_path / "s.duckdb")
    return tmp_path / "s.duckdb"


def test_tracekit_reads_a_site_and_a_stack_for_every_allocation(store):
    con = duckdb.connect(str(store), read_only=True)
    rows = dict(con.execute("SELECT addr, frame FROM memory_events WHERE action = 'alloc'").fetchall())
    stack = con.execute("SELECT frames FROM memory_events WHERE action = 'alloc' AND addr = ?", [0xA0]).fetchone()[0]
    blocks = dict(con.execute("SELECT address, frame FROM memory_blocks").fetchall())
    con.close()
    # the op the trainer's code called (aten::linear, not the aten::empty inside it), and where
    assert rows[0xA0] == "<profiler op>:0:aten::linear in layers.0.attention"
    assert rows[0x100] == "<profiler op>:0:MmBackward0 in bwd vstage=0"
    assert stack.split("\n") == ["<profiler op>:0:aten::empty", "<profiler op>:0:aten::mm",
                                 "<profiler op>:0:aten::linear", "<annotation>:0:tk.module layers.0.attention",
                                 "<annotation>:0:tk.compute phase=fwd vstage=0 mb=1", "<annotation>:0:ProfilerStep#1"]
    assert blocks[0x300] == "<trainer state>:0:parameter layers.0.wq.weight"


def test_memory_by_frame_names_what_is_live_at_the_peak(store):
    out = CliRunner().invoke(main, ["memory", str(store), "--by", "frame", "--json", "--no-estimate"])
    assert out.exit_code == 0, out.output
    sites = {r["frame"]: r["bytes"] for r in json.loads(out.output)["live_by_frame"]}
    # the peak is aten::mm's 256 B buffer inside aten::linear, beside the 4096 B one of aten::empty
    assert sites == {"<profiler op>:0:aten::linear in layers.0.attention": 4096 + 256,
                     "<trainer state>:0:gradient": 128, "<trainer state>:0:parameter layers.0.wq.weight": 64}


def test_sites_of_a_collective_of_an_annotation_alone_and_of_no_span():
    mem = [_mem(310, 0xB0, 512, tid=COMM), _mem(560, 0xC8, 64), _mem(2000, 0xD0, 8), _mem(250, 0xE8, 32)]
    frames = [e["frames"] for e in snapshot_from_trace({"traceEvents": SPANS + mem}, {})["device_traces"][0]]
    assert top_user_frame(frames[0]) == "<annotation>:0:fwd vstage=0"  # in fwd, outside the module span
    assert top_user_frame(frames[1]) == "<profiler op>:0:c10d::_allgather_base_ in all_gather cp"
    assert top_user_frame(frames[2]) == "<annotation>:0:bwd vstage=0"  # no op: not labelled as one
    assert top_user_frame(frames[3]) is None
