"""Kineto (PyTorch profiler) Chrome traces, NCCL and gloo flavours, into events/collectives/p2p/steps.

Columnar all the way: the traceEvents array is copied out (jsonsplit) and parsed by DuckDB's JSON
reader with an explicit column list, and every normalization is one SQL statement. Python only sees
the few distinct ``tk.*`` span names, which it parses with tracekit.conventions (the one parser).

Sources of collectives, by flavour (FORMATS.md section 1):
- NCCL: GPU kernels (``ncclKernel_*``/``ncclDevKernel_*``) with their ``Collective name``,
  ``Process Group *`` and message-size args; sequence numbers from ``Seq``/``seq_num`` args when
  present, else the kernel's order within its group in this trace.
- gloo with the trainer's ``tk.comm`` spans: group, sequence, size and dtype from the span name,
  times from the span (the comm layer waits inside it).
- gloo without annotations: the ``gloo:*`` worker spans; the group is unknown (NULL) and ``seq`` is
  the op's order on the rank (gloo spreads one group's ops over several worker threads).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import duckdb
import pyarrow as pa

from tracekit import classify
from tracekit.conventions import COMM_PREFIX, COMPUTE_PREFIX, ConventionError, parse_comm, parse_compute
from tracekit.ingest.common import IngestError, Parsed, arrow_schema
from tracekit.ingest.jsonsplit import split_trace

ARGS = {
    "Collective name": "VARCHAR", "Process Group Name": "VARCHAR",
    "Process Group Description": "VARCHAR", "Process Group Ranks": "VARCHAR",
    "In msg nelems": "VARCHAR", "Out msg nelems": "VARCHAR", "dtype": "VARCHAR",
    "Seq": "VARCHAR", "seq_num": "VARCHAR", "correlation": "VARCHAR",
}
COLUMNS = {
    "ph": "VARCHAR", "cat": "VARCHAR", "name": "VARCHAR", "pid": "VARCHAR", "tid": "VARCHAR",
    "ts": "DOUBLE", "dur": "DOUBLE",
    "args": "STRUCT(" + ", ".join(f'"{k}" {t}' for k, t in ARGS.items()) + ")",
}
KINDS = {
    "cpu_op": "cpu_op", "user_annotation": "user_annotation", "gpu_user_annotation": "gpu_annotation",
    "kernel": "kernel", "cuda_runtime": "runtime", "cuda_driver": "runtime", "gpu_memcpy": "memcpy",
    "gpu_memset": "memset", "python_function": "python",
}
GPU_KINDS = ("kernel", "memcpy", "memset", "gpu_annotation")
GLOO_SPANS = "SELECT * FROM x WHERE is_comm AND starts_with(name, 'gloo:')"
DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
    "char": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def _case(expr: str, mapping: dict, default: str = "NULL") -> str:
    whens = " ".join(f"WHEN '{k}' THEN {v!r}" if isinstance(v, str) else f"WHEN '{k}' THEN {v}"
                     for k, v in mapping.items())
    return f"(CASE {expr} {whens} ELSE {default} END)"


def _connect(tmpdir: str) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:", config={"threads": 1, "preserve_insertion_order": False})
    con.execute("SET enable_progress_bar = false")
    con.execute(f"SET temp_directory='{tmpdir}'")
    con.execute("SET memory_limit='96MB'")  # spill rather than grow: many of these run at once
    return con


def parse(path: Path) -> Parsed:
    """Parse one Kineto trace file (.json or .json.gz)."""
    with tempfile.TemporaryDirectory(prefix="tk-kineto-") as tmp:
        array_path = os.path.join(tmp, "events.json")
        with open(array_path, "wb") as out:
            meta = split_trace(path, out)
        con = _connect(tmp)
        try:
            return _normalize(con, array_path, meta, path)
        except duckdb.Error as e:
            raise IngestError(f"{path}: malformed trace events ({str(e).splitlines()[0]})") from None
        finally:
            con.close()


def _normalize(con: duckdb.DuckDBPyConnection, array_path: str, meta: dict, path: Path) -> Parsed:
    base = meta.get("baseTimeNanoseconds") or 0
    if not isinstance(base, int):
        raise IngestError(f"{path}: baseTimeNanoseconds is not an integer: {base!r}")
    cols = "{" + ", ".join(f"{k}: '{v}'" for k, v in COLUMNS.items()) + "}"
    kind = _case("cat", {k: v for k, v in KINDS.items()}, "cat")
    a = "args"
    # One pass over the JSON into an Arrow table of the columns we keep; everything after that
    # (steps, launches, comm, the final events with their step) is DuckDB scanning Arrow in memory.
    con.execute(f"""
        CREATE TEMP VIEW src AS SELECT
            {kind} AS kind, name, tid, TRY_CAST(pid AS BIGINT) AS pid,
            CAST(floor(ts) AS BIGINT) * 1000 + CAST(round((ts - floor(ts)) * 1000) AS BIGINT) + {base} AS ts_ns,
            CAST(round(coalesce(dur, 0) * 1000) AS BIGINT) AS dur_ns,
            TRY_CAST({a}.correlation AS BIGINT) AS correlation,
            {classify.sql_is_comm('name')} AS is_comm,
            {a}."Collective name" AS coll, {a}."Process Group Name" AS pg,
            {a}."Process Group Description" AS pg_desc, {a}."Process Group Ranks" AS pg_ranks,
            greatest(TRY_CAST({a}."In msg nelems" AS BIGINT), TRY_CAST({a}."Out msg nelems" AS BIGINT)) AS nelems,
            {a}.dtype AS dtype,
            coalesce(TRY_CAST({a}."Seq" AS BIGINT), TRY_CAST({a}.seq_num AS BIGINT)) AS seq
        FROM read_json('{array_path}', format='array', columns={cols}, maximum_object_size=16777216)
        WHERE ph = 'X' AND cat IS DISTINCT FROM 'Trace'
    """)
    raw = con.sql("SELECT * FROM src").to_arrow_table()
    con.register("raw", raw)
    con.execute(f"""
        CREATE TEMP TABLE x AS SELECT * FROM raw
        WHERE kind = 'runtime' OR is_comm OR starts_with(name, 'ProfilerStep#') OR starts_with(name, 'tk.')
    """)
    con.execute("""
        CREATE TEMP TABLE steps AS SELECT step, min(ts_ns) AS start_ns, max(ts_ns + dur_ns) AS end_ns
        FROM (SELECT TRY_CAST(regexp_extract(name, '^ProfilerStep#(\\d+)$', 1) AS INTEGER) AS step, ts_ns, dur_ns
              FROM x WHERE kind IN ('cpu_op', 'user_annotation') AND starts_with(name, 'ProfilerStep#'))
        WHERE step IS NOT NULL GROUP BY step
    """)
    step_of = _step_expr(con)
    # Step of a GPU event = step of the runtime call that launched it (kernels run after their launch).
    con.execute(f"""
        CREATE TEMP TABLE rt AS SELECT correlation, min({step_of}) AS step
        FROM x WHERE kind = 'runtime' AND correlation IS NOT NULL GROUP BY correlation
    """)
    _register_annotations(con)
    has_ann = con.execute("SELECT count(*) FROM comm_ann").fetchall()[0][0] > 0
    kop = f"coalesce({classify.sql_normalize_op('coll')}, {classify.sql_kernel_op('name')})"
    stepped = _stepper(step_of)
    con.execute(f"CREATE TEMP TABLE ck AS SELECT *, {kop} AS op FROM "
                + stepped("SELECT * FROM x WHERE kind = 'kernel' AND is_comm"))
    tables = {
        "events": _events(con, stepped),
        "steps": con.sql("SELECT step, start_ns, end_ns FROM steps ORDER BY step").to_arrow_table(),
        "collectives": _collectives(con, has_ann, stepped),
        "p2p": _p2p(con, has_ann, stepped),
    }
    for name, t in tables.items():
        tables[name] = t.cast(arrow_schema(name))
    info = meta.get("distributedInfo") or {}
    if not isinstance(info, dict):
        raise IngestError(f"{path}: distributedInfo is not an object")
    pids = [int(p) for (p,) in con.execute(
        "SELECT DISTINCT pid FROM x WHERE kind IN ('runtime', 'cpu_op', 'user_annotation') "
        "AND pid IS NOT NULL").fetchall()]
    return Parsed(
        format="kineto", tables=tables, rank=_int(info.get("rank")), world_size=_int(info.get("world_size")),
        backend=info.get("backend"), groups=_groups(con, info, path), pids=pids,
    )


def _int(v: object) -> int | None:
    try:
        return int(v) if v is not None else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _register_annotations(con: duckdb.DuckDBPyConnection) -> None:
    """Parse the distinct tk.comm / tk.compute span names with the convention's own parser."""
    names = [n for (n,) in con.execute(
        f"SELECT DISTINCT name FROM x WHERE starts_with(name, '{COMM_PREFIX}') "
        f"OR starts_with(name, '{COMPUTE_PREFIX}')").fetchall()]
    comm, comp = [], []
    for n in names:
        try:
            c = parse_comm(n)
            if c is not None:
                comm.append({"name": n, "op": classify.normalize_op(c.op), "pg": c.pg, "dim": c.dim,
                             "seq": c.seq, "ranks": list(c.ranks), "nbytes": c.nbytes,
                             "dtype": c.dtype, "peer": c.peer})
                continue
            p = parse_compute(n)
            if p is not None:
                comp.append({"name": n, "phase": p.phase, "vstage": p.vstage, "mb": p.mb})
        except ConventionError:
            continue  # a malformed annotation stays a plain event; it carries no comm metadata
    comm_ann = pa.Table.from_pylist(comm, schema=pa.schema([
        ("name", pa.string()), ("op", pa.string()), ("pg", pa.string()), ("dim", pa.string()),
        ("seq", pa.int64()), ("ranks", pa.list_(pa.int32())), ("nbytes", pa.int64()),
        ("dtype", pa.string()), ("peer", pa.int32())]))
    comp_ann = pa.Table.from_pylist(comp, schema=pa.schema([
        ("name", pa.string()), ("phase", pa.string()), ("vstage", pa.int32()), ("mb", pa.int32())]))
    con.register("comm_ann_arrow", comm_ann)
    con.register("comp_ann_arrow", comp_ann)
    con.execute("CREATE TEMP TABLE comm_ann AS SELECT * FROM comm_ann_arrow")
    con.execute("CREATE TEMP TABLE comp_ann AS SELECT * FROM comp_ann_arrow")


def _step_expr(con: duckdb.DuckDBPyConnection) -> str:
    """SQL giving the profiler step whose span contains ``ts_ns`` (steps are few: a CASE, no join)."""
    spans = con.execute("SELECT step, start_ns, end_ns FROM steps ORDER BY start_ns").fetchall()
    if not spans:
        return "CAST(NULL AS INTEGER)"
    whens = " ".join(f"WHEN ts_ns >= {a} AND ts_ns < {b} THEN {s}" for s, a, b in spans)
    return f"(CASE {whens} END)"


def _stepper(step_of: str) -> Callable[[str], str]:
    gpu = "(" + ", ".join(f"'{k}'" for k in GPU_KINDS) + ")"

    def stepped(query: str) -> str:
        """``query``'s rows with their step: by launch for GPU events, else by time."""
        return f"""(SELECT q.*, CASE WHEN q.kind IN {gpu} AND rt.step IS NOT NULL THEN rt.step
                                  ELSE {step_of.replace('ts_ns', 'q.ts_ns')} END AS step
                   FROM ({query}) q LEFT JOIN rt ON q.kind IN {gpu} AND q.correlation = rt.correlation)"""
    return stepped


def _events(con: duckdb.DuckDBPyConnection, stepped: Callable[[str], str]) -> pa.Table:
    return con.sql(f"""
        SELECT e.ts_ns, e.dur_ns,
               CASE WHEN c.name IS NOT NULL THEN 'compute'
                    WHEN starts_with(e.name, 'tk.comm ') THEN 'comm' ELSE e.kind END AS kind,
               e.name, e.tid, e.step, c.phase, c.vstage, c.mb AS microbatch, e.correlation, e.is_comm
        FROM {stepped("SELECT * FROM raw")} e LEFT JOIN comp_ann c ON e.name = c.name
    """).to_arrow_table()


def _nbytes(nelems: str, dtype: str) -> str:
    return f"{nelems} * {_case(f'lower({dtype})', DTYPE_BYTES)}"


def _collectives(con: duckdb.DuckDBPyConnection, has_ann: bool, stepped: Callable[[str], str]) -> pa.Table:
    span_op = classify.sql_span_op("name")
    parts = [f"""
        SELECT pg AS pg_name, coalesce(seq, row_number() OVER (PARTITION BY pg ORDER BY ts_ns) - 1) AS seq,
               op, ts_ns AS start_ns, ts_ns + dur_ns AS end_ns, {_nbytes('nelems', 'dtype')} AS nbytes,
               dtype, step, 'kernel' AS source
        FROM ck WHERE op IS NOT NULL AND NOT {classify.sql_is_p2p('op')}
    """]
    if has_ann:
        parts.append(f"""
            SELECT a.pg, a.seq, a.op, e.ts_ns, e.ts_ns + e.dur_ns, a.nbytes, a.dtype, e.step, 'annotation'
            FROM {stepped("SELECT * FROM x WHERE starts_with(name, 'tk.comm ')")} e JOIN comm_ann a
              ON e.name = a.name WHERE a.peer IS NULL AND a.op NOT IN ('send', 'recv')
        """)
    else:
        parts.append(f"""
            SELECT NULL, row_number() OVER (PARTITION BY op ORDER BY ts_ns) - 1, op, ts_ns, ts_ns + dur_ns,
                   NULL, NULL, step, 'gloo'
            FROM (SELECT *, {span_op} AS op FROM {stepped(GLOO_SPANS + " AND kind = 'user_annotation'")})
            WHERE NOT {classify.sql_is_p2p('op')}
        """)
    return con.sql(" UNION ALL ".join(parts) + " ORDER BY start_ns").to_arrow_table()


def _p2p(con: duckdb.DuckDBPyConnection, has_ann: bool, stepped: Callable[[str], str]) -> pa.Table:
    direction = "CASE op WHEN 'send' THEN 'send' WHEN 'recv' THEN 'recv' END"
    parts = [f"""
        SELECT NULL AS peer, {direction} AS direction, pg AS pg_name,
               coalesce(seq, row_number() OVER (PARTITION BY pg, {direction} ORDER BY ts_ns) - 1) AS seq,
               ts_ns AS start_ns, ts_ns + dur_ns AS end_ns, {_nbytes('nelems', 'dtype')} AS nbytes,
               step, NULL AS microbatch, 'kernel' AS source
        FROM ck WHERE {classify.sql_is_p2p('op')}
    """]
    if has_ann:
        parts.append(f"""
            SELECT a.peer, a.op, a.pg, a.seq, e.ts_ns, e.ts_ns + e.dur_ns, a.nbytes, e.step, NULL, 'annotation'
            FROM {stepped("SELECT * FROM x WHERE starts_with(name, 'tk.comm ')")} e JOIN comm_ann a
              ON e.name = a.name WHERE a.op IN ('send', 'recv')
        """)
    else:
        span_op = classify.sql_span_op("name")
        parts.append(f"""
            SELECT NULL, op, NULL, row_number() OVER (PARTITION BY op ORDER BY ts_ns) - 1,
                   ts_ns, ts_ns + dur_ns, NULL, step, NULL, 'gloo'
            FROM (SELECT *, {span_op} AS op FROM {stepped(GLOO_SPANS)})
            WHERE op IN ('send', 'recv')
        """)
    return con.sql(" UNION ALL ".join(parts) + " ORDER BY start_ns").to_arrow_table()


def _groups(con: duckdb.DuckDBPyConnection, info: dict, path: Path) -> list[dict]:
    """Process groups as recorded: distributedInfo.pg_config, kernel args, tk.comm spans."""
    out: list[dict] = []
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and isinstance(pg.get("ranks"), list):
            out.append({"pg_name": str(pg.get("pg_name")), "pg_desc": pg.get("pg_desc"),
                        "ranks": [int(r) for r in pg["ranks"]]})
    for name, desc, ranks in con.execute(
            "SELECT DISTINCT pg, pg_desc, pg_ranks FROM x WHERE pg IS NOT NULL AND pg_ranks IS NOT NULL").fetchall():
        try:
            parsed = json.loads(ranks)
        except json.JSONDecodeError:
            raise IngestError(f"{path}: unreadable 'Process Group Ranks' {ranks!r}") from None
        if isinstance(parsed, list) and parsed:
            out.append({"pg_name": name, "pg_desc": desc, "ranks": [int(r) for r in parsed]})
    for name, dim, ranks in con.execute("SELECT DISTINCT pg, dim, ranks FROM comm_ann").fetchall():
        out.append({"pg_name": name, "pg_desc": dim, "ranks": list(ranks)})
    return out
