"""The oracle for tracekit.ingest.kineto_comm: a Kineto trace's collectives, p2p and groups derived in
SQL straight from the trace file, written from the format (FORMATS.md section 1, Kineto/NCCL/gloo;
docs/trace_conventions.md, the tk.comm spans), never from tracekit's code: it imports nothing of
tracekit. Its SQL core is the derivation ingest ran before the numpy version replaced it; what it
used to take from tracekit (the event rows of kineto_rows, the op names of classify, the tk.comm
parser of conventions) is written here again from the documents, so that a bug there is not
shared. ``comm_args`` reads the raw JSON events; ``tables`` and ``groups`` derive the tables.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import duckdb


class OracleError(ValueError):
    """The trace is malformed in a way the format does not allow (the numpy code must refuse it too)."""


# FORMATS.md section 1: what is communication, by name.
NCCL_KERNEL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z0-9]+)")  # ncclKernel_AllReduce_..., ncclDevKernel_...
SPAN_PREFIXES = ("gloo:", "nccl:", "c10d::")  # gloo worker spans, nccl annotations, c10d cpu ops
PARAM_COMMS = "record_param_comms"  # NCCL's CPU side: its op is in args["Collective name"]
COMM_PREFIX = "tk.comm "  # docs/trace_conventions.md
# The op spellings of record_param_comms args, kernel names and gloo spans (FORMATS.md), as one
# vocabulary; any other spelling is itself, lowercased and stripped.
OP_NAMES = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allgather": "all_gather", "all_gather": "all_gather",
    "_allgather_base": "all_gather", "reducescatter": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast", "barrier": "barrier", "send": "send", "recv": "recv", "sendrecv": "sendrecv",
    "alltoall": "all_to_all", "all_to_all": "all_to_all",
}
P2P = ("recv", "send", "sendrecv")
# Kineto arg names of communication events, by the column name used below.
ARG_NAMES = {"coll": "Collective name", "pg": "Process Group Name", "pg_desc": "Process Group Description",
             "pg_ranks": "Process Group Ranks", "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems",
             "dtype": "dtype", "seq_arg": "Seq", "seq_num": "seq_num", "ext": "External id",
             "dst_rank": "Dst Rank", "src_rank": "Src Rank", "rank_arg": "Rank", "rank_start": "Global rank start",
             "rank_stride": "Global rank stride"}
STEP_NAME = re.compile(r"ProfilerStep#([0-9]+)")


def normalize(op: str) -> str:
    key = op.strip().lower()
    return OP_NAMES.get(key, key)


def name_op(name: str) -> str | None:
    """The op of a communication event's name; None for other names and record_param_comms."""
    m = NCCL_KERNEL.match(name)
    if m:
        return normalize(m.group(1))
    if name.startswith(COMM_PREFIX):
        ann = parse_tk_comm(name)
        return normalize(ann["op"]) if ann else None
    for prefix in SPAN_PREFIXES:
        if name.startswith(prefix):
            return normalize(name[len(prefix):].split(" ", 1)[0])
    return None


def is_comm(name: str) -> bool:
    return (NCCL_KERNEL.match(name) is not None or name == PARAM_COMMS
            or name.startswith(SPAN_PREFIXES + (COMM_PREFIX,)))


def parse_tk_comm(name: str) -> dict | None:
    """``tk.comm op=.. pg=.. dim=.. seq=.. ranks=a,b [peer=..] bytes=.. dtype=..``; None if malformed."""
    fields = {}
    for tok in name[len(COMM_PREFIX):].split():
        key, sep, val = tok.partition("=")
        if not sep or not key:
            return None
        fields[key] = val
    try:
        return {"name": name, "op": normalize(fields["op"]), "pg": fields["pg"], "dim": fields.get("dim", "other"),
                "seq": int(fields["seq"]), "ranks": [int(r) for r in fields["ranks"].split(",") if r],
                "nbytes": int(fields.get("bytes", 0)), "dtype": fields.get("dtype", ""),
                "peer": int(fields["peer"]) if "peer" in fields else None}
    except (KeyError, ValueError):
        return None


def _text(v: Any) -> str | None:
    return None if v is None else v if isinstance(v, str) else json.dumps(v)


def comm_args(con: duckdb.DuckDBPyConnection, ns: str, path: Path) -> tuple[int | None, list[dict]]:
    """Table ``comm_args`` of the file's communication events (X events; ts and dur in microseconds
    as integer ns; the step: the first ProfilerStep#N span, by start, holding the event's start; the
    args as text), the first step's start, and the parsed tk.comm names."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((round(e["ts"] * 1000), round((e["ts"] + e.get("dur", 0)) * 1000), int(m.group(1)))
                   for e in events if e.get("cat") in ("cpu_op", "user_annotation")
                   and (m := STEP_NAME.fullmatch(e["name"])))

    def step_of(ts: int) -> int | None:
        return next((n for lo, hi, n in steps if lo <= ts < hi), None)

    rows = []
    for e in events:
        if not is_comm(e["name"]):
            continue
        ts = round(e["ts"] * 1000)
        args = e.get("args") or {}
        rows.append({"ts_ns": ts, "dur_ns": round(e.get("dur", 0) * 1000), "kind": e.get("cat"), "name": e["name"],
                     "tid": _text(e.get("tid")), "step": step_of(ts),
                     **{col: _text(args.get(key)) for col, key in ARG_NAMES.items()}})
    create_table(con, f"{ns}.comm_args", [("ts_ns", "BIGINT"), ("dur_ns", "BIGINT"), ("kind", "VARCHAR"),
                                          ("name", "VARCHAR"), ("tid", "VARCHAR"), ("step", "INTEGER")]
                 + [(c, "VARCHAR") for c in ARG_NAMES], rows)
    names = sorted({r["name"] for r in rows if r["name"].startswith(COMM_PREFIX)})
    anns = [a for a in map(parse_tk_comm, names) if a is not None]
    return (steps[0][0] if steps else None), anns


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
    """Table comm_ann: the trace's tk.comm names, parsed (parse_tk_comm)."""
    create_table(con, f"{ns}.comm_ann", [("name", "VARCHAR"), ("op", "VARCHAR"), ("pg", "VARCHAR"),
                                         ("dim", "VARCHAR"), ("seq", "BIGINT"), ("ranks", "INTEGER[]"),
                                         ("nbytes", "BIGINT"), ("dtype", "VARCHAR"), ("peer", "INTEGER")], comm)
    return Annotations(comm=bool(comm))


FIELDS = ARG_NAMES  # comm_args's columns of event args, by the name used below


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
        LEFT JOIN (SELECT DISTINCT ON (ext) * FROM {ns}.comm WHERE name = '{PARAM_COMMS}'
                   AND ext IS NOT NULL ORDER BY ext, ts_ns) r ON k.ext = r.ext
    """)


def _create_lookups(con: duckdb.DuckDBPyConnection, ns: str) -> None:
    """The few distinct names, op spellings and dtypes, classified in Python (name_op, normalize):
    tables name_ops, coll_ops and widths."""
    def distinct(col: str) -> list[str]:
        return [v for (v,) in con.execute(f"SELECT DISTINCT {col} FROM {ns}.comm_args WHERE {col} IS NOT NULL")
                .fetchall()]

    lookups = {
        "name_ops": [(n, name_op(n)) for n in distinct("name")],
        "coll_ops": [(c, normalize(c)) for c in distinct("coll")],
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
    """collectives and p2p of the communication events in table ``comm_args`` (``comm_args``; times
    relative to ``base``)."""
    _create_comm_tables(con, ns)
    group = "coalesce(pg, 'stream ' || tid)"
    direction = "CASE op WHEN 'send' THEN 'send' WHEN 'recv' THEN 'recv' END"
    peer = ("coalesce(CASE op WHEN 'send' THEN dst_rank WHEN 'recv' THEN src_rank END, "
            "CASE WHEN rank_arg >= 0 AND rank_arg < len(ranks) THEN ranks[rank_arg + 1] END, "
            "CASE WHEN rank_stride > 0 AND rank_arg >= 0 THEN rank_start + rank_arg * rank_stride END)")
    coll = [f"""
        SELECT pg, coalesce(seq, {_ordinal(group, first_step_ns)}), op, ts_ns, ts_ns + dur_ns,
               nelems * width, dtype, step, 'kernel'
        FROM {ns}.ck WHERE op IS NOT NULL AND NOT op IN ('recv', 'send', 'sendrecv')"""]
    p2p = [f"""
        SELECT peer, direction, pg, coalesce(seq, {_ordinal(f'{group}, peer, direction', first_step_ns)}),
               ts_ns, ts_ns + dur_ns, nelems * width, step, NULL, 'kernel',
               CASE WHEN len(ranks) = 2 THEN ranks END
        FROM (SELECT *, {peer} AS peer, {direction} AS direction FROM {ns}.ck WHERE op IN ('recv', 'send', 'sendrecv'))"""]
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
            FROM {gloo} WHERE kind = 'user_annotation' AND NOT op IN ('recv', 'send', 'sendrecv')""")
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
            raise OracleError(f"{path}: unreadable 'Process Group Ranks' {ranks!r}") from None
        if isinstance(parsed, list) and parsed:
            out.append({"pg_name": name, "pg_desc": desc, "ranks": [int(r) for r in parsed]})
    for name, dim, ranks in con.execute(f"SELECT DISTINCT pg, dim, ranks FROM {ns}.comm_ann").fetchall():
        out.append({"pg_name": name, "pg_desc": dim, "ranks": list(ranks)})
    return out
