"""A small discrete-event model of a 4D-parallel job that writes the store's tables.

Used only by the analysis tests, to place a fault at a chosen position with known ground truth.
Schedule: all-forward-all-backward pipeline; inside each stage block, per micro-batch, compute,
a CP all-gather, more compute and a TP all-reduce; after the backward pass a DP reduce-scatter,
the optimizer, and a DP all-gather. p2p sends are asynchronous, receives block. Times in ns.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from tracekit.analysis.tables import conform
from tracekit.topology import Layout

MS = 1_000_000


@dataclass
class Faults:
    slow_rank: int | None = None
    slow_factor: float = 1.3
    slow_steps: tuple[int, ...] | None = None  # None: every step
    slow_link: tuple[int, int] | None = None  # p2p pair whose transfers are slow
    link_factor: float = 20.0
    slow_group: str | None = None  # a collective group (pg_name) whose transfers are slow
    group_factor: float = 10.0
    cpu_bound_rank: int | None = None
    cpu_gap_ns: int = 2 * MS  # idle before each compute op on the CPU-bound rank
    data_imbalance: float = 0.0  # sigma of a per (step, replica, micro-batch) work multiplier
    uneven_rank: int | None = None  # a rank whose first micro-batch carries more work every step
    uneven_factor: float = 1.6
    heavy_stage: int | None = None  # a stage with more layers in every replica
    heavy_factor: float = 1.6
    host_skew_ns: dict[int, int] = field(default_factory=dict)


def make_job(layout: Layout = Layout(tp=2, cp=2, pp=2, dp=2), steps: int = 8, microbatches: int = 4,
             faults: Faults = Faults(), noise: float = 0.01, ranks_per_host: int = 4, seed: int = 0,
             run_id: str = "synthetic") -> dict[str, pl.DataFrame]:
    rng = np.random.default_rng(seed)
    W = layout.world_size
    coords = [layout.coords(r) for r in range(W)]
    host = [r // ranks_per_host for r in range(W)]
    skew = [faults.host_skew_ns.get(host[r], 0) for r in range(W)]
    pg_of = {}
    for dim in ("tp", "cp", "pp", "dp"):
        for g in layout.groups(dim):
            for r in g:
                pg_of[(dim, r)] = (f"{dim}:{g[0]}", g)
    seq = defaultdict(int)
    events, colls, p2ps, step_rows = [], [], [], []
    free = [0] * W

    def comp(r, t0, dur, phase, step, mb):
        gap = faults.cpu_gap_ns if r == faults.cpu_bound_rank else 0
        t0 += gap
        events.append((r, t0 + skew[r], dur, "user_annotation", f"tk.compute phase={phase} vstage={coords[r].pp} mb={mb}",
                       "main", step, phase, coords[r].pp if phase != "opt" else None, mb, False))
        return t0 + dur

    def collective(dim, members, arrive, op, step, xfer):
        pg, group = pg_of[(dim, members[0])]
        s = seq[pg]
        seq[pg] += 1
        last = max(arrive[r] for r in members)
        if pg == faults.slow_group:
            xfer = int(xfer * faults.group_factor)
        end = {}
        for r in members:
            end[r] = last + xfer + int(rng.integers(0, 20_000))
            colls.append((r, pg, s, op, arrive[r] + skew[r], end[r] + skew[r], step))
        return end

    def work(r, step, base, mult, mb):
        f = mult
        if r == faults.uneven_rank and mb == 0:
            f *= faults.uneven_factor
        if r == faults.slow_rank and (faults.slow_steps is None or step in faults.slow_steps):
            f *= faults.slow_factor
        if faults.heavy_stage is not None and coords[r].pp == faults.heavy_stage:
            f *= faults.heavy_factor
        return int(base * f * (1 + noise * rng.standard_normal()))

    def block(d, s, phase, mb, step, start, mult):
        ranks = [layout.rank_of(dp=d, pp=s, cp=c, tp=t) for c in range(layout.cp) for t in range(layout.tp)]
        base = 6 * MS if phase == "fwd" else 12 * MS
        a = {r: comp(r, start[r], work(r, step, base * 0.6, mult, mb), phase, step, mb) for r in ranks}
        if layout.cp > 1:
            e = {}
            for t in range(layout.tp):
                e.update(collective("cp", layout.group(layout.rank_of(dp=d, pp=s, tp=t), "cp"), a,
                                    "all_gather", step, MS // 2))
            a = e
        a = {r: comp(r, a[r], work(r, step, base * 0.4, mult, mb), phase, step, mb) for r in ranks}
        if layout.tp > 1:
            e = {}
            for c in range(layout.cp):
                e.update(collective("tp", layout.group(layout.rank_of(dp=d, pp=s, cp=c), "tp"), a,
                                    "all_reduce", step, MS // 3))
            a = e
        return a

    def p2p(src, dst, ready_src, step, mb):
        f = faults.link_factor if faults.slow_link and {src, dst} == set(faults.slow_link) else 1.0
        xfer = int(0.4 * MS * f)
        pg = pg_of[("pp", src)][0]
        post = free[dst]
        end = max(ready_src, post) + xfer
        key = (pg, src, dst)
        s = seq[key]
        seq[key] += 1
        p2ps.append((src, dst, "send", pg, s, ready_src + skew[src], end + skew[src], step, mb))
        p2ps.append((dst, src, "recv", pg, s, post + skew[dst], end + skew[dst], step, mb))
        return end

    for step in range(steps):
        begin = list(free)
        mult = np.exp(faults.data_imbalance * rng.standard_normal((layout.dp, microbatches)))
        for phase, order in (("fwd", range(layout.pp)), ("bwd", range(layout.pp - 1, -1, -1))):
            for mb in range(microbatches):
                for d in range(layout.dp):
                    prev = None
                    for s in order:
                        start = {}
                        for c in range(layout.cp):
                            for t in range(layout.tp):
                                r = layout.rank_of(dp=d, pp=s, cp=c, tp=t)
                                start[r] = free[r]
                                if prev is not None:
                                    src = layout.rank_of(dp=d, pp=prev, cp=c, tp=t)
                                    start[r] = max(free[r], p2p(src, r, free[src], step, mb))
                        end = block(d, s, phase, mb, step, start, float(mult[d, mb]))
                        for r, t_end in end.items():
                            free[r] = t_end
                        prev = s
        for op in ("reduce_scatter", "all_gather"):
            if layout.dp > 1:
                arrive = dict(enumerate(free))
                for g in layout.groups("dp"):
                    for r, t_end in collective("dp", g, arrive, op, step, 2 * MS).items():
                        free[r] = t_end
            if op == "reduce_scatter":
                free = [comp(r, free[r], 2 * MS, "opt", step, None) for r in range(W)]
        for r in range(W):
            step_rows.append((r, step, begin[r] + skew[r], free[r] + skew[r]))

    ev = pl.DataFrame(events, schema=["rank", "ts_ns", "dur_ns", "kind", "name", "tid", "step", "phase",
                                      "vstage", "microbatch", "is_comm"], orient="row")
    out = {
        "runs": pl.DataFrame({"run_id": [run_id], "source": ["synthetic"], "root": [None], "world_size": [W],
                              "tp": [layout.tp], "cp": [layout.cp], "pp": [layout.pp], "dp": [layout.dp],
                              "layout_source": ["manifest"], "backend": ["model"],
                              "manifest": [json.dumps({"faults": repr(faults)})], "ingested_at": [None]}),
        "ranks": pl.DataFrame({"rank": list(range(W)), "dp": [c.dp for c in coords], "pp": [c.pp for c in coords],
                               "cp": [c.cp for c in coords], "tp": [c.tp for c in coords],
                               "host": [f"host{h}" for h in host], "pid": list(range(W)),
                               "clock_offset_ns": [None] * W}),
        "groups": pl.DataFrame([(pg, dim, list(g), len(g)) for (dim, r), (pg, g) in pg_of.items() if r == g[0]],
                               schema=["pg_name", "dim", "ranks", "size"], orient="row")
        .with_columns(pl.col("dim").alias("pg_desc")),
        "events": ev,
        "collectives": pl.DataFrame(colls, schema=["rank", "pg_name", "seq", "op", "start_ns", "end_ns", "step"],
                                    orient="row").with_columns(pl.lit("annotation").alias("source")),
        "p2p": pl.DataFrame(p2ps, schema=["rank", "peer", "direction", "pg_name", "seq", "start_ns", "end_ns",
                                          "step", "microbatch"], orient="row"),
        "steps": pl.DataFrame(step_rows, schema=["rank", "step", "start_ns", "end_ns"], orient="row"),
    }
    return {t: conform(df.with_columns(pl.lit(run_id).alias("run_id")), t) for t, df in out.items()}
