"""Recognize an input file by its content, not its name.

Formats: ``kineto`` (Chrome trace JSON, plain or gzip), ``fr`` (flight-recorder JSON), ``pickle``
(flight-recorder or memory snapshot; which one is decided after the restricted load), ``optable``
(what-if-analysis parquet), ``json`` (valid-looking JSON that is none of ours, e.g. a result file)
and ``unknown``. Empty files and corrupt compression raise :class:`IngestError`.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from tracekit.ingest.common import IngestError

SNIFF_BYTES = 1 << 16
KINETO, FR, PICKLE, OPTABLE, JSON, UNKNOWN = "kineto", "fr", "pickle", "optable", "json", "unknown"
_FR_KEYS = (b'"pg_config"', b'"version"', b'"collective_seq_id"', b'"profiling_name"')
# Names that say "I am a trace": in a directory walk, such a file that is not recognized is an
# error rather than something to pass over (a README or a result.json is passed over).
TRACE_SUFFIXES = (".json.gz", ".pt.trace.json", ".pickle", ".pkl", ".parquet")


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        raw = f.read(SNIFF_BYTES)
    if not raw:
        raise IngestError(f"{path}: empty file")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = zlib.decompressobj(wbits=31).decompress(raw, SNIFF_BYTES)
        except zlib.error as e:
            raise IngestError(f"{path}: corrupt gzip data ({e})") from None
        if not raw:
            raise IngestError(f"{path}: gzip file with no content")
    return raw


def sniff(path: Path) -> str:
    head = _head(path)
    if head[:4] == b"PAR1":
        return OPTABLE
    if head[:1] == b"\x80":  # pickle protocol 2+
        return PICKLE
    text = head.lstrip()
    if text[:1] not in (b"{", b"["):
        return UNKNOWN
    if b'"traceEvents"' in head or _kineto_preamble(text):
        return KINETO
    # torch writes the FR JSON's keys sorted: a dump whose entries fill the head shows its
    # "pg_config" and "version" only after them, so an entry's own keys count as well.
    if b'"entries"' in head and any(k in head for k in _FR_KEYS):
        return FR
    return JSON


def _kineto_preamble(text: bytes) -> bool:
    """Kineto writes ``schemaVersion`` first, then ``deviceProperties`` and ``distributedInfo``, then
    the events. A large job's ``distributedInfo`` (every process group with all its ranks) can push
    ``traceEvents`` far beyond the head, so the preamble is the sign too."""
    body = text[1:].lstrip()
    return body.startswith(b'"schemaVersion"') and (b'"deviceProperties"' in text or b'"distributedInfo"' in text)


def looks_like_trace(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith(TRACE_SUFFIXES) or path.parent.name in ("traces", "fr", "memory")
