"""The limits that keep one hostile or corrupt file from exhausting memory or time (docs/ingest.md,
"Limits"). One place decides them: each has a default, and ``TRACEKIT_LIMIT_<NAME>`` (set by
``tracekit ingest --limit name=value``, inherited by the parser processes) raises or lowers it.

A file that passes a limit fails alone, with a message naming the file, the limit and how to
raise it (``exceeded``); the other files go on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tracekit.ingest.common import IngestError

ENV_PREFIX = "TRACEKIT_LIMIT_"
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20, "mb": 10 ** 6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9}


@dataclass(frozen=True)
class Limit:
    name: str
    default: int
    what: str  # what is counted, for messages and the docs
    bytes: bool = False  # shown with a binary unit


LIMITS: dict[str, Limit] = {lim.name: lim for lim in (
    Limit("max_event_bytes", 16 << 20, "bytes in one trace event", True),
    Limit("max_header_bytes", 64 << 20, "bytes of a trace's top-level keys before and after traceEvents", True),
    Limit("max_events", 4_000_000, "complete (ph X) events in one trace file"),
    Limit("max_inflated_bytes", 64 << 30, "decompressed bytes of one gzip file", True),
    # A Kineto trace gzips 10-15x (the HTA fixtures: 13-14x). Checked once a file has inflated
    # past INFLATE_RATIO_FROM, so small, very regular files are never refused for it.
    Limit("max_inflate_ratio", 200, "decompressed bytes per compressed byte of a gzip file (past 256 MiB)"),
    # A pickle builds at most one object per byte, and no str or bytes larger than the file: so
    # this bounds a whole load's objects too (about 60x the file in memory). Larger snapshots stream.
    Limit("max_loaded_bytes", 16 << 20,
          "bytes of a file loaded whole (flight-recorder dumps, pickle or JSON; snapshots up to 2 MiB)", True),
    Limit("max_expanded_bytes", 256 << 20,
          "bytes of a flight-recorder dump's entries written out as text (shared references count each time)", True),
    Limit("max_world_size", 1 << 17, "ranks a file's world size may claim"),
)}
INFLATE_RATIO_FROM = 256 << 20


class LimitExceeded(IngestError):
    """A file passed one of the limits; the message names the file, the limit and its flag."""


def get(name: str) -> int:
    """The limit in force: the environment's value, else the default."""
    lim = LIMITS[name]
    raw = os.environ.get(ENV_PREFIX + name.upper())
    if raw is None or not raw.strip():
        return lim.default
    return parse_value(name, raw)


def parse_value(name: str, raw: str) -> int:
    """``"32MiB"``, ``"2G"``, ``"1_000_000"`` -> an integer; ValueError naming the limit if not."""
    if name not in LIMITS:
        raise ValueError(f"unknown limit {name!r} (known: {', '.join(LIMITS)})")
    m = re.fullmatch(r"\s*([0-9][0-9_]*)\s*([a-zA-Z]*)\s*", raw)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise ValueError(f"limit {name}: {raw!r} is not a count or a size such as 64MiB")
    value = int(m.group(1).replace("_", "")) * unit
    if value <= 0:
        raise ValueError(f"limit {name}: must be positive, not {raw!r}")
    return value


def setting(assignment: str) -> tuple[str, int]:
    """``name=value`` (as given to ``--limit``) -> (environment variable, value)."""
    name, sep, raw = assignment.partition("=")
    name = name.strip().lower().replace("-", "_")
    if not sep:
        raise ValueError(f"--limit {assignment!r}: expected name=value, e.g. max_event_bytes=64MiB")
    return ENV_PREFIX + name.upper(), parse_value(name, raw)


def shown(name: str, value: int) -> str:
    if not LIMITS[name].bytes:
        return f"{value:,}"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return f"{value:,} bytes"


def exceeded(source: object, name: str, detail: str, value: int | None = None) -> LimitExceeded:
    """The error for ``source`` (a path) passing limit ``name`` (in force, unless ``value`` says
    which the caller used); ``detail`` says by how much."""
    value = get(name) if value is None else value
    return LimitExceeded(f"{source}: {detail}: over the limit {name} = {shown(name, value)} "
                         f"(raise it with --limit {name}=...)")


def check(source: object, name: str, value: int, detail: str) -> None:
    """Raise ``exceeded`` if ``value`` is above the limit ``name``."""
    if value > get(name):
        raise exceeded(source, name, detail)
