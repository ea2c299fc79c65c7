"""Kineto's event array through the native scanner (``_kineto_scan.c``) into Arrow record batches.

``EventSink`` is what ``jsonsplit.stream_events`` writes the array's bytes to: it hands them to
the scanner in pieces of a few MiB (the scanner consumes whole events and the rest waits for the
next piece), and every ``BATCH_ROWS`` rows it passes a record batch with the schema of
``kineto.COLUMNS`` to a callback (kineto_rows reduces it to the store's columns). Memory stays
bounded by a piece plus a batch, whatever the file's size. The scanner runs without the GIL, so worker
threads scan in parallel.

The extension is optional (pyproject.toml builds it when a C compiler is there); without it,
``AVAILABLE`` is False and kineto.py reads the array with DuckDB's JSON reader instead, which
gives the same batches (tests/test_ingest_scan.py holds both to that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pyarrow as pa

from tracekit.ingest import limits
from tracekit.ingest.common import IngestError

try:
    from tracekit.ingest._kineto_scan import Scanner
except ImportError:  # built without a C compiler: kineto.py falls back to DuckDB's reader
    Scanner = None

AVAILABLE = Scanner is not None
PIECE = 4 << 20  # bytes handed to the scanner at a time
BATCH_ROWS = 122_880  # one DuckDB row group per append
TEXT, REAL, OBJECT = 0, 1, 2
_TYPES = {"VARCHAR": (TEXT, pa.string()), "DOUBLE": (REAL, pa.float64())}


class ScanError(IngestError):
    """The event array is not well-formed JSON; the message names the file and the byte."""


def _fields(columns: dict[str, str | dict[str, str]]) -> tuple[list[tuple[int, str, int]], pa.Schema]:
    """The scanner's field list and the batches' schema for columns given as {key: DuckDB type},
    where a nested {key: type} dict is an object field (such as ``args``)."""
    spec: list[tuple[int, str, int]] = []
    schema: list[pa.Field] = []
    for key, typ in columns.items():
        if isinstance(typ, dict):
            parent = len(spec)
            spec.append((-1, key, OBJECT))
            children = []
            for k, t in typ.items():
                spec.append((parent, k, _TYPES[t][0]))
                children.append(pa.field(k, _TYPES[t][1]))
            schema.append(pa.field(key, pa.struct(children)))
        else:
            spec.append((-1, key, _TYPES[typ][0]))
            schema.append(pa.field(key, _TYPES[typ][1]))
    return spec, pa.schema(schema)


def schema(columns: dict[str, str | dict[str, str]]) -> pa.Schema:
    """The Arrow schema of the batches for ``columns`` (as in ``_fields``)."""
    return _fields(columns)[1]


class EventSink:
    """A binary file-like sink for the event array's text; ``close`` checks that the array ended."""

    def __init__(self, path: Path, columns: dict[str, str | dict[str, str]], on_batch: Callable[[pa.RecordBatch], None],
                 keep: tuple[str, str] | None = None, max_event_bytes: int | None = None) -> None:
        if Scanner is None:
            raise RuntimeError("tracekit.ingest._kineto_scan is not built")
        self.path, self.on_batch = path, on_batch
        self.max_event_bytes = max_event_bytes or limits.get("max_event_bytes")
        self.spec, self.schema = _fields(columns)
        flt = None
        if keep is not None:
            flt = ([k for _, k, _ in self.spec].index(keep[0]), keep[1])
        self.scanner = Scanner(self.spec, flt)
        self.buf = bytearray()
        self.batches = 0

    def write(self, data: bytes | memoryview) -> int:
        self.buf += data
        if len(self.buf) >= PIECE:
            self._feed(final=False)
        return len(data)

    def close(self) -> None:
        """Scan what is left; the array must be complete. Emits the last batch (possibly empty, so
        that the callback always sees at least one)."""
        self._feed(final=True)
        if self.scanner.rows or not self.batches:
            self._emit()

    def _feed(self, final: bool) -> None:
        try:
            used = self.scanner.feed(self.buf, final)
        except ValueError as e:
            raise ScanError(f"{self.path}: malformed trace events ({e})") from None
        del self.buf[:used]  # bytearray drops a prefix without moving the rest
        if len(self.buf) > self.max_event_bytes:
            raise limits.exceeded(self.path, "max_event_bytes",
                                  f"event {self.scanner.events} is still incomplete after {len(self.buf):,} bytes",
                                  self.max_event_bytes)
        if self.scanner.rows >= BATCH_ROWS:
            self._emit()

    def _emit(self) -> None:
        rows, cols = self.scanner.take()
        arrays, i = [], 0
        for field in self.schema:
            if pa.types.is_struct(field.type):
                valid, _, _, nulls = cols[i]
                kids = []
                for j in range(field.type.num_fields):
                    kids.append(self._array(field.type.field(j).type, rows, cols[i + 1 + j]))
                arrays.append(pa.StructArray.from_buffers(field.type, rows, [_buffer(valid)], null_count=nulls,
                                                          children=kids))
                i += 1 + field.type.num_fields
            else:
                arrays.append(self._array(field.type, rows, cols[i]))
                i += 1
        self.batches += 1
        self.on_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))

    @staticmethod
    def _array(typ: pa.DataType, rows: int, col: tuple) -> pa.Array:
        valid, offsets, data, nulls = col
        bufs = [_buffer(valid)] + ([pa.py_buffer(offsets)] if offsets is not None else []) + [pa.py_buffer(data)]
        return pa.Array.from_buffers(typ, rows, bufs, null_count=nulls)


def _buffer(b: bytes | None) -> pa.Buffer | None:
    return None if b is None else pa.py_buffer(b)
