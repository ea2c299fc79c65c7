"""Memory snapshots (``torch.cuda.memory._dump_snapshot`` pickles, FORMATS.md section 3, and the
CPU-derived ones from ``torch.cuda._memory_viz._profile_to_snapshot``) into memory_events and
memory_segments. Loaded with the restricted unpickler: a snapshot is plain data.
"""

from __future__ import annotations

import re
from pathlib import Path

from tracekit import safe_pickle
from tracekit.ingest.common import IngestError, Parsed, table_from_rows

_CPU_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")  # 'train.py(83): step'
_INTERNAL = ("/torch/", "torch/", "<built-in", "multiprocessing/", "threading.py", "<string>")


def top_user_frame(frames: object) -> str | None:
    """'file:line:function' of the innermost frame outside torch and the interpreter's plumbing."""
    if not isinstance(frames, list):
        return None
    for f in frames:
        if not isinstance(f, dict):
            continue
        file, line, func = str(f.get("filename", "")), f.get("line", 0), str(f.get("name", ""))
        if file in ("none", "??", ""):  # CPU-derived frames keep everything in 'name'
            m = _CPU_FRAME.match(func)
            if not m:
                continue
            file, line, func = m["file"], m["line"], m["func"]
        if any(s in file or file.startswith(s) for s in _INTERNAL) or func.startswith("<built-in"):
            continue
        return f"{file}:{line}:{func}"
    return None


def parse_snapshot(path: Path, snap: dict) -> Parsed:
    traces, segments = snap.get("device_traces"), snap.get("segments")
    if not isinstance(traces, list) or not isinstance(segments, list):
        raise IngestError(f"{path}: not a memory snapshot (needs 'segments' and 'device_traces' lists)")
    events = []
    try:
        for dev in traces:
            for e in dev:
                t = e.get("time_us")
                events.append({"seq": len(events), "ts_ns": int(t * 1000) if t is not None else None,
                               "action": e.get("action"), "addr": e.get("addr"), "size": e.get("size"),
                               "stream": e.get("stream"), "category": e.get("category"),
                               "frame": top_user_frame(e.get("frames"))})
        segs = []
        for s in segments:
            blocks = s.get("blocks") or []
            active = [b for b in blocks if str(b.get("state", "")).startswith("active")]
            segs.append({
                "address": s.get("address"), "total_size": s.get("total_size"),
                "allocated_size": s.get("allocated_size",
                                        sum(b["size"] for b in active if b.get("state") == "active_allocated")),
                "active_size": s.get("active_size", sum(b.get("size", 0) for b in active)),
                "requested_size": s.get("requested_size", sum(b.get("requested_size", 0) for b in active)),
                "stream": s.get("stream"), "segment_type": s.get("segment_type"), "blocks": len(blocks)})
        tables = {"memory_events": table_from_rows("memory_events", events),
                  "memory_segments": table_from_rows("memory_segments", segs)}
    except (AttributeError, TypeError, ValueError, KeyError, OverflowError) as err:
        raise IngestError(f"{path}: memory snapshot has malformed entries ({err})") from None
    return Parsed(format="memory", tables=tables)


def parse(path: Path) -> Parsed:
    obj = safe_pickle.loads(path.read_bytes(), str(path))
    if not isinstance(obj, dict):
        raise IngestError(f"{path}: not a memory snapshot (top level is {type(obj).__name__})")
    return parse_snapshot(path, obj)
