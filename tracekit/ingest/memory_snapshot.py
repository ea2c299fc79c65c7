"""Memory snapshots (``torch.cuda.memory._dump_snapshot`` pickles, FORMATS.md section 3, and the
CPU-derived ones: torch's ``_profile_to_snapshot`` and the reference trainer's) into memory_events,
memory_segments and memory_blocks.

A snapshot of hundreds of MB is streamed (tracekit.ingest.unpickle): trace entries and segments go
into column buffers as the pickle reader completes them, and the pickle's object graph never
exists whole. The reader accepts plain data only, as the restricted unpickler does.
"""

from __future__ import annotations

import io
import pickletools
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracekit.ingest import unpickle
from tracekit.ingest import columns
from tracekit.ingest.common import IngestError, Parsed, arrow_schema, table_from_rows
from tracekit.ingest.memory_frames import TopFrames

TRACE, SEGMENTS = ("device_traces", "*", "*"), ("segments", "*")
# Bytes: a larger snapshot pickle is streamed (parse_path); a smaller one is loaded whole, which
# peaks at about 60x the file (docs/ingest.md).
STREAM_ABOVE = 2 << 20


class _Strings:
    """A dictionary-encoded string column: codes, -1 for null."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.lookup: dict[str | None, int] = {None: -1}  # the index, and null
        self.codes = array("i")

    def add(self, s: Any) -> None:
        self.extend([s])

    def extend(self, values: list) -> None:
        """A batch's codes by one lookup each; a string seen for the first time gets the next code."""
        codes = list(map(self.lookup.get, values))  # TypeError for an unhashable value
        if None in codes:
            for i, code in enumerate(codes):
                if code is None:
                    s = values[i]
                    code = self.lookup.get(s)  # seen earlier in this batch
                    if code is None:
                        if type(s) is not str:
                            raise TypeError(f"expected a string, got {type(s).__name__} {s!r:.40}")
                        code = self.index[s] = self.lookup[s] = len(self.index)
                    codes[i] = code
        self.codes.extend(array("i", codes))

    def arrow(self) -> pa.Array:
        codes = np.frombuffer(self.codes, dtype=np.int32)
        return pa.DictionaryArray.from_arrays(columns.from_numpy(codes, codes >= 0),
                                              columns.from_values(list(self.index), pa.string()))


class _Ints:
    """An int64 column; None becomes null. ``arrow`` is called once (it scales in place)."""

    def __init__(self) -> None:
        self.values, self.nulls = array("q"), array("q")

    def add(self, v: Any) -> None:
        if v is None:
            self.nulls.append(len(self.values))
            v = 0
        elif type(v) is not int:
            if type(v) is not float or v != v:
                raise TypeError(f"expected an integer, got {type(v).__name__} {v!r:.40}")
            v = int(v)
        self.values.append(v)

    def arrow(self, scale: int = 1) -> pa.Array:
        values = np.frombuffer(self.values, dtype=np.int64)  # a view: Arrow wraps the same buffer
        if scale != 1:
            values *= scale
        valid = None
        if self.nulls:
            valid = np.ones(len(values), dtype=bool)
            valid[np.frombuffer(self.nulls, dtype=np.int64)] = False
        return columns.from_numpy(values, valid)


class _Irregular(Exception):
    """A batch of trace entries that the column-at-a-time path does not take."""


class _Events:
    """device_traces entries, in order, as memory_events columns (all devices in one sequence)."""

    def __init__(self, path: Path) -> None:
        self.path, self.top = path, TopFrames()
        self.ints = {c: _Ints() for c in ("addr", "size", "stream", "ts_ns")}
        self.strs = {c: _Strings() for c in ("action", "category", "frame", "frames")}
        self.n = 0

    def add(self, _device: list, items: list) -> None:
        try:
            self._add_batch(items)
        except (_Irregular, TypeError, OverflowError):
            self._add_each(items)  # finds the entry at fault, or takes nulls and floats one by one

    def _add_batch(self, items: list) -> None:
        """The usual batch, a column at a time: every entry a dict, every number an int. A batch
        that is not is left whole to _add_each; a string that is not a string fails the file there
        too, at its entry."""
        if not items or set(map(type, items)) != {dict}:
            raise _Irregular
        numbers = [[e.get(k) for e in items] for k in ("addr", "size", "stream", "time_us")]
        if any(set(map(type, col)) != {int} for col in numbers):
            raise _Irregular
        numbers = [array("q", col) for col in numbers]  # OverflowError beyond int64
        for name in ("action", "category"):  # a bad string fails the file, in _add_each too
            self.strs[name].extend([e.get(name) for e in items])
        described = self.top.many([e.get("frames") for e in items])
        self.strs["frame"].extend([d[0] for d in described])
        self.strs["frames"].extend([d[1] for d in described])
        for col, name in zip(numbers, ("addr", "size", "stream", "ts_ns")):
            self.ints[name].values.extend(col)
        self.n += len(items)

    def _add_each(self, items: list) -> None:
        addr, size, stream, ts = (self.ints[c] for c in ("addr", "size", "stream", "ts_ns"))
        action, category, frame, stack = (self.strs[c] for c in ("action", "category", "frame", "frames"))
        top = self.top
        for e in items:
            if type(e) is not dict:
                raise IngestError(f"{self.path}: trace entry {self.n} is a {type(e).__name__}, not a dict")
            try:
                a, s, st, t = e.get("addr"), e.get("size"), e.get("stream"), e.get("time_us")
                addr.add(a)
                size.add(s)
                stream.add(st)
                ts.add(t)
                action.add(e.get("action"))
                category.add(e.get("category"))
                described = top(e.get("frames"))
                frame.add(described[0])
                stack.add(described[1])
            except (TypeError, OverflowError) as err:
                raise IngestError(f"{self.path}: trace entry {self.n} is malformed ({err})") from None
            self.n += 1

    def table(self) -> pa.Table:
        cols = {"seq": columns.from_numpy(np.arange(self.n, dtype=np.int64)), "ts_ns": self.ints["ts_ns"].arrow(1000),
                "addr": self.ints["addr"].arrow(), "size": self.ints["size"].arrow(),
                "stream": self.ints["stream"].arrow(), **{c: s.arrow() for c, s in self.strs.items()}}
        names = arrow_schema("memory_events").names
        return columns.table({c: cols[c] for c in names})


class _Segments:
    """Segments and their blocks (a few thousand rows even in large snapshots)."""

    def __init__(self, path: Path) -> None:
        self.path, self.top = path, TopFrames()
        self.segments: list[dict] = []
        self.blocks: list[dict] = []

    def add(self, _segments: list, items: list) -> None:
        try:
            for s in items:
                blocks = s.get("blocks") or []
                active = [b for b in blocks if str(b.get("state", "")).startswith("active")]
                self.segments.append({
                    "address": s.get("address"), "total_size": s.get("total_size"),
                    "allocated_size": s.get("allocated_size",
                                            sum(b["size"] for b in active if b.get("state") == "active_allocated")),
                    "active_size": s.get("active_size", sum(b.get("size", 0) for b in active)),
                    "requested_size": s.get("requested_size", sum(b.get("requested_size", 0) for b in active)),
                    "stream": s.get("stream"), "segment_type": s.get("segment_type"), "blocks": len(blocks)})
                addr = s.get("address")
                for b in blocks:
                    self.blocks.append({
                        "segment_address": s.get("address"), "address": b.get("address", addr),
                        "size": b.get("size"), "requested_size": b.get("requested_size"),
                        "state": b.get("state"), "category": b.get("category"),
                        **dict(zip(("frame", "frames"), self.top(b.get("frames"))))})
                    addr = addr + b["size"] if isinstance(addr, int) and isinstance(b.get("size"), int) else None
        except (AttributeError, TypeError, ValueError, KeyError) as err:
            raise IngestError(f"{self.path}: memory snapshot has a malformed segment ({err})") from None

    def tables(self) -> dict[str, pa.Table]:
        try:
            return {"memory_segments": table_from_rows("memory_segments", self.segments),
                    "memory_blocks": table_from_rows("memory_blocks", self.blocks)}
        except (TypeError, OverflowError) as err:
            raise IngestError(f"{self.path}: memory snapshot has a malformed segment ({err})") from None


def _check(path: Path, snap: object) -> None:
    if not isinstance(snap, dict):
        raise IngestError(f"{path}: not a memory snapshot (top level is {type(snap).__name__})")
    traces, segments = snap.get("device_traces"), snap.get("segments")
    if not isinstance(traces, list) or not isinstance(segments, list) \
            or not all(isinstance(d, list) for d in traces):
        raise IngestError(f"{path}: not a memory snapshot (needs a 'segments' list and a "
                          "'device_traces' list of lists)")


def _parsed(events: _Events, segments: _Segments) -> Parsed:
    return Parsed(format="memory", tables={"memory_events": events.table(), **segments.tables()})


def parse_snapshot(path: Path, snap: dict) -> Parsed:
    """A snapshot already loaded as a dict (small files, or a pickle that is not streamed)."""
    _check(path, snap)
    events, segments = _Events(path), _Segments(path)
    for device in snap["device_traces"]:
        events.add(device, device)
    segments.add(snap["segments"], snap["segments"])
    return _parsed(events, segments)


def parse(path: Path) -> Parsed:
    """Stream a snapshot pickle: no more than a batch of entries is alive as Python objects."""
    events, segments = _Events(path), _Segments(path)
    top = unpickle.read(path, {TRACE: events.add, SEGMENTS: segments.add})
    _check(path, top)
    return _parsed(events, segments)


def looks_like_snapshot(path: Path) -> bool:
    """Whether the pickle's top-level dict starts with a snapshot key (torch writes 'segments'
    first): read from the first opcodes only, without building anything."""
    with open(path, "rb") as f:
        head = f.read(1 << 12)
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if isinstance(arg, str) and op.name not in ("GLOBAL", "INST"):
                return arg in ("segments", "device_traces")
            if op.name not in ("PROTO", "FRAME", "EMPTY_DICT", "MARK", "DICT", "MEMOIZE", "BINPUT",
                               "LONG_BINPUT", "PUT"):
                return False
    except ValueError:  # truncated head or not a pickle: the full parse says what is wrong
        return False
    return False
