"""Hostile and damaged inputs, generated small on disk (tests/test_hostile_input.py).

The bombs are gzip files of concatenated members: a large, regular block is compressed once and
its member written many times, so a gigabyte of trace text takes about a megabyte on disk and a
fraction of a second to write. Each writer returns the file it wrote.
"""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from pathlib import Path

MB = 1 << 20


def _event(i: int = 0) -> bytes:
    return json.dumps({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                       "ts": 1000 + i, "dur": 1}).encode()


def write_gz(path: Path, parts: list[tuple[bytes, int]]) -> Path:
    """``parts``: (text, times); each text is one gzip member, written ``times`` times."""
    with open(path, "wb") as f:
        for text, times in parts:
            member = gzip.compress(text, compresslevel=9, mtime=0)
            for _ in range(times):
                f.write(member)
    return path


def _info(rank: int = 0, world: int = 2, **extra: object) -> bytes:
    return json.dumps({"backend": "nccl", "rank": rank, "world_size": world, **extra}).encode()


def header_string(path: Path, mb: int = 100) -> Path:
    """A string of ``mb`` MiB inside distributedInfo, before traceEvents (the header)."""
    return write_gz(path, [(b'{"schemaVersion": 1, "distributedInfo": {"rank": 0, "pad": "', 1), (b"a" * 4 * MB, mb // 4),
                           (b'"}, "traceEvents": [' + _event() + b"]}", 1)])


def event_string(path: Path, mb: int = 1024) -> Path:
    """One event holding a string of ``mb`` MiB."""
    return write_gz(path, [(b'{"traceEvents": [' + _event() + b', {"ph": "X", "name": "', 1),
                           (b"a" * 16 * MB, mb // 16), (b'", "ts": 1, "dur": 1}]}', 1)])


def whitespace_before(path: Path, mb: int = 1024) -> Path:
    """``mb`` MiB of whitespace between Kineto's preamble and traceEvents."""
    return write_gz(path, [(b'{"schemaVersion": 1, "distributedInfo": ' + _info() + b",", 1), (b" " * 16 * MB, mb // 16),
                           (b'"traceEvents": [' + _event() + b"]}", 1)])


def whitespace_inside(path: Path, mb: int = 1024) -> Path:
    """``mb`` MiB of whitespace between two events of traceEvents."""
    return write_gz(path, [(b'{"traceEvents": [' + _event() + b",", 1), (b" " * 16 * MB, mb // 16),
                           (_event(1) + b"]}", 1)])


def many_events(path: Path, millions: int = 10) -> Path:
    """``millions`` million tiny complete events."""
    block = b",".join([_event()] * 100_000)  # alike, so that the file stays small
    return write_gz(path, [(b'{"traceEvents": [' + block, 1), (b"," + block, millions * 10 - 1), (b"]}", 1)])


def trace(path: Path, info: bytes, events: int = 3) -> Path:
    """A small well-formed trace with ``info`` as its distributedInfo."""
    body = b",".join(_event(i) for i in range(events))
    path.write_bytes(b'{"schemaVersion": 1, "distributedInfo": ' + info + b', "traceEvents": [' + body + b"]}")
    return path


def world_of(path: Path, world: int = 1_000_000) -> Path:
    """A trace claiming ``world`` ranks, its pg_config listing every one of them (7.9 MB at 10^6)."""
    ranks = json.dumps(list(range(world)))
    pg = {"0": {"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": world,
                "ranks": ranks}}
    return trace(path, _info(0, world, pg_config=pg))


def negative_rank(path: Path) -> Path:
    return trace(path, _info(-1, 2))


def shared_frames_dump(path: Path, entries: int = 20_000, frames: int = 1_000) -> Path:
    """A flight-recorder pickle whose entries all share one frames list (a few KB on disk; written
    out per entry it is ``entries`` x ``frames`` x ~70 bytes)."""
    frame = {"name": "forward", "filename": "/work/model.py", "line": 12}
    stack = [frame] * frames
    entry = {"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1,
             "p2p_seq_id": 0, "op_id": 1, "is_p2p": False, "profiling_name": "nccl:all_reduce",
             "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
             "time_created_ns": 1, "time_discovered_started_ns": 2, "time_discovered_completed_ns": 3,
             "duration_ms": 0.1, "state": "completed", "retired": True, "timeout_ms": 600000, "frames": stack}
    dump = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": [entry] * entries}
    path.write_bytes(pickle.dumps(dump, protocol=4))
    return path


def bytearray_call(path: Path, size: int = 1_500_000_000) -> Path:
    """36 bytes: protocol 2, GLOBAL builtins.bytearray, BININT size, TUPLE1, REDUCE, STOP."""
    path.write_bytes(b"\x80\x02c__builtin__\nbytearray\nJ" + struct.pack("<i", size) + b"\x85R.")
    return path


def long_bytes(path: Path, claimed: int = 1 << 32) -> Path:
    """A pickle whose BINBYTES8 claims ``claimed`` bytes and holds none."""
    path.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", claimed) + b".")
    return path


def nested_lists(path: Path, depth: int = 200_000) -> Path:
    """A pickle of lists nested ``depth`` deep (EMPTY_LIST, then APPEND each into the one before)."""
    path.write_bytes(b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b".")
    return path


class _Call:
    """Pickles as a call of ``fn(*args)`` (GLOBAL/STACK_GLOBAL then REDUCE)."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _snapshot_head(n: int = 120_000) -> dict:
    """A snapshot's opening (segments first) of distinct strings: over 2 MiB, so it is streamed."""
    return {"segments": [{"address": i, "total_size": 512, "stream": 0, "blocks": [],
                          "frames_note": f"segment {i:08d}"} for i in range(n)]}


def streamed_call(path: Path) -> Path:
    """A snapshot past the streaming threshold that calls os.system at its end."""
    import os

    snap = _snapshot_head()
    snap["device_traces"] = [[_Call(os.system, "echo pwned > /dev/null")]]
    path.write_bytes(pickle.dumps(snap, protocol=4))
    return path


def streamed_bytes8(path: Path, claimed: int = 1 << 40) -> Path:
    """A streamed snapshot whose last value is a BINBYTES8 claiming ``claimed`` bytes it lacks."""
    snap = _snapshot_head()
    snap["extra"] = b"PLACEHOLDER"
    body = pickle.dumps(snap, protocol=4)
    short = b"C" + bytes([len(b"PLACEHOLDER")]) + b"PLACEHOLDER"  # SHORT_BINBYTES
    assert body.count(short) == 1
    path.write_bytes(body.replace(short, b"\x8e" + struct.pack("<Q", claimed)))
    return path


def streamed_many_objects(path: Path, mb: int = 15) -> Path:
    """A snapshot (segments first) whose other key holds a list of distinct empty dicts, two bytes
    each (EMPTY_DICT, MEMOIZE): the most objects a pickle of ``mb`` MiB can keep alive."""
    n = mb * (1 << 20) // 2
    head = pickle.dumps({"segments": []}, protocol=4)
    assert head.endswith(b"s.") or head.endswith(b"u.")
    # before the closing SETITEM(S) and STOP: key "other", then EMPTY_LIST, MARK, n x (EMPTY_DICT,
    # MEMOIZE), APPENDS, SETITEM
    other = b"\x8c\x05other\x94]\x94(" + b"}\x94" * n + b"e"
    path.write_bytes(head[:-1] + other + b"s.")
    return path
