"""The communication tables of a Kineto trace (collectives, p2p, groups), in numpy over its
communication events (kineto_rows.Built.comm: a few thousand rows of a trace's hundreds of
thousands).

Sources, by flavour (FORMATS.md section 1):
- NCCL: GPU kernels (``ncclKernel_*``/``ncclDevKernel_*``) give the times. Their metadata comes
  from their own args or, where the kernel has none, from the ``record_param_comms`` CPU op that
  launched it (same ``External id``; the earliest such op): op, group, sizes, ``Seq``, and for p2p
  the peer.
- gloo with the trainer's ``tk.comm`` spans: group, sequence, size, dtype and peer from the span
  name (tracekit.conventions), times from the span (the comm layer waits inside it).
- gloo without annotations: the ``gloo:*`` worker spans; the group is unknown (NULL) and ``seq``
  is the op's order on the rank (gloo spreads one group's ops over several worker threads).

Sequence numbers: torch's ``Seq`` (``seq_num``) arg where present. Without it, ``seq`` is the op's
order among its group's ops in this trace (the group's GPU stream when the group is unknown),
counted from the first op of the first profiler step (earlier ops get negative numbers). Every
member of a group issues the group's ops in the same order, so these numbers match across ranks
as long as the ranks' traces cover the same steps, which a profiler schedule does. p2p ops are
numbered per (group, peer, direction), the order in which NCCL matches sends with receives. Not
handled: ranks whose traces start at different steps (their numbers are offset), kernels of
unknown groups that share a stream, and a group whose ops carry ``Seq`` only in part.

The p2p peer (a global rank): ``Dst Rank``/``Src Rank`` (recent torch, 2.13 included), else the group-local
``Rank`` through the group's ranks or ``Global rank start``/``stride``, else, in a two-rank group,
the member that is not this rank (applied at commit, when the rank is known). Kernels with no
metadata at all (e.g. ``ncclKernel_SendRecv`` launched outside any ``record_param_comms``) keep a
NULL peer, group and direction.

Integer and list args are text in the trace; they are read as DuckDB's ``TRY_CAST`` reads them
(kineto_rows.try_bigint, try_cast_values), so that ``" 12 "`` or ``"1e1"`` mean here what they mean in SQL. The
derivation was SQL over a scratch table until it moved here, 10x cheaper; tests hold it to that
SQL (tests/kineto_comm_sql.py) on generated traces, and the stores of every sample, fixture and
benchmark trace came out identical.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from tracekit import classify
from tracekit.conventions import COMM_PREFIX, ConventionError
from tracekit.ingest import columns
from tracekit.ingest.nullable import Ints, Text, add, constant_text, ints, mul, ordinals, row_ids, text
from tracekit.ingest.common import IngestError, RankDependent, arrow_schema
from tracekit.ingest.kineto_rows import COMM_FIELDS, try_bigint, try_cast_values

DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
    "char": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# The integer args, read with TRY_CAST(... AS BIGINT)
INT_FIELDS = ("in_nelems", "out_nelems", "seq_arg", "seq_num", "dst_rank", "src_rank", "rank_arg",
              "rank_start", "rank_stride")
PAIR = ("pair_a", "pair_b")  # a two-rank group's members, for the peer known only at commit


def _strings(values: list[str | None]) -> pa.Array:
    return columns.from_values(values, pa.string())


def _table(name: str, cols: dict[str, pa.Array], extra: tuple[str, ...] = ()) -> pa.Table:
    """The store's columns of ``name`` in its types (a value out of range raises ArrowInvalid)."""
    sch = arrow_schema(name)
    out = {f.name: cols[f.name].cast(f.type) for f in sch}
    out.update({k: cols[k] for k in extra})
    return columns.table(out)


def _concat(parts: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(parts).combine_chunks()


class CommEvents:
    """The communication events of one trace, their args decoded."""

    def __init__(self, comm: pa.Table, con: duckdb.DuckDBPyConnection, path: Path) -> None:
        self.path = path
        self.ts, self.dur, self.step = (ints(comm.column(k)) for k in ("ts_ns", "dur_ns", "step"))
        self.kind, self.name, self.tid = (Text.of(comm.column(k)) for k in ("kind", "name", "tid"))
        self.args = {k: Text.of(comm.column(k)) for k in COMM_FIELDS}
        self.name_op = self.name.lut(_name_op)
        self.con = con

    def ints(self, field: str, codes: np.ndarray) -> Ints:
        """TRY_CAST(value AS BIGINT) of ``field``'s value for each code."""
        return Ints.coded(try_bigint(self.con, self.args[field].dictionary), codes)

    # -- NCCL kernels and their record_param_comms ------------------------------------------------
    def kernels(self) -> "_Kernels":
        kern = np.flatnonzero(self.kind.codes == self.kind.code_of("kernel"))
        ext = self.args["ext"]
        param = np.flatnonzero((self.name.codes == self.name.code_of(classify.PARAM_COMMS)) & (ext.codes >= 0))
        first = np.full(len(ext.dictionary), -1, dtype=np.int64)  # the earliest record_param_comms per id
        order = param[np.lexsort((self.ts.v[param], ~self.ts.ok[param], ext.codes[param]))]
        ids, at = np.unique(ext.codes[order], return_index=True)
        first[ids] = order[at]
        k_ext = ext.codes[kern]
        launcher = np.where(k_ext >= 0, first[k_ext.clip(0)], -1) if len(first) else np.full(len(kern), -1)
        return _Kernels(self, kern, launcher)

    def rows_named(self, prefix: str) -> np.ndarray:
        hit = np.array([v.startswith(prefix) for v in self.name.values] + [False], dtype=bool)
        return np.flatnonzero(hit[self.name.codes])


class _Vocab:
    """Distinct strings with small integer ids (None: -1)."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self.ids: dict[str, int] = {}

    def id(self, value: str | None) -> int:
        if value is None:
            return -1
        i = self.ids.get(value)
        if i is None:
            i = self.ids[value] = len(self.values)
            self.values.append(value)
        return i

    def lut(self, values: list[str | None]) -> np.ndarray:
        """The id of each value, then -1 (so that a code of -1, a null, looks up -1)."""
        return np.array([self.id(v) for v in values] + [-1], dtype=np.int32)


class _Kernels:
    """NCCL kernels with their metadata: their own args, else their launcher's (row -1: none).
    Text is kept as codes into a few distinct values; per-row work is numpy."""

    def __init__(self, ev: CommEvents, rows: np.ndarray, launcher: np.ndarray) -> None:
        self.ev, self.rows, self.launcher = ev, rows, launcher
        has = launcher >= 0
        safe = launcher.clip(0)

        def field(k: str) -> np.ndarray:  # coalesce(kernel's, launcher's): codes
            codes = ev.args[k].codes
            own = codes[rows]
            return np.where(own >= 0, own, np.where(has, codes[safe], -1))

        self.code = {k: field(k) for k in COMM_FIELDS if k not in ("coll", "ext")}
        # the op: the kernel's own Collective name, else its launcher's, else its name's
        self.ops = ops = _Vocab()
        coll = ev.args["coll"]
        coll_op = ops.lut(coll.lut(classify.normalize_op)[:-1])[coll.codes]
        name_op = ops.lut(ev.name_op[:-1])[ev.name.codes[rows]]
        own_op, their_op = coll_op[rows], np.where(has, coll_op[safe], -1)
        self.op = np.where(own_op >= 0, own_op, np.where(their_op >= 0, their_op, name_op))
        p2p_ids = [ops.ids[o] for o in classify.P2P_NORMALIZED if o in ops.ids]
        self.is_p2p = np.isin(self.op, p2p_ids)
        self.send, self.recv = ops.ids.get("send", -2), ops.ids.get("recv", -2)
        dtype = ev.args["dtype"]
        width = Ints.of(dtype.lut(lambda d: DTYPE_BYTES.get(d.lower())), dtype.codes)
        self.width = width.take(rows).coalesce(Ints(width.v[safe], width.ok[safe] & has))
        self.int = {k: ev.ints(k, self.code[k]) for k in INT_FIELDS}
        self.ts = ev.ts.take(rows)
        self.nelems = self._greatest(self.int["in_nelems"], self.int["out_nelems"])
        self.seq = self.int["seq_arg"].coalesce(self.int["seq_num"])
        # TRY_CAST(Process Group Ranks AS INTEGER[]) of each distinct value (+ None for null)
        self.ranks_of_code = try_cast_values(ev.con, ev.args["pg_ranks"].values, "INTEGER[]") + [None]
        self.group_code = self._group_codes()

    @staticmethod
    def _greatest(a: Ints, b: Ints) -> Ints:  # SQL greatest: nulls ignored
        return Ints(np.where(a.ok & b.ok, np.maximum(a.v, b.v), np.where(a.ok, a.v, b.v)), a.ok | b.ok)

    def _group_codes(self) -> np.ndarray:
        """coalesce(pg, 'stream ' || tid) per kernel, as ids of distinct strings (a group named
        like a stream is that stream's key)."""
        groups = _Vocab()
        pg_ids = groups.lut(self.ev.args["pg"].values)
        tid_ids = groups.lut(["stream " + t for t in self.ev.tid.values])
        pg = pg_ids[self.code["pg"]]
        return np.where(pg >= 0, pg, tid_ids[self.ev.tid.codes[self.rows]])

    def text(self, k: str, sel: np.ndarray) -> pa.Array:
        return text(self.ev.args[k].values, self.code[k][sel])

    def times(self, sel: np.ndarray, base: int) -> dict[str, pa.Array]:
        return _times(self.ev, self.rows[sel], base)

    def nbytes(self, sel: np.ndarray) -> pa.Array:
        return mul(self.nelems.take(sel), self.width.take(sel), "message size", self.ev.path).arrow()

    def collectives(self, base: int, first_step_ns: int | None) -> pa.Table:
        sel = np.flatnonzero((self.op >= 0) & ~self.is_p2p)
        seq = self.seq.take(sel)
        ordinal = ordinals(self.group_code[sel], self.ts.take(sel), first_step_ns)
        return _table("collectives", {
            "pg_name": self.text("pg", sel), "seq": columns.from_numpy(np.where(seq.ok, seq.v, ordinal)),
            "op": text(self.ops.values, self.op[sel]), **self.times(sel, base), "nbytes": self.nbytes(sel),
            "dtype": self.text("dtype", sel), "step": self.ev.step.take(self.rows[sel]).arrow(),
            "source": constant_text("kernel", len(sel))})

    def p2p(self, base: int, first_step_ns: int | None) -> pa.Table:
        sel = np.flatnonzero(self.is_p2p)
        op = self.op[sel]
        direction = np.where((op == self.send) | (op == self.recv), op, -1)
        peer = self._peer(sel, op)
        seq = self.seq.take(sel)
        keys = np.stack([self.group_code[sel], peer.ok, np.where(peer.ok, peer.v, 0), direction], axis=1)
        ordinal = ordinals(keys, self.ts.take(sel), first_step_ns)
        pair = self._pairs(self.code["pg_ranks"][sel])
        return _table("p2p", {
            "peer": peer.arrow(), "direction": text(self.ops.values, direction), "pg_name": self.text("pg", sel),
            "seq": columns.from_numpy(np.where(seq.ok, seq.v, ordinal)), **self.times(sel, base),
            "nbytes": self.nbytes(sel), "step": self.ev.step.take(self.rows[sel]).arrow(),
            "microbatch": pa.nulls(len(sel), pa.int32()), "source": constant_text("kernel", len(sel)),
            **{k: p.arrow() for k, p in zip(PAIR, pair)}}, extra=PAIR)

    def _pairs(self, codes: np.ndarray) -> tuple[Ints, Ints]:
        """The two members of each row's group where it has exactly two (else nulls)."""
        two = [r if r is not None and len(r) == 2 else (None, None) for r in self.ranks_of_code]
        return Ints.of([r[0] for r in two], codes), Ints.of([r[1] for r in two], codes)

    def _peer(self, sel: np.ndarray, op: np.ndarray) -> Ints:
        """dst/src rank by direction, else ranks[Rank], else start + Rank * stride."""
        i = {k: self.int[k].take(sel) for k in ("dst_rank", "src_rank", "rank_arg", "rank_start", "rank_stride")}
        is_send, is_recv = op == self.send, op == self.recv
        peer = Ints(np.where(is_send, i["dst_rank"].v, i["src_rank"].v),
                     (is_send & i["dst_rank"].ok) | (is_recv & i["src_rank"].ok))
        arg = i["rank_arg"]
        codes = self.code["pg_ranks"][sel]
        for j in np.flatnonzero(~peer.ok & arg.ok & (arg.v >= 0)).tolist():
            ranks = self.ranks_of_code[codes[j]]
            if ranks is not None and arg.v[j] < len(ranks) and ranks[arg.v[j]] is not None:
                peer.v[j], peer.ok[j] = ranks[arg.v[j]], True
        rest = ~peer.ok & arg.ok & (arg.v >= 0) & i["rank_stride"].ok & (i["rank_stride"].v > 0)
        if rest.any():
            idx = np.flatnonzero(rest)
            strided = add(i["rank_start"].take(idx),
                           mul(arg.take(idx), i["rank_stride"].take(idx), "peer rank", self.ev.path),
                           "peer rank", self.ev.path)
            peer.v[idx], peer.ok[idx] = strided.v, strided.ok
        return peer


def _times(ev: CommEvents, rows: np.ndarray, base: int) -> dict[str, pa.Array]:
    ts, dur = ev.ts.take(rows), ev.dur.take(rows)
    b = Ints(np.full(len(rows), base, dtype=np.int64), np.ones(len(rows), dtype=bool))
    start = add(ts, b, "time", ev.path)
    end = add(add(ts, dur, "time", ev.path), b, "time", ev.path)
    return {"start_ns": start.arrow(), "end_ns": end.arrow()}


def _name_op(name: str) -> str | None:
    try:
        return classify.comm_op(name) or None
    except ConventionError:
        return None  # a malformed tk.comm name: a plain event


def _annotated(ev: CommEvents, annotations: list[dict], base: int) -> tuple[pa.Table, pa.Table]:
    """tk.comm spans: metadata from the span's name (kineto_rows parsed it), times from the span."""
    by_name = {a["name"]: a for a in annotations}
    rows = ev.rows_named(COMM_PREFIX)
    names = ev.name.values + [None]
    ann = [by_name.get(names[c]) for c in ev.name.codes[rows].tolist()]
    coll = np.array([a is not None and a["peer"] is None and a["op"] is not None and a["op"] not in ("send", "recv")
                     for a in ann], dtype=bool)
    pp = np.array([a is not None and a["op"] in ("send", "recv") for a in ann], dtype=bool)
    c, p = rows[coll], rows[pp]
    ca, pa_ = [a for a, k in zip(ann, coll) if k], [a for a, k in zip(ann, pp) if k]
    collectives = _table("collectives", {
        "pg_name": _strings([a["pg"] for a in ca]), "seq": columns.from_values([a["seq"] for a in ca], pa.int64()),
        "op": _strings([a["op"] for a in ca]), **_times(ev, c, base),
        "nbytes": columns.from_values([a["nbytes"] for a in ca], pa.int64()), "dtype": _strings([a["dtype"] for a in ca]),
        "step": ev.step.take(c).arrow(), "source": _strings(["annotation"] * len(c))})
    p2p = _table("p2p", {
        "peer": columns.from_values([a["peer"] for a in pa_], pa.int32()), "direction": _strings([a["op"] for a in pa_]),
        "pg_name": _strings([a["pg"] for a in pa_]), "seq": columns.from_values([a["seq"] for a in pa_], pa.int64()),
        **_times(ev, p, base), "nbytes": columns.from_values([a["nbytes"] for a in pa_], pa.int64()),
        "step": ev.step.take(p).arrow(), "microbatch": pa.nulls(len(p), pa.int32()),
        "source": _strings(["annotation"] * len(p)), **_no_pair(len(p))}, extra=PAIR)
    return collectives, p2p


def _gloo(ev: CommEvents, base: int) -> tuple[pa.Table, pa.Table]:
    """gloo:* worker spans: no group; seq is the op's order on the rank."""
    rows = ev.rows_named("gloo:")
    ops = _Vocab()
    op = ops.lut(ev.name_op[:-1])[ev.name.codes[rows]]
    is_annotation = ev.kind.codes[rows] == ev.kind.code_of("user_annotation")
    coll = (op >= 0) & ~np.isin(op, [ops.ids[o] for o in classify.P2P_NORMALIZED if o in ops.ids]) & is_annotation
    pp = np.isin(op, [ops.ids[o] for o in ("send", "recv") if o in ops.ids])
    out = []
    for sel in (coll, pp):
        r = rows[sel]
        out.append((r, op[sel], ordinals(op[sel], ev.ts.take(r), None)))
    (c, cops, cseq), (p, pops, pseq) = out
    collectives = _table("collectives", {
        "pg_name": pa.nulls(len(c), pa.string()), "seq": columns.from_numpy(cseq), "op": text(ops.values, cops),
        **_times(ev, c, base), "nbytes": pa.nulls(len(c), pa.int64()), "dtype": pa.nulls(len(c), pa.string()),
        "step": ev.step.take(c).arrow(), "source": constant_text("gloo", len(c))})
    p2p = _table("p2p", {
        "peer": pa.nulls(len(p), pa.int32()), "direction": text(ops.values, pops),
        "pg_name": pa.nulls(len(p), pa.string()),
        "seq": columns.from_numpy(pseq), **_times(ev, p, base), "nbytes": pa.nulls(len(p), pa.int64()),
        "step": ev.step.take(p).arrow(), "microbatch": pa.nulls(len(p), pa.int32()),
        "source": constant_text("gloo", len(p)), **_no_pair(len(p))}, extra=PAIR)
    return collectives, p2p


def tables(ev: CommEvents, base: int, first_step_ns: int | None,
           annotations: list[dict]) -> dict[str, pa.Table | RankDependent]:
    """collectives and p2p of the communication events (times relative to ``base``, put on the
    epoch here). p2p's peer, where only a two-rank group tells it, waits for the file's rank."""
    kernels = ev.kernels()
    try:
        coll, p2p = [kernels.collectives(base, first_step_ns)], [kernels.p2p(base, first_step_ns)]
        c, p = _annotated(ev, annotations, base) if annotations else _gloo(ev, base)
    except pa.ArrowInvalid as e:  # a value beyond its column's type, e.g. a peer rank beyond INTEGER
        raise IngestError(f"{ev.path}: malformed trace events ({e})") from None
    coll.append(c), p2p.append(p)
    with_pairs = _concat(p2p)
    return {"collectives": _concat(coll),
            # a partial, not a lambda: it travels back from a parser process (procs.py)
            "p2p": RankDependent(functools.partial(_other_member, with_pairs), with_pairs.num_rows)}


def _no_pair(n: int) -> dict[str, pa.Array]:
    return {k: pa.nulls(n, pa.int64()) for k in PAIR}


def _other_member(p2p: pa.Table, rank: int | None) -> pa.Table:
    """p2p without its pair columns; where the peer is unknown and the group has two members, the
    one that is not ``rank`` (SQL: CASE WHEN pair[1] = rank THEN pair[2] WHEN pair[2] = rank THEN
    pair[1] END)."""
    out = p2p.drop_columns(list(PAIR))
    if rank is None or not p2p.num_rows:
        return out
    a, b = (ints(p2p.column(k)) for k in PAIR)
    first, second = a.ok & (a.v == rank), b.ok & (b.v == rank)
    other = Ints(np.where(first, b.v, a.v), np.where(first, b.ok, second & a.ok))
    peer = ints(p2p.column("peer")).coalesce(other)
    return out.set_column(out.column_names.index("peer"), "peer", peer.arrow().cast(pa.int32()))


def groups(ev: CommEvents, annotations: list[dict], info: dict, path: Path) -> list[dict]:
    """Process groups as recorded: distributedInfo.pg_config, comm event args, tk.comm spans."""
    out: list[dict] = []
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and isinstance(pg.get("ranks"), list):
            out.append({"pg_name": str(pg.get("pg_name")), "pg_desc": pg.get("pg_desc"),
                        "ranks": [int(r) for r in pg["ranks"]]})
    a = ev.args
    keys = np.stack([a["pg"].codes, a["pg_desc"].codes, a["pg_ranks"].codes], axis=1)
    _, first = np.unique(row_ids(keys), return_index=True)
    lut = {k: a[k].values + [None] for k in ("pg", "pg_desc", "pg_ranks")}
    for pg, desc, ranks in sorted(map(tuple, keys[first].tolist())):
        if pg < 0 or ranks < 0:
            continue
        text = lut["pg_ranks"][ranks]
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            raise IngestError(f"{path}: unreadable 'Process Group Ranks' {text!r}") from None
        if isinstance(parsed, list) and parsed:
            out.append({"pg_name": lut["pg"][pg], "pg_desc": lut["pg_desc"][desc], "ranks": [int(r) for r in parsed]})
    seen_ann = set()
    for ann in annotations:
        key = (ann["pg"], ann["dim"], tuple(ann["ranks"]))
        if key not in seen_ann:
            seen_ann.add(key)
            out.append({"pg_name": ann["pg"], "pg_desc": ann["dim"], "ranks": list(ann["ranks"])})
    return out
