"""Trace entries into memory_events columns (tracekit.ingest.memory_snapshot._Events): a batch at a
time, column by column, where every entry is a dict with integer numbers; entry by entry otherwise.
Both must give the same table, and a bad entry must be named by its index whatever the batch."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from tracekit.ingest.common import IngestError
from tracekit.ingest.memory_snapshot import _Events, parse_snapshot

sys.path.insert(0, str(Path(__file__).parent))
from cuda_snapshot import cuda_snapshot  # noqa: E402

PATH = Path("snap.pickle")


@pytest.fixture(scope="module")
def snapshot():
    snap, _ = cuda_snapshot(3000, depth=12, seed=5)
    return snap


def _entry_by_entry(snap: dict):
    events = _Events(PATH)
    for device in snap["device_traces"]:
        events._add_each(device)
    return events.table()


def _batches(snap: dict, size: int):
    events = _Events(PATH)
    for device in snap["device_traces"]:
        for i in range(0, len(device), size):
            events.add(device, device[i:i + size])
    return events.table()


def test_batches_give_the_entry_by_entry_table(snapshot) -> None:
    snap = copy.deepcopy(snapshot)
    entries = snap["device_traces"][0]
    entries[1500]["addr"] = None  # these batches go entry by entry: a null, a float, a missing key
    entries[2500]["size"] = 2.0
    del entries[10]["stream"]
    expected = _entry_by_entry(snap)
    for size in (1, 7, 1024, 100_000):
        got = _batches(snap, size)
        assert got.equals(expected), size
    assert got.num_rows == len(entries)
    assert got.column("addr")[1500].as_py() is None
    assert got.column("size")[2500].as_py() == 2
    assert got.column("stream")[10].as_py() is None
    assert got.column("frame").null_count < got.num_rows  # the stacks do name user frames
    # and parse_snapshot (one batch per device) agrees
    assert parse_snapshot(PATH, snap).tables["memory_events"].equals(expected)


@pytest.mark.parametrize("bad", [5, ["alloc"], b"alloc"])
def test_a_bad_string_is_named_by_its_entry(snapshot, bad) -> None:
    snap = copy.deepcopy(snapshot)
    snap["device_traces"][0][1234]["action"] = bad
    with pytest.raises(IngestError, match=r"snap.pickle: trace entry 1234 is malformed \((expected a string|unhashable)"):
        _batches(snap, 1024)


def test_an_entry_that_is_not_a_dict_is_named(snapshot) -> None:
    snap = copy.deepcopy(snapshot)
    snap["device_traces"][0][2047] = 7
    with pytest.raises(IngestError, match="snap.pickle: trace entry 2047 is a int, not a dict"):
        _batches(snap, 1024)


def test_stacks_alike_at_both_ends_keep_their_own_top_frame() -> None:
    """The cache looks stacks up by length and first and last frame, then compares them whole."""
    def frame(file: str, line: int, name: str) -> dict:
        return {"filename": file, "line": line, "name": name}

    inner = frame("/site-packages/torch/cuda/memory.py", 10, "malloc")
    outer = frame("/usr/lib/python3.11/threading.py", 1, "run")
    a, b = frame("train.py", 5, "forward"), frame("model.py", 9, "attention")
    stacks = [[inner, a, outer], [inner, b, outer], [inner, a, outer], [inner, dict(b), outer]]
    entries = [{"action": "alloc", "addr": i, "size": 1, "stream": 0, "time_us": i, "frames": s}
               for i, s in enumerate(stacks)]
    table = parse_snapshot(PATH, {"segments": [], "device_traces": [entries]}).tables["memory_events"]
    assert table.column("frame").to_pylist() == ["train.py:5:forward", "model.py:9:attention",
                                                 "train.py:5:forward", "model.py:9:attention"]


def test_many_stacks_alike_at_both_ends() -> None:
    """More stacks under one (length, first, last) key than the cache compares one by one."""
    def frame(file: str, line: int) -> dict:
        return {"filename": file, "line": line, "name": "f"}

    inner, outer = frame("/site-packages/torch/cuda/memory.py", 1), frame("/usr/lib/python3.11/threading.py", 1)
    users = [frame(f"layer{i}.py", i) for i in range(30)]
    entries = [{"action": "alloc", "addr": n, "size": 1, "stream": 0, "time_us": n,
                "frames": [inner, users[n % 30], outer]} for n in range(90)]
    table = parse_snapshot(PATH, {"segments": [], "device_traces": [entries]}).tables["memory_events"]
    assert table.column("frame").to_pylist() == [f"layer{n % 30}.py:{n % 30}:f" for n in range(90)]
