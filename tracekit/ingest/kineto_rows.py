"""A Kineto trace's events, steps and communication rows, built from the readers' Arrow batches.

The readers (the native scanner, or DuckDB's JSON reader) hand over record batches of the
fields in ``kineto.COLUMNS``. Each batch is reduced here, in Arrow and numpy, to what the store
keeps: text columns become indices into per-file dictionaries (a trace has few distinct names,
categories and threads), times become integer nanoseconds, and only the args of communication
events are kept. Everything that depends on a name (its kind, whether it is communication, its
profiler step number, its tk.compute annotation) is decided once per distinct name, in Python,
by tracekit.classify and tracekit.conventions. The events then go to the store as one Arrow
table; only the few communication rows go on to SQL (kineto_comm).

Semantics are those of the SQL this replaced, kept exactly (the stores are compared in tests):
- ``ts_ns = floor(ts) * 1000 + round((ts - floor(ts)) * 1000)``, ``dur_ns = round(dur * 1000)``
  (absent: 0), rounding half away from zero, overflow an error;
- ``correlation`` and ``pid`` as DuckDB's ``TRY_CAST(text AS BIGINT)`` (unparseable: NULL);
- the step of an event is the first ``ProfilerStep#N`` span (by start) containing its start; a
  GPU event takes the step of the runtime call that launched it (same correlation), if known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracekit import classify
from tracekit.conventions import COMM_PREFIX, COMPUTE_PREFIX, ConventionError, parse_comm, parse_compute
from tracekit.ingest import columns
from tracekit.ingest.common import IngestError

KINDS = {
    "cpu_op": "cpu_op", "user_annotation": "user_annotation", "gpu_user_annotation": "gpu_annotation",
    "kernel": "kernel", "cuda_runtime": "runtime", "cuda_driver": "runtime", "gpu_memcpy": "memcpy",
    "gpu_memset": "memset", "python_function": "python",
}
GPU_KINDS = ("kernel", "memcpy", "memset", "gpu_annotation")
STEP_KINDS = ("cpu_op", "user_annotation")  # the kinds a ProfilerStep#N span may have
PID_KINDS = ("runtime", "cpu_op", "user_annotation")  # the host process's own events
_STEP_NAME = re.compile(r"ProfilerStep#([0-9]+)")  # ASCII digits, whole name (as RE2's ^...$)
_INT32_MAX = (1 << 31) - 1
# Args kept for communication events, by the column name kineto_comm uses.
COMM_FIELDS = {"coll": "Collective name", "pg": "Process Group Name", "pg_desc": "Process Group Description",
               "pg_ranks": "Process Group Ranks", "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems",
               "dtype": "dtype", "seq_arg": "Seq", "seq_num": "seq_num", "ext": "External id",
               "dst_rank": "Dst Rank", "src_rank": "Src Rank", "rank_arg": "Rank", "rank_start": "Global rank start",
               "rank_stride": "Global rank stride"}


class Dictionary:
    """Distinct strings of one column of a file, each with a small integer id."""

    def __init__(self, on_new: Callable[[str], None] | None = None) -> None:
        self.values: list[str] = []
        self.ids: dict[str, int] = {}
        self.on_new = on_new

    def id(self, value: str) -> int:
        i = self.ids.get(value)
        if i is None:
            i = self.ids[value] = len(self.values)
            self.values.append(value)
            if self.on_new is not None:
                self.on_new(value)
        return i

    def encode(self, column: pa.Array, as_value: Callable[[str], str] = lambda v: v) -> np.ndarray:
        """Ids of a string column's values (mapped by ``as_value``), -1 for null (int32)."""
        enc = columns.one_array(pc.dictionary_encode(column))
        remap = np.array([self.id(as_value(v)) for v in enc.dictionary.to_pylist()] + [-1], dtype=np.int32)
        local = columns.filled(enc.indices, len(remap) - 1)
        return remap[local]

    def array(self, ids: np.ndarray) -> pa.DictionaryArray:
        dictionary = columns.from_values(self.values, pa.string())
        return pa.DictionaryArray.from_arrays(columns.from_numpy(np.maximum(ids, 0), ids >= 0), dictionary)


@dataclass
class Span:
    step: int
    start_ns: int | None
    end_ns: int | None


@dataclass
class Built:
    """One trace's rows, times relative to its ``baseTimeNanoseconds``."""

    events: pa.Table  # the store's events columns (ts_ns still relative)
    steps: list[Span]  # by start (spans without a start last)
    comm: pa.Table  # communication events: ts_ns, dur_ns, kind, name, tid, step and COMM_FIELDS
    comm_annotations: list[dict]  # parsed tk.comm names
    pids: list[int]  # host pids, most events first


class EventRows:
    """Accumulates the reader's batches (``add``); ``build`` derives steps and the final tables.

    ``con`` (the worker's DuckDB connection) evaluates TRY_CAST for the rare integer fields that
    are not plain digits, so that their meaning is DuckDB's own."""

    def __init__(self, con: duckdb.DuckDBPyConnection, path: str) -> None:
        self.con, self.path = con, path
        self.kinds = Dictionary()
        self.tids = Dictionary()
        self.comm_name: list[bool] = []
        self.names = Dictionary(lambda n: self.comm_name.append(classify.has_comm_name(n)))
        self.pid_counts: dict[str, int] = {}
        self.parts: dict[str, list] = {k: [] for k in ("ts", "ts_valid", "dur", "kind", "name", "tid", "corr",
                                                       "corr_valid", "comm_rows", "comm_args")}
        self.rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        """One batch of X events with the fields of kineto.COLUMNS."""
        trace_span = pc.fill_null(pc.equal(batch.column("cat"), _TRACE), _FALSE)  # the profiler's own
        if pc.any(trace_span).as_py():
            batch = batch.filter(pc.invert(trace_span))
        n = batch.num_rows
        kind = self.kinds.encode(batch.column("cat"), lambda cat: KINDS.get(cat, cat))
        name = self.names.encode(batch.column("name"))
        ts, ts_valid = self._ns(batch.column("ts"))
        dur, _ = self._ns(pc.fill_null(batch.column("dur"), _ZERO), split=False)
        args = batch.column("args")
        corr, corr_valid = self._bigint(pc.struct_field(args, "correlation"))
        comm = np.array(self.comm_name + [False], dtype=bool)[name] & (name >= 0)
        self._count_pids(batch.column("pid"), kind)
        p = self.parts
        p["ts"].append(ts), p["ts_valid"].append(ts_valid), p["dur"].append(dur), p["kind"].append(kind)
        p["name"].append(name), p["tid"].append(self.tids.encode(batch.column("tid")))
        p["corr"].append(corr), p["corr_valid"].append(corr_valid)
        rows = np.flatnonzero(comm)
        p["comm_rows"].append(rows + self.rows)
        if len(rows):
            picked = args.take(columns.from_numpy(rows))
            p["comm_args"].append({k: pc.struct_field(picked, key) for k, key in COMM_FIELDS.items()})
        self.rows += n

    def _ns(self, us: pa.Array, split: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Microseconds (double) as integer nanoseconds, and where they are not null."""
        try:
            if split:  # whole microseconds apart, so that large timestamps keep their last digits
                whole = pc.floor(us)
                frac = pc.round(pc.multiply(pc.subtract(us, whole), _THOUSAND), round_mode="half_towards_infinity")
                ns = pc.add_checked(pc.multiply_checked(pc.cast(whole, pa.int64()), _THOUSAND_INT), pc.cast(frac, pa.int64()))
            else:
                ns = pc.cast(pc.round(pc.multiply(us, _THOUSAND), round_mode="half_towards_infinity"), pa.int64())
        except pa.ArrowInvalid as e:
            raise IngestError(f"{self.path}: malformed trace events (a time out of range: {e})") from None
        return columns.filled(ns), columns.to_bools(ns.is_valid())

    def _bigint(self, text: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """TRY_CAST(text AS BIGINT), as numpy values and where they are valid."""
        out = try_bigint(self.con, text)
        return columns.filled(out), columns.to_bools(out.is_valid())

    def _count_pids(self, pid: pa.Array, kind: np.ndarray) -> None:
        wanted = np.isin(kind, [self.kinds.ids[k] for k in PID_KINDS if k in self.kinds.ids])
        if not wanted.any():
            return
        enc = pc.dictionary_encode(pid.filter(columns.from_bools(wanted)))
        counts = np.bincount(columns.filled(enc.indices, len(enc.dictionary)), minlength=len(enc.dictionary) + 1)
        for text, c in zip(enc.dictionary.to_pylist(), counts):
            self.pid_counts[text] = self.pid_counts.get(text, 0) + int(c)

    def build(self) -> Built:
        p = self.parts
        cat = (lambda k: np.concatenate(p[k]) if p[k] else np.zeros(0, dtype=np.int64))
        ts, ts_valid, dur, kind, name, tid = (cat(k) for k in ("ts", "ts_valid", "dur", "kind", "name", "tid"))
        corr, corr_valid = cat("corr"), cat("corr_valid")
        ts_valid, corr_valid = ts_valid.astype(bool), corr_valid.astype(bool)
        kind, name, tid = kind.astype(np.int32), name.astype(np.int32), tid.astype(np.int32)
        steps = self._steps(ts, ts_valid, dur, kind, name)
        step = self._step_of_events(steps, ts, ts_valid, kind, corr, corr_valid)
        comm_ann, comp_ann = _annotations(self.names.values)
        # The store's kind: a parsed tk.compute span is 'compute', any tk.comm span 'comm'.
        compute_id, comm_id = self.kinds.id("compute"), self.kinds.id("comm")
        by_name = {a["name"]: a for a in comp_ann}
        relabel = np.array([compute_id if v in by_name else comm_id if v.startswith(COMM_PREFIX) else -1
                            for v in self.names.values] + [-1], dtype=np.int32)[name]
        final_kind = np.where(relabel >= 0, relabel, kind)
        phases = Dictionary()
        lut_phase = np.array([phases.id(by_name[v]["phase"]) if v in by_name and by_name[v]["phase"] is not None
                              else -1 for v in self.names.values] + [-1], dtype=np.int32)
        lut_vstage, lut_mb = ([(by_name[v][k] if v in by_name else None) for v in self.names.values] + [None]
                              for k in ("vstage", "mb"))
        step_valid = step != _NO_STEP
        events = columns.table({
            "ts_ns": columns.from_numpy(ts, ts_valid if not ts_valid.all() else None),
            "dur_ns": columns.from_numpy(dur),
            "kind": self.kinds.array(final_kind),
            "name": self.names.array(name),
            "tid": self.tids.array(tid),
            "step": columns.from_numpy(np.where(step_valid, step, 0).astype(np.int32), step_valid),
            "phase": phases.array(lut_phase[name]),
            "vstage": _take_int32(lut_vstage, name),
            "microbatch": _take_int32(lut_mb, name),
            "correlation": columns.from_numpy(corr, corr_valid),
            "is_comm": columns.from_bools(np.array(self.comm_name + [False], dtype=bool)[name], name >= 0),
        })
        comm = self._comm_table(events, step, step_valid)
        return Built(events=events, steps=steps, comm=comm, comm_annotations=comm_ann, pids=self._pids())

    def _steps(self, ts: np.ndarray, ts_valid: np.ndarray, dur: np.ndarray, kind: np.ndarray,
               name: np.ndarray) -> list[Span]:
        numbers = [_step_number(v) for v in self.names.values]
        lut = np.array([-1 if s is None else s for s in numbers] + [-1], dtype=np.int64)
        of_name = lut[name]
        sel = (of_name >= 0) & np.isin(kind, [self.kinds.ids[k] for k in STEP_KINDS if k in self.kinds.ids])
        spans: dict[int, list] = {}
        for s, t, v, d in zip(of_name[sel].tolist(), ts[sel].tolist(), ts_valid[sel].tolist(), dur[sel].tolist()):
            span = spans.setdefault(s, [None, None])
            if v:
                span[0] = t if span[0] is None else min(span[0], t)
                span[1] = t + d if span[1] is None else max(span[1], t + d)
        out = [Span(s, a, b) for s, (a, b) in spans.items()]
        out.sort(key=lambda sp: (sp.start_ns is None, sp.start_ns or 0, sp.step))
        return out

    def _step_of_events(self, steps: list[Span], ts: np.ndarray, ts_valid: np.ndarray, kind: np.ndarray,
                        corr: np.ndarray, corr_valid: np.ndarray) -> np.ndarray:
        by_time = _step_by_time(steps, ts, ts_valid)
        runtime = self.kinds.ids.get("runtime", -2)
        sel = (kind == runtime) & corr_valid & (by_time != _NO_STEP)
        if not sel.any():
            return by_time
        # The launch's step: the smallest step among the runtime calls of each correlation id.
        c, s = corr[sel], by_time[sel]
        order = np.lexsort((s, c))
        c, s = c[order], s[order]
        first = np.ones(len(c), dtype=bool)
        first[1:] = c[1:] != c[:-1]
        launch_corr, launch_step = c[first], s[first]
        gpu = np.isin(kind, [self.kinds.ids[k] for k in GPU_KINDS if k in self.kinds.ids]) & corr_valid
        at = np.searchsorted(launch_corr, corr).clip(0, len(launch_corr) - 1)
        found = gpu & (launch_corr[at] == corr)
        return np.where(found, launch_step[at], by_time)

    def _comm_table(self, events: pa.Table, step: np.ndarray, step_valid: np.ndarray) -> pa.Table:
        p = self.parts
        rows = np.concatenate(p["comm_rows"]) if p["comm_rows"] else np.zeros(0, dtype=np.int64)
        idx = columns.from_numpy(rows.astype(np.int64))
        raw_kind = np.concatenate(p["kind"]).astype(np.int32)[rows] if len(rows) else np.zeros(0, dtype=np.int32)
        cols = {"ts_ns": events.column("ts_ns").take(idx), "dur_ns": events.column("dur_ns").take(idx),
                "kind": self.kinds.array(raw_kind).cast(pa.string()),
                "name": events.column("name").take(idx).cast(pa.string()),
                "tid": events.column("tid").take(idx).cast(pa.string()),
                "step": columns.from_numpy(step[rows].astype(np.int32), step_valid[rows])}
        for k in COMM_FIELDS:
            parts = [a[k] for a in p["comm_args"]]
            cols[k] = pa.concat_arrays(parts) if parts else pa.nulls(0, pa.string())
        return columns.table({k: columns.one_array(v) for k, v in cols.items()})

    def _pids(self) -> list[int]:
        if not self.pid_counts:
            return []
        texts = list(self.pid_counts)
        ints = try_bigint(self.con, columns.from_values(texts, pa.string())).to_pylist()
        counts: dict[int, int] = {}
        for t, i in zip(texts, ints):
            if i is not None:
                counts[i] = counts.get(i, 0) + self.pid_counts[t]
        return sorted(counts, key=lambda i: (-counts[i], i))


_NO_STEP = np.iinfo(np.int64).min
# Arrow scalars for compute functions (a Python value would be converted by pa.scalar, which
# imports pandas: tracekit.ingest.columns)
_TRACE = columns.scalar("Trace", pa.string())
_FALSE = columns.scalar(False, pa.bool_())
_ZERO = columns.scalar(0.0, pa.float64())
_THOUSAND = columns.scalar(1000.0, pa.float64())
_THOUSAND_INT = columns.scalar(1000, pa.int64())


def try_bigint(con: duckdb.DuckDBPyConnection, text: pa.Array) -> pa.Array:
    """DuckDB's TRY_CAST(text AS BIGINT) of a string array (unreadable: null): Arrow's own cast
    where every value is a plain integer (it agrees with DuckDB there, and is cheaper), DuckDB's
    otherwise."""
    try:
        return pc.cast(text, pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    cur = con.cursor()  # its own: DuckDB's JSON reader may be streaming on ``con``
    try:
        cur.register("_tk_try_bigint", columns.table({"v": text}))
        res = cur.sql("SELECT TRY_CAST(v AS BIGINT) AS v FROM _tk_try_bigint").to_arrow_table()
    finally:
        cur.close()
    return columns.one_array(res.column("v"))


# A list of small non-negative integers as the profiler writes 'Process Group Ranks': read here,
# as DuckDB's cast reads it (tests/test_ingest_kineto_rows.py compares), without a query.
_PLAIN_INT_LIST = re.compile(r"\[(?:(?:0|[1-9][0-9]{0,8})(?:, (?:0|[1-9][0-9]{0,8}))*)?\]")


def try_cast_values(con: duckdb.DuckDBPyConnection, values: list[str], sql_type: str) -> list:
    """DuckDB's TRY_CAST(value AS sql_type) of a few strings, as Python values (a list type through
    Arrow would import pandas)."""
    if not values:
        return []
    if sql_type == "INTEGER[]" and all(_PLAIN_INT_LIST.fullmatch(v) for v in values):
        return [[int(x) for x in v[1:-1].split(", ")] if len(v) > 2 else [] for v in values]
    cur = con.cursor()
    try:
        row = cur.execute(f"SELECT [TRY_CAST(x AS {sql_type}) FOR x IN $1::VARCHAR[]]", [values]).fetchone()
    finally:
        cur.close()
    return list(row[0]) if row else []


def _step_number(name: str) -> int | None:
    m = _STEP_NAME.fullmatch(name)
    if m is None:
        return None
    s = int(m.group(1))
    return s if s <= _INT32_MAX else None  # TRY_CAST(... AS INTEGER)


def _step_by_time(steps: list[Span], ts: np.ndarray, ts_valid: np.ndarray) -> np.ndarray:
    """The first span (by start) with start <= ts < end, for every event."""
    out = np.full(len(ts), _NO_STEP, dtype=np.int64)
    spans = [s for s in steps if s.start_ns is not None and s.end_ns is not None]
    if not spans:
        return out
    starts = np.array([s.start_ns for s in spans], dtype=np.int64)
    ends = np.array([s.end_ns for s in spans], dtype=np.int64)
    numbers = np.array([s.step for s in spans], dtype=np.int64)
    if (ends[:-1] <= starts[1:]).all():  # disjoint, as a profiler schedule's steps are: one search
        at = np.searchsorted(starts, ts, side="right") - 1
        inside = ts_valid & (at >= 0) & (ts < ends[at.clip(0)])
        out[inside] = numbers[at[inside]]
        return out
    for a, b, s in zip(starts[::-1], ends[::-1], numbers[::-1]):  # overlapping: the earliest wins
        out[ts_valid & (ts >= a) & (ts < b)] = s
    return out


def _take_int32(values: list[int | None], idx: np.ndarray) -> pa.Array:
    arr = np.array([0 if v is None else v for v in values], dtype=np.int32)
    valid = np.array([v is not None for v in values], dtype=bool)
    return columns.from_numpy(arr[idx], valid[idx] if not valid.all() else None)


def _annotations(names: list[str]) -> tuple[list[dict], list[dict]]:
    """The tk.comm and tk.compute names, parsed with the convention's own parser."""
    comm, comp = [], []
    for n in names:
        if not (n.startswith(COMM_PREFIX) or n.startswith(COMPUTE_PREFIX)):
            continue
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
    return comm, comp
