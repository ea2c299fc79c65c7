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
import re
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracekit.ingest import unpickle
from tracekit.ingest import columns
from tracekit.ingest.common import IngestError, Parsed, arrow_schema, table_from_rows

_CPU_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")  # 'train.py(83): step'
_INTERNAL = ("/torch/", "torch/", "<built-in", "multiprocessing/", "threading.py", "<string>")
# C++ frames of a CUDA snapshot recorded with torch's default stacks="all" (the allocator, ATen's
# dispatch, the Python bindings) come before the Python ones and name their source files.
_NATIVE = (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh")
# An allocation made by the autograd engine's thread (backward) has no Python frame in a CUDA
# snapshot; its innermost autograd frame says which backward node or which engine step made it.
_AUTOGRAD = re.compile(r"^torch::autograd::(?:generated::(\w+?)(?:_apply_functional|::apply)\b"
                       r"|((?:Engine|InputBuffer)::\w+))")
TRACE, SEGMENTS = ("device_traces", "*", "*"), ("segments", "*")
# Bytes: a larger snapshot pickle is streamed (parse_path); a smaller one is loaded whole, which
# peaks at about 60x the file (docs/ingest.md).
STREAM_ABOVE = 2 << 20


# The stored stack (memory_events.frames): its Python frames, innermost first, at most STACK_FRAMES
# of them and STACK_LINE characters a line, so that one pathological stack (deep recursion, a
# generated name) cannot make each of a million rows kilobytes long.
STACK_FRAMES, STACK_LINE = 32, 240


def top_user_frame(frames: object) -> str | None:
    """'file:line:function' of the innermost frame outside torch and the interpreter's plumbing;
    for backward work with no such frame, '<autograd>:0:<node>' (e.g. MmBackward0)."""
    if not isinstance(frames, list):
        return None
    return _python_frame(frames) or _autograd_frame(frames)


def stack_text(frames: object) -> str | None:
    """The allocation's stack as text: every Python frame (torch's too, as memory_viz shows them)
    as 'file:line:function', innermost first, one a line; a backward allocation without Python
    frames: its autograd node. At most STACK_FRAMES lines (then '... N more frames')."""
    if not isinstance(frames, list):
        return None
    lines = []
    for f in frames:
        if not isinstance(f, dict):
            continue
        file, line, func = str(f.get("filename", "")), f.get("line", 0), str(f.get("name", ""))
        if file in ("none", "??", ""):
            m = _CPU_FRAME.match(func)
            if not m:
                continue
            file, line, func = m["file"], m["line"], m["func"]
        if file.endswith(_NATIVE):
            continue
        lines.append(f"{file}:{line}:{func}"[:STACK_LINE])
    if not lines:
        node = _autograd_frame(frames)
        return node[:STACK_LINE] if node else None
    more = len(lines) - STACK_FRAMES
    return "\n".join(lines[:STACK_FRAMES] + ([f"... {more} more frames"] if more > 0 else []))


def _autograd_frame(frames: list) -> str | None:
    for f in frames:
        if isinstance(f, dict) and (m := _AUTOGRAD.match(str(f.get("name", "")))):
            return f"<autograd>:0:{m[1] or m[2]}"
    return None


def _python_frame(frames: list) -> str | None:
    for f in frames:
        if not isinstance(f, dict):
            continue
        file, line, func = str(f.get("filename", "")), f.get("line", 0), str(f.get("name", ""))
        if file in ("none", "??", ""):  # CPU-derived frames keep everything in 'name'
            m = _CPU_FRAME.match(func)
            if not m:
                continue
            file, line, func = m["file"], m["line"], m["func"]
        if file.endswith(_NATIVE) or any(s in file or file.startswith(s) for s in _INTERNAL) \
                or func.startswith("<built-in"):
            continue
        return f"{file}:{line}:{func}"
    return None


_NO_STACK: tuple[None, None] = (None, None)


def _described(frames: list) -> tuple[str | None, str | None]:
    return top_user_frame(frames), stack_text(frames)


class _TopFrames:
    """top_user_frame and stack_text, once per call stack: an allocation site repeats every step, with the same
    frame dicts (torch symbolizes each frame once).

    A stack is looked up by its length and its first and last frames' identities, then compared
    whole with the stacks known under that key: lists of the same dicts compare by identity, at C
    speed, where a key of all the frames' identities took 3x as long as the rest of an entry. Past
    a few stacks under one key (many stacks can share the allocator's frame and the script's), that
    key's stacks are held by all their identities. A cached stack holds its frames, so the
    identities stay valid."""

    ALIKE = 8

    def __init__(self) -> None:
        self.seen: dict[tuple, list[tuple[list, str | None]] | dict[tuple, tuple[list, str | None]]] = {}

    def __call__(self, frames: object) -> tuple[str | None, str | None]:
        return self.many([frames])[0]

    def many(self, stacks: list) -> list[tuple[str | None, str | None]]:
        """(top user frame, stack text) of each stack."""
        seen, out = self.seen, []
        for frames in stacks:
            if type(frames) is not list or not frames:
                out.append(_NO_STACK)
                continue
            key = (len(frames), id(frames[0]), id(frames[-1]))
            known = seen.get(key)
            if known is None:
                if len(seen) > 1 << 16:
                    seen.clear()
                known = seen[key] = []
            if type(known) is dict:
                ids = tuple(map(id, frames))
                hit = known.get(ids)
                if hit is None:
                    hit = known[ids] = (frames, _described(frames))
                out.append(hit[1])
                continue
            for stack, top in known:
                if stack == frames:
                    break
            else:
                top = _described(frames)
                known.append((frames, top))
                if len(known) > self.ALIKE:
                    seen[key] = {tuple(map(id, s)): (s, t) for s, t in known}
            out.append(top)
        return out


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
        self.path, self.top = path, _TopFrames()
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
        self.path, self.top = path, _TopFrames()
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
