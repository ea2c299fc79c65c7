"""Kineto (PyTorch profiler) Chrome traces into events, steps, collectives and p2p.

Columnar end to end: the file's ``traceEvents`` array is streamed out (jsonsplit, hashing on the
way) to the native scanner (kineto_scan; DuckDB's JSON reader where it is not built), which
hands over Arrow record batches of the fields in COLUMNS. kineto_rows reduces each batch to the
store's columns (dictionary-encoded text, integer nanoseconds) and then derives steps and the
step of every event; the events go to the store as one Arrow table, and only the communication
events go on, in numpy, to the collectives and p2p tables (kineto_comm). No Python object per
event: Python sees only the distinct names, categories and threads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from tracekit.ingest import columns, kineto_comm, kineto_rows, kineto_scan, limits
from tracekit.ingest.common import IngestError, Parsed
from tracekit.ingest.jsonsplit import Hasher, TraceFormatError, stream_events

# The fields read from each event, for both readers (a dict is an object field); of args, only
# the correlation and what communication events carry (kineto_rows.COMM_FIELDS).
COLUMNS: dict[str, str | dict[str, str]] = {
    "ph": "VARCHAR", "cat": "VARCHAR", "name": "VARCHAR", "pid": "VARCHAR", "tid": "VARCHAR",
    "ts": "DOUBLE", "dur": "DOUBLE",
    "args": {"correlation": "VARCHAR", **{k: "VARCHAR" for k in kineto_rows.COMM_FIELDS.values()}},
}
# "native": the C scanner (kineto_scan), "duckdb": DuckDB's JSON reader; the default is the scanner
# when it is built. Both give the same batches; the scanner reads about 2.2x faster (docs/ingest.md).
READER_ENV = "TRACEKIT_KINETO_READER"


def _duckdb_type(t: str | dict[str, str]) -> str:
    if isinstance(t, dict):
        return "STRUCT(" + ", ".join(f'"{k}" {v}' for k, v in t.items()) + ")"
    return t


def _reader(source: str, max_event_bytes: int | None = None) -> str:
    cols = "{" + ", ".join(f"{k}: '{_duckdb_type(v)}'" for k, v in COLUMNS.items()) + "}"
    source = source.replace("'", "''")
    return (f"read_json('{source}', format='array', columns={cols}, "
            f"maximum_object_size={max_event_bytes or limits.get('max_event_bytes')})")


def reader() -> str:
    """The event-array reader in use: "native" or "duckdb" (see READER_ENV)."""
    want = os.environ.get(READER_ENV, "").strip().lower()
    if want not in ("", "native", "duckdb"):
        raise IngestError(f"{READER_ENV}={want!r}: expected 'native' or 'duckdb'")
    if want == "native" and not kineto_scan.AVAILABLE:
        raise IngestError(f"{READER_ENV}=native, but tracekit.ingest._kineto_scan is not built "
                          "(reinstall tracekit where a C compiler is available)")
    return want or ("native" if kineto_scan.AVAILABLE else "duckdb")


def read_events(con: duckdb.DuckDBPyConnection, path: Path, hasher: Hasher | None,
                on_batch: Callable[[pa.RecordBatch], None]) -> dict:
    """Pass the trace's X events to ``on_batch`` as record batches with the fields of COLUMNS;
    return the file's top-level keys. The limits max_events and max_event_bytes hold on both readers."""
    max_events, seen = limits.get("max_events"), 0

    def counted(batch: pa.RecordBatch) -> None:
        nonlocal seen
        seen += batch.num_rows
        if seen > max_events:
            raise limits.exceeded(path, "max_events", f"at least {seen:,} complete events")
        on_batch(batch)

    try:
        if reader() == "native":
            return _read_scanned(path, hasher, counted)
        return _read_duckdb(con, path, hasher, counted)
    except duckdb.OutOfMemoryException as e:
        raise IngestError(f"{path}: out of memory while reading the trace events "
                          f"({str(e).splitlines()[0]})") from None
    except duckdb.Error as e:
        if "maximum_object_size" in str(e):
            raise limits.exceeded(path, "max_event_bytes", "an event is larger") from None
        raise IngestError(f"{path}: malformed trace events ({str(e).splitlines()[0]})") from None


def _read_scanned(path: Path, hasher: Hasher | None, on_batch: Callable[[pa.RecordBatch], None]) -> dict:
    sink = kineto_scan.EventSink(path, COLUMNS, on_batch, keep=("ph", "X"))
    try:
        meta = stream_events(path, sink, hasher)
    except OSError as e:
        raise TraceFormatError(f"{path}: unreadable ({e})") from None
    sink.close()
    return meta


def _read_duckdb(con: duckdb.DuckDBPyConnection, path: Path, hasher: Hasher | None,
                 on_batch: Callable[[pa.RecordBatch], None]) -> dict:
    """The array copied to a temporary file, hashed on the way, which DuckDB's JSON reader then
    parses: from a regular file it needs about 60 MiB less memory and less CPU than from a pipe."""
    schema = kineto_scan.schema(COLUMNS)
    from tracekit.ingest.procs import temporary_folder

    with temporary_folder("tk-kineto-") as tmp:
        array = os.path.join(tmp, "events.json")
        try:
            with open(array, "wb") as out:
                meta = stream_events(path, out, hasher)
        except OSError as e:
            raise TraceFormatError(f"{path}: unreadable, or no room for a temporary copy ({e})") from None
        names = ", ".join(f'"{k}"' for k in COLUMNS)
        rel = con.sql(f"SELECT {names} FROM {_reader(array)} WHERE ph = 'X'")
        # to_arrow_reader in recent DuckDB (2.0 deprecates fetch_record_batch); older ones lack it
        arrow_reader = getattr(rel, "to_arrow_reader", None) or rel.fetch_record_batch
        for batch in arrow_reader(kineto_scan.BATCH_ROWS):
            on_batch(batch if batch.schema == schema else batch.cast(schema))
    return meta


def parse(path: Path, con: duckdb.DuckDBPyConnection, hasher: Hasher | None = None) -> Parsed:
    """Parse one Kineto trace file (.json or .json.gz) into events, steps, collectives and p2p as
    Arrow tables. ``con`` (the worker's own cursor) reads the events where the scanner is not
    built, and evaluates DuckDB's TRY_CAST for args that are not plain integers."""
    rows = kineto_rows.EventRows(con, str(path))
    meta = read_events(con, path, hasher, rows.add)
    base = meta.get("baseTimeNanoseconds") or 0
    if not isinstance(base, int) or isinstance(base, bool):
        raise IngestError(f"{path}: baseTimeNanoseconds is not an integer: {base!r}")
    info = meta.get("distributedInfo") or {}
    if not isinstance(info, dict):
        raise IngestError(f"{path}: distributedInfo is not an object")
    built = rows.build()
    try:  # times on the epoch: the base usually follows the event array, so is known only now
        events = built.events.set_column(0, "ts_ns", pc.add_checked(built.events.column("ts_ns"), columns.scalar(base, pa.int64())))
        steps = columns.table({
            "step": columns.from_values([s.step for s in built.steps], pa.int32(), "steps.step"),
            **{k: columns.from_values([None if getattr(s, k) is None else getattr(s, k) + base for s in built.steps],
                                      pa.int64(), f"steps.{k}") for k in ("start_ns", "end_ns")}})
    except (pa.ArrowInvalid, OverflowError) as e:
        raise IngestError(f"{path}: malformed trace events (a time out of range: {e})") from None
    comm = kineto_comm.CommEvents(built.comm, con, path)
    first_step_ns = built.steps[0].start_ns if built.steps else None
    return Parsed(format="kineto",
                  tables={"events": events, "steps": steps,
                          **kineto_comm.tables(comm, base, first_step_ns, built.comm_annotations)},
                  rank=_int(info.get("rank")), world_size=_int(info.get("world_size")), backend=info.get("backend"),
                  groups=kineto_comm.groups(comm, built.comm_annotations, info, path), pids=built.pids)


def _int(v: object) -> int | None:
    try:
        return int(v) if v is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
