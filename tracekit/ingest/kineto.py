"""Kineto (PyTorch profiler) Chrome traces into events, steps, collectives and p2p.

Columnar end to end: the file's ``traceEvents`` array is streamed out (jsonsplit, hashing on the
way) to the native scanner (kineto_scan: Arrow batches; DuckDB's JSON reader where it is not
built), and the X events go into one scratch table ``raw`` with the columns the store needs;
steps, launches and the communication tables are small SQL over it (kineto_comm), and the store's
rows are inserted straight from these tables at commit (common.Query): no Python object per event.
Python only sees the few distinct ``tk.*`` span names, which it parses with tracekit.conventions
(the one parser).

The step of an event is the ``ProfilerStep#N`` span containing it; a GPU event takes the step of
the runtime call that launched it (same ``correlation``), since kernels run after their launch.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

import duckdb
import pyarrow as pa

from tracekit import classify
from tracekit.ingest import kineto_comm, kineto_scan
from tracekit.ingest.common import IngestError, Parsed, Query
from tracekit.ingest.jsonsplit import Hasher, TraceFormatError, stream_events

# Event args read (as text) for communication events, kept in ``raw.comm_args`` as JSON (NULL
# elsewhere): one narrow column instead of one mostly-NULL column per arg.
ARGS = ("Collective name", "Process Group Name", "Process Group Description", "Process Group Ranks",
        "In msg nelems", "Out msg nelems", "dtype", "Seq", "seq_num", "External id", "Dst Rank", "Src Rank",
        "Rank", "Global rank start", "Global rank stride")
# The fields read from each event, for both readers (a dict is an object field).
COLUMNS: dict[str, str | dict[str, str]] = {
    "ph": "VARCHAR", "cat": "VARCHAR", "name": "VARCHAR", "pid": "VARCHAR", "tid": "VARCHAR",
    "ts": "DOUBLE", "dur": "DOUBLE",
    "args": {"correlation": "VARCHAR", **{k: "VARCHAR" for k in ARGS}},
}
# "native": the C scanner (kineto_scan), "duckdb": DuckDB's JSON reader; the default is the scanner
# when it is built. Both give the same rows; the scanner reads about 2.2x faster (docs/ingest.md).
READER_ENV = "TRACEKIT_KINETO_READER"
KINDS = {
    "cpu_op": "cpu_op", "user_annotation": "user_annotation", "gpu_user_annotation": "gpu_annotation",
    "kernel": "kernel", "cuda_runtime": "runtime", "cuda_driver": "runtime", "gpu_memcpy": "memcpy",
    "gpu_memset": "memset", "python_function": "python",
}
GPU_KINDS = "('kernel', 'memcpy', 'memset', 'gpu_annotation')"
MAX_EVENT_BYTES = 16 << 20  # one event larger than this is not a profiler event


def _case(expr: str, mapping: dict) -> str:
    whens = " ".join(f"WHEN '{k}' THEN '{v}'" for k, v in mapping.items())
    return f"(CASE {expr} {whens} ELSE {expr} END)"


def _duckdb_type(t: str | dict[str, str]) -> str:
    if isinstance(t, dict):
        return "STRUCT(" + ", ".join(f'"{k}" {v}' for k, v in t.items()) + ")"
    return t


def _reader(source: str) -> str:
    cols = "{" + ", ".join(f"{k}: '{_duckdb_type(v)}'" for k, v in COLUMNS.items()) + "}"
    source = source.replace("'", "''")
    return (f"read_json('{source}', format='array', columns={cols}, "
            f"maximum_object_size={MAX_EVENT_BYTES})")


def _load_sql(ns: str, relation: str, create: bool = True) -> str:
    """The X events (minus the profiler's own 'Trace' span) of ``relation`` (events with the
    fields of COLUMNS) into ``raw``: a new table, or appended to it.

    ``ts_ns`` is relative to the trace's ``baseTimeNanoseconds``, which usually follows the event
    array and so is known only after this pass; the store's rows add it.
    """
    into = f"CREATE TABLE {ns}.raw AS" if create else f"INSERT INTO {ns}.raw"
    return f"""
        {into} SELECT kind, name, tid, pid, ts_ns, dur_ns, correlation, is_comm,
                                        CASE WHEN is_comm THEN to_json(args) END AS comm_args
        FROM (SELECT {_case('cat', KINDS)} AS kind, name, tid, TRY_CAST(pid AS BIGINT) AS pid,
                     CAST(floor(ts) AS BIGINT) * 1000 + CAST(round((ts - floor(ts)) * 1000) AS BIGINT)
                         AS ts_ns,
                     CAST(round(coalesce(dur, 0) * 1000) AS BIGINT) AS dur_ns,
                     TRY_CAST(args.correlation AS BIGINT) AS correlation,
                     {classify.sql_is_comm('name')} AS is_comm, args
              FROM {relation}
              WHERE ph = 'X' AND cat IS DISTINCT FROM 'Trace')
    """


def reader() -> str:
    """The event-array reader in use: "native" or "duckdb" (see READER_ENV)."""
    want = os.environ.get(READER_ENV, "").strip().lower()
    if want not in ("", "native", "duckdb"):
        raise IngestError(f"{READER_ENV}={want!r}: expected 'native' or 'duckdb'")
    if want == "native" and not kineto_scan.AVAILABLE:
        raise IngestError(f"{READER_ENV}=native, but tracekit.ingest._kineto_scan is not built "
                          "(reinstall tracekit where a C compiler is available)")
    return want or ("native" if kineto_scan.AVAILABLE else "duckdb")


def load_events(con: duckdb.DuckDBPyConnection, ns: str, path: Path, hasher: Hasher) -> dict:
    """Create table ``<ns>.raw`` from the trace at ``path``; return its top-level keys."""
    try:
        if reader() == "native":
            return _load_scanned(con, ns, path, hasher)
        return _load_duckdb(con, ns, path, hasher)
    except duckdb.OutOfMemoryException as e:
        raise IngestError(f"{path}: out of memory while reading the trace events "
                          f"({str(e).splitlines()[0]})") from None
    except duckdb.Error as e:
        raise IngestError(f"{path}: malformed trace events ({str(e).splitlines()[0]})") from None


def _load_scanned(con: duckdb.DuckDBPyConnection, ns: str, path: Path, hasher: Hasher) -> dict:
    """The array streamed through the native scanner; each record batch appended to ``raw``."""
    view = "tk_events_" + ns.replace(".", "_")
    first = True

    def append(batch: pa.RecordBatch) -> None:
        nonlocal first
        con.register(view, batch)
        try:
            con.execute(_load_sql(ns, view, create=first))
        finally:
            con.unregister(view)
        first = False

    sink = kineto_scan.EventSink(path, COLUMNS, append, keep=("ph", "X"), max_event_bytes=MAX_EVENT_BYTES)
    try:
        meta = stream_events(path, sink, hasher)
    except OSError as e:
        raise TraceFormatError(f"{path}: unreadable ({e})") from None
    sink.close()
    return meta


def _load_duckdb(con: duckdb.DuckDBPyConnection, ns: str, path: Path, hasher: Hasher) -> dict:
    """The array copied to a temporary file, hashed on the way, which DuckDB's JSON reader then
    parses: from a regular file it needs about 60 MiB less memory and less CPU than from a pipe."""
    with tempfile.TemporaryDirectory(prefix="tk-kineto-") as tmp:
        array = os.path.join(tmp, "events.json")
        try:
            with open(array, "wb") as out:
                meta = stream_events(path, out, hasher)
        except OSError as e:
            raise TraceFormatError(f"{path}: unreadable, or no room for a temporary copy ({e})") from None
        con.execute(_load_sql(ns, _reader(array)))
    return meta


def parse(path: Path, con: duckdb.DuckDBPyConnection, ns: str, hasher: Hasher | None = None) -> Parsed:
    """Parse one Kineto trace file (.json or .json.gz) into tables of the (empty) schema ``ns``;
    the returned Queries read them, from any connection to the same database."""
    meta = load_events(con, ns, path, hasher or hashlib.sha256())
    base = meta.get("baseTimeNanoseconds") or 0
    if not isinstance(base, int) or isinstance(base, bool):
        raise IngestError(f"{path}: baseTimeNanoseconds is not an integer: {base!r}")
    info = meta.get("distributedInfo") or {}
    if not isinstance(info, dict):
        raise IngestError(f"{path}: distributedInfo is not an object")
    try:
        return _normalize(con, ns, path, base, info)
    except duckdb.Error as e:
        raise IngestError(f"{path}: malformed trace events ({str(e).splitlines()[0]})") from None


EVENT_COLUMNS = ("ts_ns", "dur_ns", "kind", "name", "tid", "step", "phase", "vstage", "microbatch", "correlation",
                 "is_comm")


def _normalize(con: duckdb.DuckDBPyConnection, ns: str, path: Path, base: int, info: dict) -> Parsed:
    n_events = con.execute(f"SELECT count(*) FROM {ns}.raw").fetchall()[0][0]
    con.execute(f"""
        CREATE TABLE {ns}.steps AS SELECT step, min(ts_ns) AS start_ns, max(ts_ns + dur_ns) AS end_ns
        FROM (SELECT TRY_CAST(regexp_extract(name, '^ProfilerStep#(\\d+)$', 1) AS INTEGER) AS step, ts_ns, dur_ns
              FROM {ns}.raw WHERE kind IN ('cpu_op', 'user_annotation') AND starts_with(name, 'ProfilerStep#'))
        WHERE step IS NOT NULL GROUP BY step
    """)
    spans = con.execute(f"SELECT step, start_ns, end_ns FROM {ns}.steps ORDER BY start_ns").fetchall()
    stepped = _stepper(con, ns, spans)
    ann = kineto_comm.register_annotations(con, ns)
    comp = (f"LEFT JOIN {ns}.comp_ann c ON e.name = c.name" if ann.compute
            else "LEFT JOIN (SELECT NULL::VARCHAR AS name, NULL::VARCHAR AS phase, NULL::INTEGER AS vstage, "
                 "NULL::INTEGER AS mb) c ON false")
    events = Query(f"""
        SELECT e.ts_ns + {base} AS ts_ns, e.dur_ns,
               CASE WHEN c.name IS NOT NULL THEN 'compute'
                    WHEN starts_with(e.name, 'tk.comm ') THEN 'comm' ELSE e.kind END AS kind,
               e.name, e.tid, e.step, c.phase, c.vstage, c.mb AS microbatch, e.correlation, e.is_comm
        FROM {stepped("true")} e {comp}
    """, EVENT_COLUMNS, n_events)
    comm = kineto_comm.tables(con, ns, base, stepped, spans[0][1] if spans else None, ann)
    steps = Query(f"SELECT step, start_ns + {base} AS start_ns, end_ns + {base} AS end_ns FROM {ns}.steps",
                  ("step", "start_ns", "end_ns"), len(spans))
    pids = [int(p) for (p,) in con.execute(
        f"SELECT pid FROM {ns}.raw WHERE kind IN ('runtime', 'cpu_op', 'user_annotation') AND pid IS NOT NULL "
        "GROUP BY pid ORDER BY count(*) DESC, pid").fetchall()]
    return Parsed(format="kineto", tables={"events": events, "steps": steps, **comm}, rank=_int(info.get("rank")),
                  world_size=_int(info.get("world_size")), backend=info.get("backend"),
                  groups=kineto_comm.groups(con, ns, info, path), pids=pids)


def _stepper(con: duckdb.DuckDBPyConnection, ns: str, spans: list[tuple]) -> Callable[[str], str]:
    """``stepped(cond)``: the rows of ``raw`` matching ``cond`` with their ``step``: by launch for GPU
    events, else the profiler step whose span contains the event's start."""
    if not spans:
        return lambda cond: f"(SELECT *, CAST(NULL AS INTEGER) AS step FROM {ns}.raw WHERE {cond})"
    # Steps are few: a CASE, no join.
    by_time = "(CASE " + " ".join(f"WHEN ts_ns >= {a} AND ts_ns < {b} THEN {s}" for s, a, b in spans) + " END)"
    con.execute(f"""
        CREATE TABLE {ns}.rt AS SELECT correlation, min({by_time}) AS step
        FROM {ns}.raw WHERE kind = 'runtime' AND correlation IS NOT NULL GROUP BY correlation
    """)
    by_time_e = by_time.replace("ts_ns", "e.ts_ns")
    return lambda cond: (f"(SELECT e.*, CASE WHEN e.kind IN {GPU_KINDS} AND rt.step IS NOT NULL THEN rt.step "
                         f"ELSE {by_time_e} END AS step FROM (SELECT * FROM {ns}.raw WHERE {cond}) e "
                         f"LEFT JOIN {ns}.rt rt ON e.correlation = rt.correlation)")


def _int(v: object) -> int | None:
    try:
        return int(v) if v is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
