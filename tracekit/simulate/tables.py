"""The simulated run as the store's tables, straight (no traces): for worlds too large for Kineto files.

``run_tables(cfg)`` yields, one pipeline stage at a time, the rows an ingest of the Kineto and
flight-recorder output would give for that stage's ranks (``tests/test_simulate_tables.py``
compares the two), so that 16,384 ranks x 20 steps never sit in memory as one frame:
- events: the compute kernels (communication kernels are the collectives' and p2p's rows; the CPU
  side, launches and ProfilerStep annotations are left out: the steps table has the steps);
- collectives and p2p as the profiler records them (source ``kernel``), p2p with its peer;
- steps, ranks, groups, runs (with the manifest: config and ground truth);
- fr_entries: each rank's newest ``fr_tail`` flight-recorder entries (torch keeps a ring buffer,
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``), enough to find where a hung job stopped.
All times are on each host's skewed, drifting clock, as the traces would carry them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import polars as pl

from tracekit.simulate.clock import EPOCH_NS, Clocks
from tracekit.simulate.config import SimConfig
from tracekit.simulate.flight import POLL_MS, TIMEOUT_MS
from tracekit.simulate.kineto import PROFILING_NAME, kernel_name, new_nccl
from tracekit.simulate.model import Trace
from tracekit.simulate.ranks import STREAMS
from tracekit.simulate.run import manifest, run_model
from tracekit.simulate.schedule import Groups

FR_TAIL = 64
BYTES = {"BFloat16": 2, "Float": 4}
FRAMES = json.dumps([{"name": "train_step", "filename": "train.py", "line": 412}])


def run_tables(cfg: SimConfig, run_id: str, fr_tail: int = FR_TAIL) -> Iterator[dict[str, pl.DataFrame]]:
    """Simulate ``cfg``; yield the store's tables of ``run_id``: first runs, ranks and groups, then
    per pipeline stage its events, collectives, p2p, steps and fr_entries."""
    trace, faults = run_model(cfg)
    groups = Groups(cfg)
    clocks = Clocks(cfg)
    man = manifest(cfg, faults, trace, clocks, groups, _blocked(trace))
    yield {"runs": _runs(cfg, run_id, man), "ranks": _ranks(cfg, run_id, clocks), "groups": _groups(cfg, run_id, groups)}
    new = new_nccl(cfg.seed)
    for p in range(cfg.pp):  # one stage's arrays at a time: 16,384 ranks' would not fit at once
        stage = _Stage(trace, p, clocks, groups)
        yield {t: df.with_columns(pl.lit(run_id).alias("run_id")) for t, df in stage.tables(new, fr_tail).items()}
        del stage


def _rank(cfg: SimConfig, d, c, p, t):
    """The ranks at coordinates (dp, cp, pp, tp), numbered in the job's order (``cfg.layout``)."""
    lay = cfg.layout
    return t * lay.stride("tp") + c * lay.stride("cp") + p * lay.stride("pp") + d * lay.stride("dp")


def _blocked(trace: Trace) -> list[int]:
    """Ranks with an op issued and never completed (the ranks a hang blocks)."""
    cfg = trace.cfg
    out = []
    for p, ops in enumerate(trace.ops):
        stuck = np.zeros((cfg.dp, cfg.cp, cfg.tp), dtype=bool)
        for o in ops:
            stuck |= np.isfinite(o.start) & ~np.isfinite(o.end)
        d, c, t = np.nonzero(stuck)
        out += _rank(cfg, d, c, p, t).tolist()
    return sorted(out)


def _runs(cfg: SimConfig, run_id: str, man: dict) -> pl.DataFrame:
    return pl.DataFrame({"run_id": [run_id], "source": ["trainer"], "root": [f"simulate:{run_id}"],
                         "world_size": [cfg.world_size], "tp": [cfg.tp], "cp": [cfg.cp], "pp": [cfg.pp], "dp": [cfg.dp],
                         "layout_source": ["manifest"], "backend": ["nccl"], "manifest": [json.dumps(man)]})


def _ranks(cfg: SimConfig, run_id: str, clocks: Clocks) -> pl.DataFrame:
    r = np.arange(cfg.world_size)
    lay = cfg.layout
    tp, cp, pp, dp = (r // lay.stride(x) % getattr(lay, x) for x in ("tp", "cp", "pp", "dp"))
    return pl.DataFrame({"run_id": run_id, "rank": r, "dp": dp, "pp": pp, "cp": cp, "tp": tp,
                         "host": [f"node{h:04d}" for h in (r // clocks.rph).tolist()], "pid": 100_000 + 17 * r})


def _groups(cfg: SimConfig, run_id: str, groups: Groups) -> pl.DataFrame:
    lay, world = cfg.layout, cfg.world_size
    rows = []
    for g in groups.all:
        ranks = list(g.ranks)
        dim = lay.dim_of(ranks) or ("world" if len(ranks) == world else "other")
        rows.append((g.name, g.desc, dim, ranks, len(ranks)))
    return pl.DataFrame(rows, schema={"pg_name": pl.Utf8, "pg_desc": pl.Utf8, "dim": pl.Utf8,
                                      "ranks": pl.List(pl.Int32), "size": pl.Int32}, orient="row"
                        ).with_columns(pl.lit(run_id).alias("run_id"))


class _Stage:
    """One pipeline stage: every op x every lane (dp, cp, tp), flattened to lanes."""

    def __init__(self, trace: Trace, p: int, clocks: Clocks, groups: Groups) -> None:
        cfg = trace.cfg
        self.cfg, self.p, self.ops, self.groups = cfg, p, trace.ops[p], groups
        d, c, t = np.meshgrid(np.arange(cfg.dp), np.arange(cfg.cp), np.arange(cfg.tp), indexing="ij")
        self.rank = _rank(cfg, d, c, p, t).ravel()
        host = self.rank // clocks.rph
        self.skew, self.rate = clocks.skew_ms[host], 1 + clocks.drift_ppm[host] * 1e-6
        lanes = len(self.rank)
        shape = (len(self.ops), lanes)
        self.start = np.stack([o.start.ravel() for o in self.ops]) if self.ops else np.zeros(shape)
        self.end = np.stack([o.end.ravel() for o in self.ops]) if self.ops else np.zeros(shape)
        self.step_start = trace.step_start[:, p].reshape(cfg.steps, lanes)
        self.step_end = trace.step_end[:, p].reshape(cfg.steps, lanes)

    def tables(self, new: bool, fr_tail: int) -> dict[str, pl.DataFrame]:
        kinds = np.array([o.kind for o in self.ops])
        return {"events": self._events(kinds == "compute", new), "collectives": self._collectives(kinds == "collective"),
                "p2p": self._p2p(kinds), "steps": self._steps(), "fr_entries": self._fr(kinds, fr_tail)}

    def _rows(self, sel: np.ndarray, need_end: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(op index, lane) of the selected ops that were issued (and completed, with ``need_end``)."""
        ok = np.isfinite(self.start[sel]) & (np.isfinite(self.end[sel]) if need_end else True)
        op_i, lane = np.nonzero(ok)
        return np.flatnonzero(sel)[op_i], lane, ok

    def _times(self, op_i: np.ndarray, lane: np.ndarray) -> dict[str, np.ndarray]:
        s = EPOCH_NS + np.rint((self.skew[lane] + self.start[op_i, lane] * self.rate[lane]) * 1e6).astype(np.int64)
        e = EPOCH_NS + np.rint((self.skew[lane] + self.end[op_i, lane] * self.rate[lane]) * 1e6).astype(np.int64)
        return {"start_ns": s, "end_ns": e}

    def _per_op(self, op_i: np.ndarray, values: list, dtype=None) -> pl.Series:
        return pl.Series(values, dtype=dtype).gather(op_i)

    def _events(self, sel: np.ndarray, new: bool) -> pl.DataFrame:
        op_i, lane, _ = self._rows(sel)
        t = self._times(op_i, lane)
        names = [kernel_name(o, new) if o.kind == "compute" else "" for o in self.ops]
        return pl.DataFrame({
            "rank": self.rank[lane].astype(np.int32), "ts_ns": t["start_ns"], "dur_ns": t["end_ns"] - t["start_ns"],
            "kind": pl.Series(["kernel"] * len(op_i), dtype=pl.Utf8), "name": self._per_op(op_i, names, pl.Utf8),
            "tid": pl.Series([str(STREAMS["compute"])] * len(op_i), dtype=pl.Utf8),
            "step": self._per_op(op_i, [o.step for o in self.ops], pl.Int32),
            "phase": pl.Series([None] * len(op_i), dtype=pl.Utf8), "vstage": pl.Series([None] * len(op_i), dtype=pl.Int32),
            "microbatch": pl.Series([None] * len(op_i), dtype=pl.Int32), "correlation": (op_i + 1).astype(np.int64),
            "is_comm": np.zeros(len(op_i), dtype=bool)}).sort("rank", "ts_ns")

    def _lane_names(self, dim: str) -> np.ndarray:
        """Each lane's group name in ``dim`` (one lookup per lane, not per row)."""
        of = self.groups.of
        return np.array([of[(dim, int(r))].name if (dim, int(r)) in of else "?" for r in self.rank.tolist()],
                        dtype=object)

    def _collectives(self, sel: np.ndarray) -> pl.DataFrame:
        op_i, lane, _ = self._rows(sel)
        names = {d: self._lane_names(d) for d in {o.dim for o in self.ops if o.kind == "collective"}}
        dims = [o.dim for o in self.ops]
        pg = np.empty(len(op_i), dtype=object)
        op_dim = np.array(dims, dtype=object)[op_i] if len(op_i) else np.array([], dtype=object)
        for d, by_lane in names.items():
            m = op_dim == d
            pg[m] = by_lane[lane[m]]
        nbytes = [max(o.in_nelems, o.out_nelems) * BYTES[o.dtype] if o.name != "all_reduce"
                  else o.in_nelems * BYTES[o.dtype] for o in self.ops]
        return pl.DataFrame({
            "rank": self.rank[lane].astype(np.int32), "pg_name": pl.Series(pg.tolist(), dtype=pl.Utf8),
            "seq": self._per_op(op_i, [o.seq for o in self.ops], pl.Int64),
            "op": self._per_op(op_i, [o.name for o in self.ops], pl.Utf8), **self._times(op_i, lane),
            "nbytes": self._per_op(op_i, nbytes, pl.Int64), "dtype": self._per_op(op_i, [o.dtype for o in self.ops], pl.Utf8),
            "step": self._per_op(op_i, [o.step for o in self.ops], pl.Int32),
            "source": pl.Series(["kernel"] * len(op_i), dtype=pl.Utf8)}).sort("pg_name", "seq", "rank")

    def _p2p_seq(self) -> list[int]:
        """Per op, its count among the stage's earlier p2p ops of the same direction and peer stage."""
        seen: dict[tuple, int] = {}
        out = []
        for o in self.ops:
            key = (o.kind, o.peer_stage)
            out.append(seen.get(key, 0))
            if o.kind in ("send", "recv"):
                seen[key] = seen.get(key, 0) + 1
        return out

    def _p2p(self, kinds: np.ndarray) -> pl.DataFrame:
        op_i, lane, _ = self._rows((kinds == "send") | (kinds == "recv"))
        cfg = self.cfg
        peer_stage = np.array([o.peer_stage if o.peer_stage is not None else -1 for o in self.ops])[op_i]
        rank = self.rank[lane]
        peer = rank + (peer_stage - self.p) * cfg.layout.stride("pp")
        pp_names = self._lane_names("pp")
        return pl.DataFrame({
            "rank": rank.astype(np.int32), "peer": peer.astype(np.int32),
            "direction": self._per_op(op_i, [o.kind for o in self.ops], pl.Utf8),
            "pg_name": pl.Series(pp_names[lane].tolist(), dtype=pl.Utf8),
            "seq": self._per_op(op_i, self._p2p_seq(), pl.Int64), **self._times(op_i, lane),
            "nbytes": self._per_op(op_i, [o.in_nelems * BYTES[o.dtype] for o in self.ops], pl.Int64),
            "step": self._per_op(op_i, [o.step for o in self.ops], pl.Int32),
            "microbatch": pl.Series([None] * len(op_i), dtype=pl.Int32),
            "source": pl.Series(["kernel"] * len(op_i), dtype=pl.Utf8)}).sort("rank", "start_ns")

    def _steps(self) -> pl.DataFrame:
        steps = np.array([o.step for o in self.ops])
        last = np.full(self.step_start.shape, -np.inf)
        seen = np.where(np.isfinite(self.end), self.end, np.where(np.isfinite(self.start), self.start, -np.inf))
        for s in range(self.cfg.steps):
            if (steps == s).any():
                last[s] = seen[steps == s].max(axis=0)
        s0 = self.step_start
        s1 = np.where(np.isfinite(self.step_end), self.step_end, np.maximum(last, s0))
        step_i, lane = np.nonzero(np.isfinite(s0))
        lanes = lane
        start = EPOCH_NS + np.rint((self.skew[lanes] + s0[step_i, lanes] * self.rate[lanes]) * 1e6).astype(np.int64)
        end = EPOCH_NS + np.rint((self.skew[lanes] + s1[step_i, lanes] * self.rate[lanes]) * 1e6).astype(np.int64)
        return pl.DataFrame({"rank": self.rank[lanes].astype(np.int32), "step": step_i.astype(np.int32),
                             "start_ns": start - 50_000, "end_ns": end + 10_000}).sort("rank", "step")

    def _fr(self, kinds: np.ndarray, tail: int) -> pl.DataFrame:
        """The newest ``tail`` flight-recorder entries of each lane (flight.py's rules, vectorized)."""
        comm = np.flatnonzero(kinds != "compute")
        if not len(comm):
            return pl.DataFrame()
        start, end = self.start[comm], self.end[comm]
        issued, done = np.isfinite(start), np.isfinite(end)
        open_ = issued & ~done
        first_open = open_ & (np.cumsum(open_, axis=0) == 1)
        state = np.where(done, "completed", np.where(first_open, "started", "scheduled"))
        record = np.cumsum(issued, axis=0) - 1
        newest = issued & (record >= record.max(axis=0, initial=-1) - tail + 1)
        k, lane = np.nonzero(newest)
        ops = [self.ops[i] for i in comm]
        dims = [o.dim if o.kind == "collective" else "pp" for o in ops]
        names = {d: self._lane_names(d) for d in set(dims)}
        descs = {g.name: g.desc for g in self.groups.all}
        pg = np.array([names[dims[i]][ln] for i, ln in zip(k.tolist(), lane.tolist())], dtype=object)
        # per op: group counters (the same for every lane of the stage)
        coll_seq, p2p_seq, op_id, cs, ps, oi = [], [], [], {}, {}, {}
        for o, d in zip(ops, dims):
            oi[d] = oi.get(d, 0) + 1
            if o.kind == "collective":
                cs[d] = o.seq
            else:
                ps[d] = ps.get(d, 0) + 1
            coll_seq.append(cs.get(d, 0)), p2p_seq.append(ps.get(d, 0)), op_id.append(oi[d])
        me = self.p
        prof = [PROFILING_NAME[o.name] if o.kind == "collective" else
                (f"nccl:send {me}->{o.peer_stage}" if o.kind == "send" else f"nccl:recv {me}<-{o.peer_stage}")
                for o in ops]
        # each rank's recorder draws its poll phase and launch leads as flight.dump does
        phase, lead = np.empty(len(self.rank)), np.empty((len(self.ops), len(self.rank)))
        for j, r in enumerate(self.rank.tolist()):
            rng = np.random.default_rng([self.cfg.seed, 4, r])
            phase[j] = rng.uniform(0.0, POLL_MS)
            lead[:, j] = rng.uniform(0.015, 0.08, len(self.ops))
        phase = phase[lane]
        created = start[k, lane] - lead[comm[k], lane]
        s_true, e_true = start[k, lane], end[k, lane]
        polled = lambda t: phase + np.ceil((t - phase) / POLL_MS) * POLL_MS  # noqa: E731
        to_ns = lambda t: EPOCH_NS + np.rint((self.skew[lane] + np.where(np.isfinite(t), t, 0.0)  # noqa: E731
                                              * self.rate[lane]) * 1e6).astype(np.int64)
        st = state[k, lane]
        done_k = done[k, lane]
        sizes = [json.dumps([[o.in_nelems]]) for o in ops]
        out_sizes = [json.dumps([[o.out_nelems]]) for o in ops]
        dts = [json.dumps([o.dtype]) for o in ops]
        per = lambda vals, dt: pl.Series(vals, dtype=dt).gather(k)  # noqa: E731
        return pl.DataFrame({
            "rank": self.rank[lane].astype(np.int32), "record_id": record[k, lane].astype(np.int64),
            "pg_name": pg.tolist(), "pg_desc": [descs.get(n, "?") for n in pg.tolist()],
            "collective_seq_id": per(coll_seq, pl.Int64), "p2p_seq_id": per(p2p_seq, pl.Int64),
            "op_id": per(op_id, pl.Int64), "is_p2p": per([o.kind != "collective" for o in ops], pl.Boolean),
            "profiling_name": per(prof, pl.Utf8), "input_sizes": per(sizes, pl.Utf8), "input_dtypes": per(dts, pl.Utf8),
            "output_sizes": per(out_sizes, pl.Utf8), "output_dtypes": per(dts, pl.Utf8),
            "time_created_ns": to_ns(created),
            "time_started_ns": pl.Series(np.where(st != "scheduled", to_ns(polled(s_true)), 0)).set(
                pl.Series(st == "scheduled"), None),
            "time_completed_ns": pl.Series(to_ns(np.maximum(polled(e_true), polled(s_true)))).set(
                pl.Series(~done_k), None),
            "duration_ms": pl.Series(np.where(done_k, e_true - s_true, np.nan)).fill_nan(None),
            "state": st.tolist(), "retired": done_k, "timeout_ms": np.full(len(k), TIMEOUT_MS, dtype=np.int64),
            "frames": pl.Series([FRAMES] * len(k), dtype=pl.Utf8)}).sort("rank", "record_id")


def write_duckdb(cfg: SimConfig, path, run_id: str, fr_tail: int = FR_TAIL) -> None:
    """The simulated run's tables into the DuckDB store at ``path`` (created if new)."""
    from tracekit.analysis.tables import conform
    from tracekit.store import connect

    con = connect(path)
    try:
        con.execute("BEGIN")
        for chunk in run_tables(cfg, run_id, fr_tail):
            for table, df in chunk.items():
                if df.height:
                    frame = conform(df, table)  # noqa: F841 (DuckDB reads the local frame by name)
                    con.execute(f"INSERT INTO {table} SELECT * FROM frame")
        con.execute("UPDATE runs SET ingested_at = now() WHERE run_id = ?", [run_id])
        con.execute("COMMIT")
    finally:
        con.close()


def write_dataset(cfg: SimConfig, out, run_id: str, fr_tail: int = FR_TAIL) -> None:
    """The simulated run's tables as a Parquet dataset store at ``out`` (tracekit/dataset.py), one
    part per chunk; the ground truth is in ``runs.manifest``."""
    from tracekit.dataset import write_tables

    for i, chunk in enumerate(run_tables(cfg, run_id, fr_tail)):
        write_tables(out, {t: df for t, df in chunk.items() if df.height}, part=f"sim-{i:04d}")
