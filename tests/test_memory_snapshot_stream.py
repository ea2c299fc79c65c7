"""Streaming ingest of memory snapshots (tracekit.ingest.unpickle, tracekit.ingest.memory_snapshot).

Real formats: snapshots with the object layout torch's ``_snapshot()`` builds (tests/cuda_snapshot.py),
written by ``pickle.dump`` with protocol 4 (what ``_dump_snapshot`` does) and 5, and in the layout
of torch's C++ pickler (``_memory_snapshot_pickled``: protocol 2, a MARK for every container,
memo slots set after a container is complete, strings memoized by value); the trainer's
CPU-derived snapshots are in tests/test_memory_estimate_trainer.py. Each streamed result must equal
what ``pickle.load`` gives. Malicious and mangled pickles must fail naming the file, run nothing
and write nothing.

Every test runs on both pickle machines (the C one, ``tracekit.ingest.unpickle._pickle_machine``, when it is built,
and the Python one); tests/test_pickle_machines.py compares the two directly.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tracekit.cli import main as cli_main
from tracekit.ingest import memory_snapshot, unpickle
from tracekit.ingest.common import IngestError
from tracekit.ingest.memory_snapshot import looks_like_snapshot, parse, parse_snapshot
from tracekit.ingest.parse import parse_path
from tracekit.ingest.pipeline import ingest
from tracekit.ingest.sniff import sniff
from tracekit.ingest.unpickle import UnsafePickleError

sys.path.insert(0, str(Path(__file__).parent))
from cuda_snapshot import cuda_snapshot  # noqa: E402

ENTRIES = 6000
MACHINES = ["python", "native"]


@pytest.fixture(autouse=True, params=MACHINES)
def machine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once per pickle machine (unpickle.READER_ENV)."""
    if request.param == "native" and not unpickle.AVAILABLE:
        pytest.skip("tracekit.ingest.unpickle._pickle_machine is not built")
    monkeypatch.setenv(unpickle.READER_ENV, request.param)
    return request.param


@pytest.fixture(scope="module")
def snapshot():
    return cuda_snapshot(ENTRIES, depth=24, seed=3)


def jit_pickle(obj: object) -> bytes:
    """``obj`` as torch's C++ Pickler writes it (torch/csrc/jit/serialization/pickler.cpp):
    protocol 2; every list and dict filled between MARK and APPENDS/SETITEMS, even when empty;
    a container shared by several parents memoized (BINPUT) once complete, later ones BINGET;
    strings memoized by value."""
    out, memo, count = io.BytesIO(), {}, [0]
    uses: dict[int, int] = {}

    def count_uses(o: object) -> None:
        if isinstance(o, (list, dict, tuple)):
            uses[id(o)] = uses.get(id(o), 0) + 1
            if uses[id(o)] == 1:
                for x in (o.items() if isinstance(o, dict) else o):
                    if isinstance(o, dict):
                        count_uses(x[0])
                        count_uses(x[1])
                    else:
                        count_uses(x)

    def put(key: object) -> None:
        memo[key] = count[0]
        out.write(b"r" + struct.pack("<I", count[0]) if count[0] > 255 else b"q" + bytes([count[0]]))
        count[0] += 1

    def get(i: int) -> None:
        out.write(b"j" + struct.pack("<I", i) if i > 255 else b"h" + bytes([i]))

    def push(o: object) -> None:
        key = ("s", o) if isinstance(o, str) else ("p", id(o))
        if key in memo:
            return get(memo[key])
        if o is None:
            out.write(b"N")
        elif isinstance(o, bool):
            out.write(b"\x88" if o else b"\x89")
        elif isinstance(o, int):
            out.write(b"J" + struct.pack("<i", o) if -2**31 <= o < 2**31 else b"\x8a\x08" + o.to_bytes(8, "little", signed=True))
        elif isinstance(o, str):
            b = o.encode()
            out.write(b"X" + struct.pack("<I", len(b)) + b)
            put(key)
        elif isinstance(o, tuple):
            out.write(b"(")
            for x in o:
                push(x)
            out.write(b"t")
        elif isinstance(o, list):
            out.write(b"](")
            for x in o:
                push(x)
            out.write(b"e")
            if uses[id(o)] > 1:
                put(key)
        elif isinstance(o, dict):
            out.write(b"}(")
            for k, v in o.items():
                push(k)
                push(v)
            out.write(b"u")
            if uses[id(o)] > 1:
                put(key)
        else:
            raise TypeError(type(o))

    count_uses(obj)
    out.write(b"\x80\x02")
    push(obj)
    out.write(b".")
    return out.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# -- the reader against pickle.load --------------------------------------------------------------


PLAIN = {"a": [1, 2.5, None, True, False, -1, 2**70, -2**40, 300, 70000, "x" * 300], "u": "ünï",
         "t": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)], "d": {"nested": [{"k": -1}] * 3},
         "one": [[{"only": 1}]], "b": b"\x00\xff", "s": {1, 2}, "f": frozenset({3})}


@pytest.mark.parametrize("proto", range(6))
def test_reader_equals_pickle_load(tmp_path: Path, proto: int) -> None:
    data = dict(PLAIN)
    if proto < 4:  # sets, frozensets and bytes need a global (builtins.set, _codecs.encode) below 4
        for k in ("b", "s", "f"):
            del data[k]
    shared = [1, 2]
    data["shared"] = [shared, shared, {"x": shared}]
    path = write(tmp_path / "p.pkl", pickle.dumps(data, protocol=proto))
    got = unpickle.read(path, {})
    assert got == data
    assert got["shared"][0] is got["shared"][1] is got["shared"][2]["x"]
    seen = []
    got = unpickle.read(path, {("a", "*"): lambda lst, items: seen.extend(items),
                                    ("one", "*", "*"): lambda lst, items: seen.append(items)}, batch=2)
    assert got["a"] == [] and seen[:len(data["a"])] == data["a"] and seen[-1] == [{"only": 1}]
    assert got["one"] == [[]]


@pytest.mark.parametrize("writer", ["pickle4", "pickle5", "jit2"])
def test_snapshot_streams_to_the_same_tables_as_a_full_load(snapshot, tmp_path: Path, writer: str) -> None:
    snap, _ = snapshot
    data = jit_pickle(snap) if writer == "jit2" else pickle.dumps(snap, protocol=int(writer[-1]))
    path = write(tmp_path / "memory" / "rank0.pickle", data)
    assert pickle.loads(data) == snap and looks_like_snapshot(path)
    streamed, loaded = parse(path), parse_snapshot(path, pickle.loads(data))
    assert streamed.tables.keys() == loaded.tables.keys() == {"memory_events", "memory_segments", "memory_blocks"}
    for name, table in streamed.tables.items():
        assert table.to_pylist() == loaded.tables[name].to_pylist(), name
    events = streamed.tables["memory_events"].to_pylist()
    assert len(events) == len(snap["device_traces"][0])
    first = snap["device_traces"][0][2]
    assert (events[2]["action"], events[2]["addr"], events[2]["size"], events[2]["ts_ns"]) == \
        (first["action"], first["addr"], first["size"], first["time_us"] * 1000)
    # the top user frame: the innermost frame outside torch; C++ frames ('??', '', a .cpp file) skipped
    assert all(e["frame"].startswith("/home/me/project/") for e in events), events[0]


def test_watched_items_arrive_in_batches_and_lists_come_back_empty(snapshot, tmp_path: Path) -> None:
    snap, _ = snapshot
    path = write(tmp_path / "s.pickle", pickle.dumps(snap, protocol=4))
    calls = []
    top = unpickle.read(path, {("device_traces", "*", "*"): lambda lst, items: calls.append(len(items))},
                             batch=64)
    assert top["device_traces"] == [[]] and len(top["segments"]) == len(snap["segments"])
    assert sum(calls) == len(snap["device_traces"][0])
    assert max(calls) <= 1000  # the pickler's APPENDS batches: never the whole list at once
    jit = write(tmp_path / "j.pickle", jit_pickle(snap))  # one APPENDS for all: flushed by the reader
    calls.clear()
    unpickle.read(jit, {("device_traces", "*", "*"): lambda lst, items: calls.append(len(items))}, batch=64)
    assert sum(calls) == len(snap["device_traces"][0]) and max(calls) <= 65 and len(calls) > 10


def test_ingested_snapshot_peak_includes_the_blocks_allocated_before_the_trace(snapshot, tmp_path: Path) -> None:
    snap, truth = snapshot
    write(tmp_path / "run" / "memory" / "rank0.pickle", pickle.dumps(snap, protocol=4))
    report = ingest([tmp_path / "run"], tmp_path / "s.duckdb", run_id="cuda")
    assert [(f.status, f.format, f.rank) for f in report.files] == [("ok", "memory", 0)]
    res = CliRunner().invoke(cli_main, ["memory", str(tmp_path / "s.duckdb"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    peak = out["peaks"][0]
    assert peak["peak_allocated"] == truth["peak"] and peak["peak_seq"] == truth["peak_at"]
    assert peak["final_allocated"] == truth["live_at_end"]
    # the state from before the trace: 7 blocks live throughout (only in the end state), 1 freed
    # inside it; the end state minus the trace's net change says the same
    start = sum(b["size"] for s in snap["segments"] for b in s["blocks"]) - sum(
        e["size"] if e["action"] == "alloc" else -e["size"] for e in snap["device_traces"][0]
        if e["action"] in ("alloc", "free_completed"))
    assert peak["baseline_allocated"] == truth["baseline"] == start > truth["pre_live"]
    live = {x["category"]: x["bytes"] for x in out["live_by_category"]}
    assert live == {"unknown": truth["peak"]}  # CUDA snapshots carry no categories
    assert out["estimate_vs_measured"] is None and "no reference-trainer manifest" in out["estimate_missing_because"]


# -- bad input ------------------------------------------------------------------------------------


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))

    marker = ""


FORBIDDEN = {  # opcode -> a pickle that reaches it after a snapshot-like start
    "STACK_GLOBAL": b"\x8c\x02os\x8c\x06system\x93",
    "REDUCE": b"N)R", "BUILD": b"}}b", "INST": b"(ios\nsystem\n", "OBJ": b"(No", "NEWOBJ": b"N)\x81",
    "NEWOBJ_EX": b"N)}\x92", "PERSID": b"Pid\n", "BINPERSID": b"NQ", "EXT1": b"\x82\x01",
    "NEXT_BUFFER": b"\x97",
}


@pytest.mark.parametrize("stream_above", [0, 2 << 20], ids=["streamed", "loaded-whole"])
def test_malicious_snapshot_runs_nothing_and_names_the_file(tmp_path: Path, stream_above: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_snapshot, "STREAM_ABOVE", stream_above)  # ingest takes either path
    marker = tmp_path / "pwned"
    _Boom.marker = str(marker)
    evil = write(tmp_path / "run" / "memory" / "rank0.pickle",
                 pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}, _Boom()]]}, protocol=4))
    assert looks_like_snapshot(evil)  # it takes the streaming path
    with pytest.raises(UnsafePickleError, match=r"rank0.pickle: pickle uses STACK_GLOBAL|GLOBAL posix.system"):
        parse(evil)
    report = ingest([tmp_path / "run"], tmp_path / "s.duckdb")
    assert report.failed and str(evil) in report.failed[0].error and "only plain data" in report.failed[0].error
    assert not marker.exists()
    for proto in (0, 2):
        p = write(tmp_path / f"g{proto}.pickle", pickle.dumps({"segments": [_Boom()]}, protocol=proto))
        with pytest.raises(UnsafePickleError, match=r"GLOBAL (posix|os)\.system"):
            unpickle.read(p, {})
    assert not marker.exists()


@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_every_code_running_opcode_is_refused(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / "x.pickle", b"\x80\x04}\x94(\x8c\x08segments\x94]" + FORBIDDEN[name] + b"eu.")
    with pytest.raises(UnsafePickleError, match=f"x.pickle: pickle uses {name}"):
        unpickle.read(path, {})


def test_not_a_snapshot_and_malformed_entries(tmp_path: Path) -> None:
    p = write(tmp_path / "a.pickle", pickle.dumps({"segments": {}, "device_traces": []}, protocol=4))
    with pytest.raises(IngestError, match="a.pickle: not a memory snapshot"):
        parse(p)
    p = write(tmp_path / "b.pickle", pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": "x"}]]}))
    with pytest.raises(IngestError, match="b.pickle: trace entry 0 is malformed .*expected an integer, got str"):
        parse(p)
    p = write(tmp_path / "c.pickle", pickle.dumps({"segments": [], "device_traces": [[7]]}))
    with pytest.raises(IngestError, match="c.pickle: trace entry 0 is a int, not a dict"):
        parse(p)
    p = write(tmp_path / "d.pickle", b"")
    with pytest.raises(pickle.UnpicklingError, match="d.pickle: empty file"):
        unpickle.read(p, {})
    assert not looks_like_snapshot(write(tmp_path / "fr.pickle", pickle.dumps({"version": "2.10", "entries": []})))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(["truncate", "overwrite", "delete"]), pos=st.floats(0.0, 1.0),
       blob=st.binary(min_size=1, max_size=6))
@example(how="overwrite", pos=0.0, blob=b"PAR1")  # now sniffed as parquet: the op-table error must be a clear one
@pytest.mark.parametrize("stream_above", [0, 2 << 20], ids=["streamed", "loaded-whole"])
def test_mangled_snapshots_fail_clearly_and_write_nothing(tmp_path: Path, how: str, pos: float, blob: bytes,
                                                          stream_above: int, machine: str) -> None:
    if stream_above and machine == "native":
        pytest.skip("a file loaded whole goes through no pickle machine")
    saved, memory_snapshot.STREAM_ABOVE = memory_snapshot.STREAM_ABOVE, stream_above
    try:
        _mangled_snapshot_ingest(tmp_path, how, pos, blob)
    finally:
        memory_snapshot.STREAM_ABOVE = saved


def test_small_snapshots_are_loaded_whole_large_ones_streamed(snapshot, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tables either way (test above); the size decides which reader runs."""
    snap, _ = snapshot
    path = write(tmp_path / "memory" / "rank0.pickle", pickle.dumps(snap, protocol=4))
    streamed = []
    monkeypatch.setattr(memory_snapshot, "parse", lambda p: streamed.append(p) or parse(p))
    whole = parse_path(path, sniff(path))
    assert streamed == [] and path.stat().st_size <= memory_snapshot.STREAM_ABOVE
    monkeypatch.setattr(memory_snapshot, "STREAM_ABOVE", path.stat().st_size - 1)
    again = parse_path(path, sniff(path))
    assert streamed == [path]
    assert {k: t.to_pylist() for k, t in whole.tables.items()} == {k: t.to_pylist() for k, t in again.tables.items()}


def mangle(data: bytes, how: str, pos: float, blob: bytes) -> bytes:
    i = int(pos * len(data))
    return {"truncate": data[:i], "overwrite": data[:i] + blob + data[i + len(blob):],
            "delete": data[:i] + data[i + len(blob):], "insert": data[:i] + blob + data[i:]}[how]


def _mangled_snapshot_ingest(tmp_path: Path, how: str, pos: float, blob: bytes) -> None:
    snap, _ = cuda_snapshot(60, depth=6, seed=1)
    data = mangle(pickle.dumps(snap, protocol=4), how, pos, blob)
    f = write(tmp_path / "m" / "memory" / "rank0.pickle", data)
    store = tmp_path / "m.duckdb"
    store.unlink(missing_ok=True)
    (res,) = ingest([f], store, run_id="m").files
    import tracekit

    with tracekit.open(store) as s:
        n = s.sql("SELECT count(*) FROM memory_events").item()
    if res.status == "failed":
        assert str(f) in res.error and n == 0, res.error
        # named bad input, not a parser bug (ingest reports those as "unexpected X while parsing")
        assert "while parsing:" not in res.error, res.error
    else:  # a mangling that left valid plain data (inside a number, say) ingests whole
        assert res.status == "ok" and n > 0


def test_callback_errors_pass_through_unchanged(tmp_path: Path, snapshot) -> None:
    snap, _ = snapshot
    path = write(tmp_path / "s.pickle", pickle.dumps(snap, protocol=4))

    class Stop(Exception):
        pass

    def boom(lst: list, items: list) -> None:
        raise TypeError("mine") if len(items) == 1 else Stop("stop")

    with pytest.raises(Stop, match="^stop$"):
        unpickle.read(path, {("device_traces", "*", "*"): boom})
    p2 = write(tmp_path / "one.pickle", pickle.dumps({"a": [7]}, protocol=4))  # one item: APPEND
    with pytest.raises(TypeError, match="^mine$"):
        unpickle.read(p2, {("a", "*"): boom})
