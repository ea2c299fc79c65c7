"""Flight-recorder dumps (pickle or JSON, FORMATS.md section 2) into fr_entries, and timed entries
into collectives / p2p (source 'fr').

A dump names no rank: the caller resolves it (manifest, file name). gloo dumps from torch carry an
empty ``pg_config`` and no times (only ``time_created_ns``); the trainer's own records carry both.
NCCL dumps carry watchdog discovery times (coarse) and, with ``TORCH_NCCL_ENABLE_TIMING``, each
op's measured ``duration_ms``, which sets the row's end (tests/gpu_fixtures: a real H100 dump).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tracekit import classify
from tracekit.ingest import limits, unpickle
from tracekit.ingest.common import IngestError, Parsed, table_from_rows

DTYPE_BYTES = {"float": 4, "half": 2, "bfloat16": 2, "double": 8, "int": 4, "long": 8, "short": 2,
               "byte": 1, "char": 1, "bool": 1, "float32": 4, "float16": 2, "int64": 8, "int32": 4}


def load(path: Path, data: bytes) -> dict:
    """The dump as a dict, from pickle (restricted) or JSON bytes."""
    if data[:1] == b"\x80":
        obj = unpickle.loads(data, str(path))
    else:
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IngestError(f"{path}: flight-recorder JSON is malformed ({e})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("entries"), list):
        raise IngestError(f"{path}: not a flight-recorder dump (no 'entries' list)")
    return obj


def _time(v: object) -> int | None:
    return int(v) if isinstance(v, (int, float)) and v > 0 else None  # gloo JSON writes 0 for "never"


def _nbytes(sizes: object, dtypes: object) -> int | None:
    if not isinstance(sizes, list) or not isinstance(dtypes, list) or len(sizes) != len(dtypes):
        return None
    total = 0
    for shape, dt in zip(sizes, dtypes):
        width = DTYPE_BYTES.get(str(dt).lower())
        if width is None or not isinstance(shape, list):
            return None
        total += math.prod(int(s) for s in shape) * width
    return total


def _group_ranks(dump: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name, cfg in (dump.get("pg_config") or {}).items():
        try:
            ranks = json.loads(cfg["ranks"]) if isinstance(cfg.get("ranks"), str) else cfg.get("ranks")
        except (json.JSONDecodeError, TypeError, AttributeError):
            continue
        if name and isinstance(ranks, list) and ranks:
            out[str(name)] = [int(r) for r in ranks]
    return out


class _Text:
    """JSON text of an entry's fields, written once per object: a pickle's entries may all share one
    frames list (its memo), and writing it out per entry was quadratic (a 16 KB dump took 3.2 GB).
    The text the table will hold, shared or not, is counted against max_expanded_bytes."""

    def __init__(self, path: Path) -> None:
        self.path, self.total = path, 0
        self.limit = limits.get("max_expanded_bytes")
        self.done: dict[int, tuple[object, str]] = {}  # id -> (the object, kept alive; its text)

    def __call__(self, value: object) -> str:
        if isinstance(value, (list, dict, tuple)):
            hit = self.done.get(id(value))
            if hit is None:
                hit = self.done[id(value)] = (value, json.dumps(value))
            text = hit[1]
        else:
            text = json.dumps(value)
        self.total += len(text)
        if self.total > self.limit:
            raise limits.exceeded(self.path, "max_expanded_bytes",
                                  f"its entries written out take more than {self.total:,} bytes")
        return text


def parse_dump(path: Path, dump: dict) -> Parsed:
    ranks_of = _group_ranks(dump)
    entries, colls, p2ps = [], [], []
    text = _Text(path)
    for i, e in enumerate(dump["entries"]):
        if not isinstance(e, dict):
            raise IngestError(f"{path}: flight-recorder entry {i} is not a record")
        pg = e.get("process_group") or ("", "")
        pg_name, pg_desc = (str(pg[0]), str(pg[1])) if len(pg) >= 2 else (str(pg[0]), None)
        pname = str(e.get("profiling_name") or "")
        started, completed = _time(e.get("time_discovered_started_ns")), _time(e.get("time_discovered_completed_ns"))
        try:
            row = {
                "record_id": e.get("record_id"), "pg_name": pg_name, "pg_desc": pg_desc,
                "collective_seq_id": e.get("collective_seq_id"), "p2p_seq_id": e.get("p2p_seq_id"),
                "op_id": e.get("op_id"), "is_p2p": bool(e.get("is_p2p")), "profiling_name": pname,
                "input_sizes": text(e.get("input_sizes")), "input_dtypes": text(e.get("input_dtypes")),
                "output_sizes": text(e.get("output_sizes")), "output_dtypes": text(e.get("output_dtypes")),
                "time_created_ns": _time(e.get("time_created_ns")), "time_started_ns": started,
                "time_completed_ns": completed,
                "duration_ms": float(e["duration_ms"]) if e.get("duration_ms") is not None else None,
                "state": e.get("state"), "retired": e.get("retired"), "timeout_ms": e.get("timeout_ms"),
                "frames": text(e.get("frames") or []),
            }
        except (TypeError, ValueError) as err:
            raise IngestError(f"{path}: flight-recorder entry {i} has a bad field ({err})") from None
        entries.append(row)
        if started is None or completed is None:
            continue
        # On NCCL the discovered times are the watchdog's polls (an H100 dump: 4-108 ms after
        # creation, start and completion 0.5 us apart); duration_ms is the op's own, timed with
        # CUDA events (TORCH_NCCL_ENABLE_TIMING). An op lasts at least that long.
        if row["duration_ms"] is not None and math.isfinite(row["duration_ms"]):
            completed = max(completed, started + round(row["duration_ms"] * 1e6))
        op = classify.comm_op(pname) or classify.normalize_op(pname)
        nbytes = _nbytes(e.get("input_sizes"), e.get("input_dtypes"))
        if row["is_p2p"] or op in classify.P2P_NORMALIZED:
            p2ps.append({"peer": _peer(pname, ranks_of.get(pg_name)), "direction": op, "pg_name": pg_name,
                         "seq": row["p2p_seq_id"], "start_ns": started, "end_ns": completed,
                         "nbytes": nbytes, "source": "fr"})
        else:
            dts = e.get("input_dtypes") or [None]
            colls.append({"pg_name": pg_name, "seq": row["collective_seq_id"], "op": op, "start_ns": started,
                          "end_ns": completed, "nbytes": nbytes, "dtype": dts[0], "source": "fr"})
    try:
        tables = {"fr_entries": table_from_rows("fr_entries", entries),
                  "collectives": table_from_rows("collectives", colls),
                  "p2p": table_from_rows("p2p", p2ps)}
    except (TypeError, OverflowError) as err:  # a value that does not fit its column
        raise IngestError(f"{path}: flight-recorder entries have fields of the wrong type ({err})") from None
    groups = [{"pg_name": n, "pg_desc": (dump["pg_config"][n] or {}).get("desc"), "ranks": r}
              for n, r in ranks_of.items()]
    return Parsed(format="fr", tables=tables, groups=groups)


def _peer(profiling_name: str, group: list[int] | None) -> int | None:
    """Global rank of the other side of 'nccl:send 0->1' / 'nccl:recv 1<-0' (group-local ranks)."""
    tail = profiling_name.split(" ", 1)[1] if " " in profiling_name else ""
    for arrow, side in (("->", 1), ("<-", 1)):
        if arrow in tail:
            try:
                local = int(tail.split(arrow)[side])
            except ValueError:
                return None
            return group[local] if group and 0 <= local < len(group) else None
    return None


def parse(path: Path) -> Parsed:
    from tracekit.ingest.parse import read_whole

    return parse_dump(path, load(path, read_whole(path)))
