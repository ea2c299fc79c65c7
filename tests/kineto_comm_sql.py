"""The oracle for tracekit.ingest.kineto_comm: the SQL derivation of a Kineto trace's collectives,
p2p and groups that ingest ran (over a scratch schema of DuckDB tables) until the numpy version
replaced it. Kept verbatim but for this docstring and Query (a SELECT for commit, which ran it
with $rank), so that tests/test_ingest_kineto_comm.py can hold the new code to it. Not used by
tracekit itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import duckdb

from tracekit import classify
from tracekit.conventions import COMM_PREFIX, ConventionError
from tracekit.ingest.common import IngestError
from tracekit.ingest.kineto_rows import COMM_FIELDS

DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
    "char": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
COLLECTIVE_COLUMNS = ("pg_name", "seq", "op", "start_ns", "end_ns", "nbytes", "dtype", "step", "source")
P2P_COLUMNS = ("peer", "direction", "pg_name", "seq", "start_ns", "end_ns", "nbytes", "step", "microbatch",
               "source")


def create_table(con: duckdb.DuckDBPyConnection, table: str, columns: Sequence[tuple[str, str]],
                 rows: Sequence[dict[str, Any]]) -> None:
    """Create ``table`` (columns as (name, DuckDB type)) holding ``rows`` (dicts; a missing key is
    NULL), one list parameter per column."""
    select = ", ".join(f'unnest(${i + 1}::{typ}[]) AS "{name}"' for i, (name, typ) in enumerate(columns))
    con.execute(f"CREATE TABLE {table} AS SELECT {select}", [[r.get(name) for r in rows] for name, _ in columns])


@dataclass(frozen=True)
class Annotations:
    comm: bool  # table comm_ann has rows


def register_annotations(con: duckdb.DuckDBPyConnection, ns: str, comm: list[dict]) -> Annotations:
    """Table comm_ann: the trace's tk.comm names, parsed (kineto_rows)."""
    create_table(con, f"{ns}.comm_ann", [("name", "VARCHAR"), ("op", "VARCHAR"), ("pg", "VARCHAR"),
                                         ("dim", "VARCHAR"), ("seq", "BIGINT"), ("ranks", "INTEGER[]"),
                                         ("nbytes", "BIGINT"), ("dtype", "VARCHAR"), ("peer", "INTEGER")], comm)
    return Annotations(comm=bool(comm))


FIELDS = COMM_FIELDS  # comm_args's columns of event args, by the name used below


def _int(expr: str) -> str:
    return f"TRY_CAST({expr} AS BIGINT)"


def _create_comm_tables(con: duckdb.DuckDBPyConnection, ns: str) -> None:
    """Tables ``comm`` (the communication events of ``comm_args`` with their op and dtype width)
    and ``ck`` (NCCL kernels with their metadata: their own args, else their record_param_comms')."""
    _create_lookups(con, ns)
    con.execute(f"""
        CREATE TABLE {ns}.comm AS SELECT c.*, n.op AS name_op, o.op AS coll_op, w.width
        FROM {ns}.comm_args c LEFT JOIN {ns}.name_ops n ON c.name = n.key
             LEFT JOIN {ns}.coll_ops o ON c.coll = o.key LEFT JOIN {ns}.widths w ON c.dtype = w.key
    """)
    field = {c: f"coalesce(k.{c}, r.{c})" for c in FIELDS if c not in ("coll", "ext")}
    con.execute(f"""
        CREATE TABLE {ns}.ck AS
        SELECT k.ts_ns, k.dur_ns, k.tid, k.step, coalesce(k.coll_op, r.coll_op, k.name_op) AS op,
               {field['pg']} AS pg, TRY_CAST({field['pg_ranks']} AS INTEGER[]) AS ranks,
               greatest({_int(field['in_nelems'])}, {_int(field['out_nelems'])}) AS nelems,
               {field['dtype']} AS dtype, coalesce(k.width, r.width) AS width,
               coalesce({_int(field['seq_arg'])}, {_int(field['seq_num'])}) AS seq,
               {_int(field['dst_rank'])} AS dst_rank, {_int(field['src_rank'])} AS src_rank,
               {_int(field['rank_arg'])} AS rank_arg, {_int(field['rank_start'])} AS rank_start,
               {_int(field['rank_stride'])} AS rank_stride
        FROM (SELECT * FROM {ns}.comm WHERE kind = 'kernel') k
        LEFT JOIN (SELECT DISTINCT ON (ext) * FROM {ns}.comm WHERE name = '{classify.PARAM_COMMS}'
                   AND ext IS NOT NULL ORDER BY ext, ts_ns) r ON k.ext = r.ext
    """)


def _name_op(name: str) -> str | None:
    try:
        return classify.comm_op(name) or None
    except ConventionError:
        return None  # a malformed tk.comm name: a plain event


def _create_lookups(con: duckdb.DuckDBPyConnection, ns: str) -> None:
    """The few distinct names, op spellings and dtypes, classified by tracekit.classify (the one
    place) in Python: tables name_ops, coll_ops and widths (a huge SQL CASE costs milliseconds
    to plan even on one row)."""
    def distinct(col: str) -> list[str]:
        return [v for (v,) in con.execute(f"SELECT DISTINCT {col} FROM {ns}.comm_args WHERE {col} IS NOT NULL")
                .fetchall()]

    lookups = {
        "name_ops": [(n, _name_op(n)) for n in distinct("name")],
        "coll_ops": [(c, classify.normalize_op(c)) for c in distinct("coll")],
        "widths": [(d, DTYPE_BYTES.get(d.lower())) for d in distinct("dtype")],
    }
    for table, rows in lookups.items():
        value = ("width", "BIGINT") if table == "widths" else ("op", "VARCHAR")
        create_table(con, f"{ns}.{table}", [("key", "VARCHAR"), value],
                     [{"key": k, value[0]: v} for k, v in rows])


def _ordinal(key: str, first_step_ns: int | None) -> str:
    """The op's order within ``key`` in this trace, 0 at the first op of the first profiler step."""
    before = (f" - count(*) FILTER (WHERE ts_ns < {first_step_ns}) OVER (PARTITION BY {key})"
              if first_step_ns is not None else "")
    return f"(row_number() OVER (PARTITION BY {key} ORDER BY ts_ns) - 1{before})"


def tables(con: duckdb.DuckDBPyConnection, ns: str, base: int, first_step_ns: int | None,
           ann: Annotations) -> dict[str, Query]:
    """collectives and p2p of the communication events in table ``comm_args`` (kineto_rows.Built.comm,
    times relative to ``base``)."""
    _create_comm_tables(con, ns)
    group = "coalesce(pg, 'stream ' || tid)"
    direction = "CASE op WHEN 'send' THEN 'send' WHEN 'recv' THEN 'recv' END"
    peer = ("coalesce(CASE op WHEN 'send' THEN dst_rank WHEN 'recv' THEN src_rank END, "
            "CASE WHEN rank_arg >= 0 AND rank_arg < len(ranks) THEN ranks[rank_arg + 1] END, "
            "CASE WHEN rank_stride > 0 AND rank_arg >= 0 THEN rank_start + rank_arg * rank_stride END)")
    coll = [f"""
        SELECT pg, coalesce(seq, {_ordinal(group, first_step_ns)}), op, ts_ns, ts_ns + dur_ns,
               nelems * width, dtype, step, 'kernel'
        FROM {ns}.ck WHERE op IS NOT NULL AND NOT {classify.sql_is_p2p('op')}"""]
    p2p = [f"""
        SELECT peer, direction, pg, coalesce(seq, {_ordinal(f'{group}, peer, direction', first_step_ns)}),
               ts_ns, ts_ns + dur_ns, nelems * width, step, NULL, 'kernel',
               CASE WHEN len(ranks) = 2 THEN ranks END
        FROM (SELECT *, {peer} AS peer, {direction} AS direction FROM {ns}.ck WHERE {classify.sql_is_p2p('op')})"""]
    if ann.comm:
        spans = f"(SELECT * FROM {ns}.comm WHERE starts_with(name, '{COMM_PREFIX}'))"
        coll.append(f"""
            SELECT a.pg, a.seq, a.op, e.ts_ns, e.ts_ns + e.dur_ns, a.nbytes, a.dtype, e.step, 'annotation'
            FROM {spans} e JOIN {ns}.comm_ann a ON e.name = a.name
            WHERE a.peer IS NULL AND a.op NOT IN ('send', 'recv')""")
        p2p.append(f"""
            SELECT a.peer, a.op, a.pg, a.seq, e.ts_ns, e.ts_ns + e.dur_ns, a.nbytes, e.step, NULL, 'annotation',
                   NULL
            FROM {spans} e JOIN {ns}.comm_ann a ON e.name = a.name WHERE a.op IN ('send', 'recv')""")
    else:
        gloo = f"(SELECT *, name_op AS op FROM {ns}.comm WHERE starts_with(name, 'gloo:'))"
        coll.append(f"""
            SELECT NULL, row_number() OVER (PARTITION BY op ORDER BY ts_ns) - 1, op, ts_ns, ts_ns + dur_ns,
                   NULL, NULL, step, 'gloo'
            FROM {gloo} WHERE kind = 'user_annotation' AND NOT {classify.sql_is_p2p('op')}""")
        p2p.append(f"""
            SELECT NULL, op, NULL, row_number() OVER (PARTITION BY op ORDER BY ts_ns) - 1,
                   ts_ns, ts_ns + dur_ns, NULL, step, NULL, 'gloo', NULL
            FROM {gloo} WHERE op IN ('send', 'recv')""")
    _materialize(con, ns, "collectives", coll, COLLECTIVE_COLUMNS, base)
    _materialize(con, ns, "p2p", p2p, P2P_COLUMNS + ("pair",), base)
    # In a two-rank group the peer is the other member: known once the file's rank is (commit).
    other = ("coalesce(peer, CASE WHEN pair[1] = $rank THEN pair[2] WHEN pair[2] = $rank THEN pair[1] END) "
             "AS peer")
    return {"collectives": _query(con, ns, "collectives", COLLECTIVE_COLUMNS, "*"),
            "p2p": _query(con, ns, "p2p", P2P_COLUMNS, ", ".join(other if c == "peer" else c for c in P2P_COLUMNS))}


def _materialize(con: duckdb.DuckDBPyConnection, ns: str, name: str, parts: list[str], cols: tuple[str, ...],
                 base: int) -> None:
    """Table ``out_<name>``: the union of ``parts`` with named columns, times on the epoch."""
    named = ", ".join(f"c{i} + {base} AS {c}" if c in ("start_ns", "end_ns") else f"c{i} AS {c}"
                      for i, c in enumerate(cols))
    aliases = ", ".join(f"c{i}" for i in range(len(cols)))
    con.execute(f"CREATE TABLE {ns}.out_{name} AS SELECT {named} FROM ({' UNION ALL '.join(parts)}) AS u({aliases})")


@dataclass(frozen=True)
class Query:
    """A SELECT over the scratch tables; it may use the parameter $rank."""

    sql: str
    columns: tuple[str, ...]
    rows: int


def _query(con: duckdb.DuckDBPyConnection, ns: str, name: str, cols: tuple[str, ...], select: str) -> Query:
    rows = con.execute(f"SELECT count(*) FROM {ns}.out_{name}").fetchall()[0][0]
    return Query(f"SELECT {select} FROM {ns}.out_{name}", cols, rows)


def groups(con: duckdb.DuckDBPyConnection, ns: str, info: dict, path: Path) -> list[dict]:
    """Process groups as recorded: distributedInfo.pg_config, comm event args, tk.comm spans."""
    out: list[dict] = []
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and isinstance(pg.get("ranks"), list):
            out.append({"pg_name": str(pg.get("pg_name")), "pg_desc": pg.get("pg_desc"),
                        "ranks": [int(r) for r in pg["ranks"]]})
    for name, desc, ranks in con.execute(
            f"SELECT DISTINCT pg, pg_desc, pg_ranks FROM {ns}.comm WHERE pg IS NOT NULL AND pg_ranks IS NOT NULL"
            ).fetchall():
        try:
            parsed = json.loads(ranks)
        except json.JSONDecodeError:
            raise IngestError(f"{path}: unreadable 'Process Group Ranks' {ranks!r}") from None
        if isinstance(parsed, list) and parsed:
            out.append({"pg_name": name, "pg_desc": desc, "ranks": [int(r) for r in parsed]})
    for name, dim, ranks in con.execute(f"SELECT DISTINCT pg, dim, ranks FROM {ns}.comm_ann").fetchall():
        out.append({"pg_name": name, "pg_desc": dim, "ranks": list(ranks)})
    return out
