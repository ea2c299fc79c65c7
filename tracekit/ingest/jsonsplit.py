"""Split a Kineto Chrome trace into its small header and its big ``traceEvents`` array, streaming.

The array is copied verbatim (decompressing on the way) to a file that DuckDB's JSON reader parses
in array mode, columnar and in bounded memory; the top-level keys around it (``distributedInfo``,
``baseTimeNanoseconds``, ...) are parsed with ``json``. Only the bytes before the array and the
last window of the file are scanned in Python, so the cost per byte is a copy.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import zlib
from pathlib import Path
from typing import BinaryIO

from tracekit.ingest.common import IngestError

CHUNK = 8 << 20
HEAD_LIMIT = 64 << 20  # the array must start within this many bytes
TAIL_WINDOW = 256 << 10  # bytes kept from the end of the file to parse the trailing keys

_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]]')
_KEY = b'"traceEvents"'


class TraceFormatError(IngestError):
    """The file is not a complete, well-formed Kineto trace; the message names the file."""


def open_stream(path: Path) -> BinaryIO:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _read(src: BinaryIO, n: int, path: Path) -> bytes:
    try:
        return src.read(n)
    except (EOFError, OSError, zlib.error) as e:
        raise TraceFormatError(f"{path}: corrupt or truncated compressed stream ({e})") from None


def _find_array_start(head: bytes) -> int | None:
    """Offset just after the '[' of the top-level traceEvents array, None if not in ``head``."""
    depth = 0
    for m in _TOKEN.finditer(head):
        tok = m.group()
        if tok in (b"{", b"["):
            depth += 1
        elif tok in (b"}", b"]"):
            depth -= 1
        elif depth == 1 and tok == _KEY:
            rest = head[m.end():m.end() + 64].lstrip()
            if rest.startswith(b":") and rest[1:].lstrip().startswith(b"["):
                return head.index(b"[", m.end()) + 1
    return None


def _find_array_end(window: bytes) -> int | None:
    """Offset of the ']' closing the traceEvents array within the file's last ``window``.

    Walks backwards from the end (which is outside any string) over the trailing top-level
    members; the first top-level array whose '[' is not in the window, or whose key is
    traceEvents, is the event array.
    """
    i = len(window) - 1
    while i >= 0 and window[i] in b" \t\r\n":
        i -= 1
    if i < 0 or window[i] != ord("}"):
        return None
    depth, in_str, close_at = 1, False, None
    i -= 1
    while i >= 0:
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
        elif c in (0x7B, 0x5B):  # { [
            depth -= 1
            if depth == 0:
                return None  # reached the top-level '{' without meeting the array
            if depth == 1 and close_at is not None:
                key = window[max(0, i - 64):i].rstrip()
                if key.endswith(b":") and key[:-1].rstrip().endswith(_KEY):
                    return close_at
                close_at = None
        i -= 1
    return close_at


def _copy_stream(src: BinaryIO, dst: BinaryIO, block: bytes, path: Path) -> tuple[int, bytes]:
    """Copy a decompressing stream; return bytes written (with the '[') and the last window."""
    window, written = b"", 1
    while block:
        dst.write(block)
        written += len(block)
        window = block[-TAIL_WINDOW:] if len(block) >= TAIL_WINDOW else (window + block)[-TAIL_WINDOW:]
        block = _read(src, CHUNK, path)
    return written, window


def _has_fd(f: BinaryIO) -> bool:
    try:
        f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    return True


def _copy_file(src: BinaryIO, dst: BinaryIO, start: int) -> tuple[int, bytes]:
    """Copy a plain file from ``start`` in the kernel (no Python buffers); same return."""
    size = os.fstat(src.fileno()).st_size
    dst.flush()
    offset, out_fd = start, dst.fileno()
    while offset < size:
        try:
            n = os.copy_file_range(src.fileno(), out_fd, size - offset, offset)
        except OSError:  # filesystems without it: plain reads
            src.seek(offset)
            n = len(block := src.read(min(CHUNK, size - offset)))
            os.write(out_fd, block)
        if n == 0:
            break
        offset += n
    dst.seek(0, os.SEEK_END)
    src.seek(max(start, size - TAIL_WINDOW))
    return 1 + size - start, src.read()


def split_trace(path: Path, events_out: BinaryIO) -> dict:
    """Copy the traceEvents array of ``path`` (as a JSON array) to ``events_out``; return the rest."""
    src = open_stream(path)
    try:
        head = b""
        start = None
        while start is None:
            block = _read(src, min(CHUNK, max(1 << 20, len(head))), path)  # the key is usually near the top
            if not block:
                break
            head += block
            start = _find_array_start(head)
            if len(head) > HEAD_LIMIT:
                break
        if not head.strip():
            raise TraceFormatError(f"{path}: empty file")
        if start is None:
            raise TraceFormatError(
                f"{path}: no top-level 'traceEvents' array in the first "
                f"{min(len(head), HEAD_LIMIT) >> 20} MiB; not a Kineto trace or truncated"
            )
        prefix = head[:start - 1]
        events_out.write(b"[")
        if isinstance(src, gzip.GzipFile) or not _has_fd(events_out):
            written, window = _copy_stream(src, events_out, head[start:], path)
        else:
            written, window = _copy_file(src, events_out, start)
        end = _find_array_end(window)
        if end is None:
            raise TraceFormatError(f"{path}: truncated or malformed: the traceEvents array is not closed")
        events_out.seek(written - len(window) + end)
        events_out.truncate()
        events_out.write(b"]")
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
