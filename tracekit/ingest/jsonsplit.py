"""Stream a Kineto Chrome trace into its ``traceEvents`` array (for DuckDB) and its small header.

One pass over the file's bytes: they are hashed as read (the content hash of the ingest log),
decompressed when gzip, and everything between the array's ``[`` and ``]`` is written through
verbatim (with its brackets) to ``out``, a file that DuckDB's JSON reader parses in array mode,
columnar and in bounded memory. Only the bytes before the array and a window at the end are
scanned in Python; the top-level keys around the array (``distributedInfo``,
``baseTimeNanoseconds``, ...) are parsed with ``json``.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import BinaryIO, Protocol

from tracekit.ingest import limits
from tracekit.ingest.common import IngestError

try:  # ISA-L's inflate behind zlib's interface: 4.3x zlib's speed on a gzipped trace (docs/ingest.md)
    from isal import isal_zlib
except ImportError:  # not installed (a platform without its wheels): zlib, the same bytes
    isal_zlib = None
inflater = isal_zlib or zlib
INFLATE_ERRORS = (zlib.error,) + ((isal_zlib.error,) if isal_zlib is not None else ())

CHUNK = 1 << 20
TAIL_WINDOW = 256 << 10  # bytes held back at the end to find the array's ']' and the trailing keys
CONFIRM_WINDOW = 16 << 10  # how far back from a top-level ']' to look for its '[' (and key)

_STRUCT = re.compile(rb'["{}\[\]]')
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to the closing quote
_KEY = b'"traceEvents"'


class TraceFormatError(IngestError):
    """The file is not a complete, well-formed Kineto trace; the message names the file."""


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...


class _ArrayStart:
    """Finds the '[' of the top-level traceEvents array in a growing head, in one pass: each call
    goes on from where the last stopped (a string cut by the end of the head is taken up again at
    its opening quote), so a long head costs linear time, not a rescan per block."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.string_at: int | None = None  # the opening quote of a string the head cut

    def find(self, head: bytes, final: bool = False) -> int | None:
        """Offset just after the '[', None if it is not in ``head`` (yet)."""
        while True:
            if self.string_at is None:
                m = _STRUCT.search(head, self.pos)
                if m is None:
                    self.pos = len(head)
                    return None
                c = head[m.start()]
                if c != 0x22:
                    self.depth += 1 if c in (0x7B, 0x5B) else -1
                    self.pos = m.end()
                    continue
                self.string_at, self.pos = m.start(), m.end()
            end = _STRING_BODY.match(head, self.pos).end()
            if end >= len(head) or head[end] != 0x22:  # the string goes on past the head
                self.pos = end  # at the end, or at a backslash whose escaped byte is still to come
                return None
            start, self.string_at, self.pos = self.string_at, None, end + 1
            if self.depth == 1 and head[start:self.pos] == _KEY:
                rest = head[self.pos:self.pos + 64]
                stripped = rest.lstrip()
                if len(stripped) < 2 and not final and len(rest) < 64:
                    self.string_at, self.pos = start, start + 1  # wait for what follows the key
                    return None
                if stripped.startswith(b":") and stripped[1:].lstrip().startswith(b"["):
                    return head.index(b"[", self.pos) + 1


def _find_array_end(window: bytes) -> int | None:
    """Offset of the ']' closing the traceEvents array within ``window``, the end of the stream
    after the array's '['.

    Walks backwards from the end (which is outside any string) over the trailing top-level
    members. A top-level array whose key is traceEvents, or whose '[' is neither in the window nor
    within CONFIRM_WINDOW bytes of its ']', is the event array (an event array is never that
    small unless its '[' is in the window: the window starts right after it).
    """
    i = len(window) - 1
    while i >= 0 and window[i] in b" \t\r\n":
        i -= 1
    if i < 0 or window[i] != ord("}"):
        return None
    depth, in_str, close_at = 1, False, None
    # The bytes before the final '}' walked backwards from structural byte to structural byte
    # (a regex over the reversed window): a byte at a time in Python took about 1 ms a trace.
    rev = window[i - 1::-1] if i > 0 else b""
    last = i - 1
    for m in _STRUCT.finditer(rev):
        i = last - m.start()
        if close_at is not None and close_at - i > CONFIRM_WINDOW:
            return close_at
        c = window[i]
        if in_str:
            if c == 0x22:  # '"' ends the string unless escaped by an odd run of backslashes
                j = i - 1
                while j >= 0 and window[j] == 0x5C:
                    j -= 1
                if (i - 1 - j) % 2 == 0:
                    in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x7D, 0x5D):  # } ]
            if depth == 1 and c == 0x5D:
                close_at = i
            depth += 1
        else:  # { [
            depth -= 1
            if depth == 0:
                return None  # reached the top-level '{' without meeting the array
            if depth == 1 and close_at is not None:
                key = window[max(0, i - 64):i].rstrip()
                if key.endswith(b":") and key[:-1].rstrip().endswith(_KEY):
                    return close_at
                close_at = None
    return close_at


class _Source:
    """The file's decompressed bytes in blocks of at most CHUNK, hashing the raw bytes on the way.

    A gzip stream inflates a block at a time (never a whole member at once), and the inflated size
    is held to the limits max_inflated_bytes and max_inflate_ratio: a small file that inflates to
    gigabytes (a gzip bomb) fails early, in bounded memory."""

    def __init__(self, path: Path, hasher: Hasher | None) -> None:
        self.path, self.hasher = path, hasher
        self.f = open(path, "rb")
        first = self.f.read(2)
        self.f.seek(0)
        self.inflate = inflater.decompressobj(wbits=31) if first == b"\x1f\x8b" else None
        self.pending = b""  # compressed input not yet inflated
        self.raw_bytes = self.inflated = 0
        if self.inflate is not None:
            self.max_inflated = limits.get("max_inflated_bytes")
            self.max_ratio = limits.get("max_inflate_ratio")

    def read(self) -> bytes:
        """The next block; b'' at the end. Raises TraceFormatError on a corrupt or cut gzip stream."""
        while True:
            if self.inflate is None or not self.pending:
                raw = self.f.read(CHUNK)
                self.raw_bytes += len(raw)
                if self.hasher is not None and raw:
                    self.hasher.update(raw)
                if self.inflate is None:
                    return raw
                if not raw:
                    if not self.inflate.eof:
                        raise TraceFormatError(f"{self.path}: corrupt or truncated compressed stream "
                                               "(gzip data ends early)")
                    return b""
                self.pending = raw
            try:
                if self.inflate.eof:  # concatenated gzip members
                    self.inflate = inflater.decompressobj(wbits=31)
                out = self.inflate.decompress(self.pending, CHUNK)
                self.pending = self.inflate.unconsumed_tail or self.inflate.unused_data
            except INFLATE_ERRORS as e:
                raise TraceFormatError(f"{self.path}: corrupt or truncated compressed stream ({e})") from None
            if out:
                self._count(len(out))
                return out

    def _count(self, n: int) -> None:
        self.inflated += n
        if self.inflated > self.max_inflated:
            raise limits.exceeded(self.path, "max_inflated_bytes",
                                  f"inflates to more than {limits.shown('max_inflated_bytes', self.max_inflated)}")
        if self.inflated > limits.INFLATE_RATIO_FROM and self.inflated > self.max_ratio * max(1, self.raw_bytes):
            raise limits.exceeded(self.path, "max_inflate_ratio",
                                  f"{self.raw_bytes:,} compressed bytes inflate to more than {self.inflated:,} "
                                  f"(a gzip bomb?)")

    def close(self) -> None:
        self.f.close()


def stream_events(path: Path, out: BinaryIO, hasher: Hasher | None = None) -> dict:
    """Write the traceEvents array of ``path`` to ``out`` as one JSON array; return the other
    top-level keys (``traceEvents`` itself maps to None). ``hasher`` sees every raw byte of the file.

    The closing ']' is written only once the array is known to be complete, so a reader of ``out``
    never sees a truncated file as a valid array.
    """
    src = _Source(path, hasher)
    max_header = limits.get("max_header_bytes")
    try:
        head, start, finder = bytearray(), None, _ArrayStart()
        while start is None:
            if len(head) > max_header:
                raise limits.exceeded(path, "max_header_bytes",
                                      f"no traceEvents array in the first {len(head):,} bytes")
            block = src.read()
            if not block:
                start = finder.find(head, final=True)
                break
            head += block
            start = finder.find(head)
        if not head.strip():
            raise TraceFormatError(f"{path}: empty file")
        if start is None:
            raise TraceFormatError(f"{path}: no top-level 'traceEvents' array; not a Kineto trace or truncated")
        prefix = head[:start - 1]
        out.write(b"[")
        held = memoryview(head)[start:]  # the last bytes seen, not yet written
        while block := src.read():
            if len(held) + len(block) <= TAIL_WINDOW:
                held = memoryview(bytes(held) + block)
                continue
            if len(block) >= TAIL_WINDOW:
                out.write(held)
                out.write(memoryview(block)[:-TAIL_WINDOW])
                held = memoryview(block)[-TAIL_WINDOW:]
            else:
                keep = bytes(held[len(held) + len(block) - TAIL_WINDOW:]) + block
                out.write(held[:len(held) + len(block) - TAIL_WINDOW])
                held = memoryview(keep)
        window = bytes(held)
        end = _find_array_end(window)
        if end is None:
            raise TraceFormatError(f"{path}: truncated or malformed: the traceEvents array is not closed")
        out.write(memoryview(window)[:end])
        out.write(b"]")
        tail = window[end + 1:]
    finally:
        src.close()
    key_at = prefix.rfind(_KEY)
    try:
        meta = json.loads(prefix[:key_at] + b'"traceEvents": null' + tail)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{path}: malformed top-level keys around traceEvents ({e})") from None
    if not isinstance(meta, dict):
        raise TraceFormatError(f"{path}: top level is not a JSON object")
    return meta


def split_trace(path: Path, events_out: BinaryIO) -> dict:
    """Copy the traceEvents array of ``path`` (as a JSON array) to ``events_out``; return the rest."""
    return stream_events(path, events_out)
