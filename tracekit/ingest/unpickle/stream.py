"""Read a plain-data pickle opcode by opcode, handing the items of chosen lists to a callback as
they complete instead of building the whole object graph (memory snapshots of hundreds of MB).

The reader is its own pickle machine: it resolves no global, calls nothing the file names and
builds only dict, list, tuple, set, frozenset, str, bytes, bytearray, int, float, bool and None.
Any opcode that would import or call something (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ,
NEWOBJ, NEWOBJ_EX, EXT*, PERSID, BINPERSID, out-of-band buffers) is refused with
:class:`~tracekit.ingest.unpickle.UnsafePickleError` naming the file, before anything is built.

Two passes over a read-only memory map of the file:

1. scan: walk the opcodes without building anything; check every opcode is allowed, and record
   for each memo slot the byte offset where the pickle last fetches it (or that it never does).
2. build: run the machine. A memo slot is kept only if something fetches it later, and dropped
   once past its last fetch, so objects referred to once (a trace entry, its frames list) die
   with their parent. Lists whose path matches a watched pattern (a tuple of dict keys, with
   ``"*"`` for any list position, e.g. ``("device_traces", "*", "*")``) never receive their items:
   complete items go to the pattern's callback in batches, so at most one batch is alive at a time.

The pickle's memo would otherwise keep every container alive to the end. Pages already read are
released from the process (``madvise``) as the walk moves on.

Both passes exist twice: in C (``_pickle_machine.c``, about 10x faster; used when built) and in
Python (``scan`` here and ``build``, the reference and the fallback), with the same
results, callbacks and errors. ``TRACEKIT_PICKLE_READER`` (READER_ENV) = ``native`` or ``python``
forces one.
"""

from __future__ import annotations

import codecs
import mmap
import os
import re
import struct
import sys
from array import array
from pathlib import Path
from pickle import UnpicklingError
from typing import Any, Callable, Mapping

import numpy as np

from tracekit.ingest.unpickle.safe import UnsafePickleError

try:
    from tracekit.ingest.unpickle import _pickle_machine
except ImportError:  # built without a C compiler: the Python machine runs
    _pickle_machine = None

AVAILABLE = _pickle_machine is not None
READER_ENV = "TRACEKIT_PICKLE_READER"  # "native" (the C machine) or "python"; default: native if built
OnItems = Callable[[list, list], None]  # (the watched list, its next complete items)

# opcode classes for the scan: >= 0 is the length of a fixed-size argument
_GET, _PUT, _VAR, _LINE, _STOP, _BAD, _FORBIDDEN = -1, -2, -3, -4, -5, -6, -7
_FORBIDDEN_NAMES = {b"c": "GLOBAL", b"\x93": "STACK_GLOBAL", b"R": "REDUCE", b"b": "BUILD", b"i": "INST",
                    b"o": "OBJ", b"\x81": "NEWOBJ", b"\x92": "NEWOBJ_EX", b"P": "PERSID", b"Q": "BINPERSID",
                    b"\x82": "EXT1", b"\x83": "EXT2", b"\x84": "EXT4", b"\x97": "NEXT_BUFFER",
                    b"\x98": "READONLY_BUFFER"}
_KIND = [_BAD] * 256
for _ops, _kind in (
    (b"(012N\x88\x89)]}\x8f\x90\x91\x85\x86\x87tldeasu\x94", 0),
    (b"K\x80hq", 1), (b"M", 2), (b"Jjr", 4), (b"G\x95", 8),
):
    for _o in _ops:
        _KIND[_o] = _kind
for _o in b"ghj":
    _KIND[_o] = _GET
for _o in b"pqr\x94":
    _KIND[_o] = _PUT
for _o in b"\x8c\x8a\x8bXB\x8dC\x8e\x96TU":
    _KIND[_o] = _VAR
for _o in b"IFLSV":
    _KIND[_o] = _LINE
_KIND[ord(".")] = _STOP
for _o in _FORBIDDEN_NAMES:
    _KIND[_o[0]] = _FORBIDDEN
# variable-length arguments: opcode -> (struct of the length prefix, its size)
_LEN = {0x8C: ("<B", 1), 0x8A: ("<B", 1), 0x43: ("<B", 1), 0x55: ("<B", 1), 0x8B: ("<i", 4),
        0x58: ("<I", 4), 0x42: ("<I", 4), 0x54: ("<i", 4), 0x8D: ("<Q", 8), 0x8E: ("<Q", 8), 0x96: ("<Q", 8)}
_RELEASE_BYTES = 8 << 20  # give read pages back to the OS (and purge the memo) this often
# memo references (BINGET, LONG_BINGET) in a row: a frames list is MARK, a run of them, APPENDS
_REFS_APPENDS = re.compile(rb"(?:j....|h.)+e", re.S)
_RUNS: dict[bytes, array] = {}


def refs(run: bytes) -> array:
    """The memo slots a run of BINGET/LONG_BINGET fetches. A call stack repeats every step, and
    its frames list is then the same bytes: decoded once."""
    got = _RUNS.get(run)
    if got is None:
        out, pos, n = [], 0, len(run)
        while pos < n:
            if run[pos] == 104:
                out.append(run[pos + 1])
                pos += 2
            else:
                out.append(int.from_bytes(run[pos + 1:pos + 5], "little"))
                pos += 5
        if len(_RUNS) > 1 << 16:
            _RUNS.clear()
        got = _RUNS[run] = array("q", out)
    return got


# The scan skips, at regex speed, runs of opcodes that neither set a memo slot nor fetch one past
# slot 255 (slots 0-255, fetched by BINGET, are kept for the whole read: at most 256 objects).
_NEAR = 256
_SKIPPED = b"|".join(
    [b"h.", b"\x8a(?:" + b"|".join(bytes([n]) + b"." * n for n in range(9)) + b")", b"K.", b"J....", b"M..",
     b"[" + b"".join(re.escape(bytes([c])) for c in b"(012N\x88\x89)]}\x8f\x90\x91\x85\x86\x87tldeasu") + b"]",
     b"[G\x95].{8}", b"\x80.",
     b"[\x8cCU](?:" + b"|".join(re.escape(bytes([n])) + b"." * n for n in range(64)) + b")"])
# one match per scan step: skipped opcodes, then a run of memo references starting at a
# LONG_BINGET (group 1, maybe empty)
_SKIP_THEN_REFS = re.compile(b"(?:" + _SKIPPED + b")*((?:j....(?:j....|h.)*)?)", re.S)


class _Reader:
    def __init__(self, buf: mmap.mmap, source: str) -> None:
        self.buf, self.source, self.released = buf, source, 0

    def fail(self, what: str, pos: int) -> UnpicklingError:
        return UnpicklingError(f"{self.source}: corrupt or truncated pickle ({what} at byte {pos})")

    def release(self, pos: int) -> None:
        """Drop the pages before ``pos`` from this process (they stay in the page cache)."""
        upto = pos - pos % mmap.PAGESIZE
        if upto > self.released and hasattr(self.buf, "madvise"):
            self.buf.madvise(mmap.MADV_DONTNEED, 0, upto)
            self.released = upto

    def line(self, pos: int) -> tuple[bytes, int]:
        end = self.buf.find(b"\n", pos)
        if end < 0:
            raise self.fail("unterminated line", pos)
        return self.buf[pos:end], end + 1

    def forbidden(self, op: int, pos: int) -> UnsafePickleError:
        name = _FORBIDDEN_NAMES[bytes([op])]
        what = name
        if op == ord("c") or op == ord("i"):  # GLOBAL/INST name module and class on two lines
            mod, p = self.line(pos + 1)
            cls, _ = self.line(p)
            what = f"{name} {mod.decode('latin1')}.{cls.decode('latin1')}"
        return UnsafePickleError(f"{self.source}: pickle uses {what} (it would import or call code); "
                                 "only plain data (dict, list, tuple, str, bytes, numbers, bool, None) is accepted")


class _Fetches:
    """The last fetch of every memo slot, gathered in bulk: the slots of each run of memo
    references go into one flat array, with (run length, run end), and are folded into ``last``
    with numpy a chunk at a time."""

    CHUNK = 1 << 18  # slots per fold: bounds the temporary arrays to a few MB

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots, self.runs = array("q"), array("q")
        self.last = np.full(1 << 16, -1, dtype=np.int64)

    def fold(self, count: int) -> None:
        if count > len(self.last):  # grown in steps, not doubled: the result is a view of it
            grown = np.full(count + (1 << 20), -1, dtype=np.int64)
            grown[:len(self.last)] = self.last
            self.last = grown
        if not self.slots:
            return
        idx = np.frombuffer(self.slots, dtype=np.int64)
        runs = np.frombuffer(self.runs, dtype=np.int64).reshape(-1, 2)
        if int(idx.max()) >= count:
            raise ValueError(f"memo slot {int(idx.max())} fetched before it is set")
        np.maximum.at(self.last, idx, np.repeat(runs[:, 1], runs[:, 0]))
        del idx, runs
        self.slots, self.runs = array("q"), array("q")

    def result(self, count: int) -> np.ndarray:
        self.fold(count)
        last = self.last[:count]
        last[:_NEAR] = self.size + 1  # BINGET slots, which the scan skips: kept all along
        return last


def scan(reader: _Reader) -> np.ndarray:
    """Pass 1: every opcode allowed; for each memo slot the byte offset just past its last fetch
    (-1: never fetched; slots below 256 are marked as always needed)."""
    buf, kind, step = reader.buf, _KIND, _SKIP_THEN_REFS.match
    fetches = _Fetches(len(buf))
    slots, runs = fetches.slots, fetches.runs
    n, pos, count = len(buf), 0, 0
    unpack_from = struct.unpack_from
    try:
        while True:
            m = step(buf, pos)
            start, end = m.span(1)
            if end > start:  # memo references, usually a frames list
                got = refs(buf[start:end])
                slots.extend(got)
                runs.append(len(got))
                runs.append(end)
                pos = end
                if len(slots) > fetches.CHUNK:
                    fetches.fold(count)
                    slots, runs = fetches.slots, fetches.runs
                    if pos - reader.released > _RELEASE_BYTES:
                        reader.release(pos)
                continue
            pos = end
            op = buf[pos]
            k = kind[op]
            if k == _PUT:
                if op == 0x94:
                    i, pos = count, pos + 1
                elif op == 113:
                    i, pos = buf[pos + 1], pos + 2
                elif op == 114:
                    i, pos = unpack_from("<I", buf, pos + 1)[0], pos + 5
                else:
                    text, pos = reader.line(pos + 1)
                    i = int(text)
                if i == count:
                    count += 1
                elif not 0 <= i < count:
                    raise reader.fail(f"memo slot {i} set out of order", pos)
            elif op == 106:
                raise reader.fail("LONG_BINGET without its argument", pos)
            elif k >= 0:  # an argument the skip pattern does not cover (a longer LONG1 or string)
                pos += 1 + k
            elif k == _GET:  # GET (text), protocol 0: noted as a one-op span of its own
                text, end = reader.line(pos + 1)
                i = int(text)
                if not 0 <= i < count:
                    raise reader.fail(f"memo slot {i} fetched before it is set", pos)
                slots.append(i)
                runs.append(1)
                runs.append(end)
                pos = end
            elif k == _VAR:
                fmt, size = _LEN[op]
                length = unpack_from(fmt, buf, pos + 1)[0]
                pos += 1 + size + length
                if length < 0 or pos > n:
                    raise reader.fail(f"argument of {length} bytes", pos)
            elif k == _LINE:
                pos = reader.line(pos + 1)[1]
            elif k == _STOP:
                return fetches.result(count)
            elif k == _FORBIDDEN:
                raise reader.forbidden(op, pos)
            else:
                raise reader.fail(f"unknown opcode 0x{op:02x}", pos)
    except (IndexError, struct.error, ValueError) as e:
        raise reader.fail(f"{type(e).__name__}: {e}", pos) from None


def prefixes(watch: Mapping[tuple, OnItems]) -> set[tuple]:
    """The paths of the lists that can lead to a watched pattern (every proper prefix of one)."""
    return {p[:i] for p in watch for i in range(len(p))}


def machine() -> str:
    """The pickle machine in use: "native" or "python" (see READER_ENV)."""
    from tracekit.ingest.common import IngestError  # (ingest reports it as the file's failure)

    want = os.environ.get(READER_ENV, "").strip().lower()
    if want not in ("", "native", "python"):
        raise IngestError(f"{READER_ENV}={want!r}: expected 'native' or 'python'")
    if want == "native" and not AVAILABLE:
        raise IngestError(f"{READER_ENV}=native, but tracekit.ingest.unpickle._pickle_machine is not built "
                          "(reinstall tracekit where a C compiler is available)")
    return want or ("native" if AVAILABLE else "python")


def read(path: str | Path, watch: Mapping[tuple, OnItems], batch: int = 1024) -> Any:
    """The pickle's top object, with the items of watched lists given to their callbacks instead
    of stored (those lists come back empty). Raises UnsafePickleError for anything but plain data
    and UnpicklingError (naming ``path``) for a corrupt or truncated file."""
    native = machine() == "native"
    p = Path(path)
    with open(p, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise UnpicklingError(f"{p}: empty file") from None
    try:
        reader = _Reader(buf, str(p))
        if native:
            watch = dict(watch)
            return _pickle_machine.read(reader, watch, max(-1, min(batch, sys.maxsize)),  # a C ssize_t
                                         prefixes(watch), decode_line_string)
        from tracekit.ingest.unpickle.build import build

        last = scan(reader)
        reader.released = 0
        return build(reader, last, dict(watch), batch)
    finally:
        buf.close()


def decode_line_string(data: bytes, op: int) -> str:
    """STRING (protocol 0 quoted) and UNICODE (raw-unicode-escape) arguments."""
    if op == ord("V"):
        return str(data, "raw-unicode-escape")
    if len(data) < 2 or data[:1] != data[-1:] or data[:1] not in (b'"', b"'"):
        raise ValueError("the STRING opcode argument must be quoted")
    return codecs.escape_decode(data[1:-1])[0].decode("ascii")
