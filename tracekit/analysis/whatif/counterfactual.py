"""Counterfactual durations: what each node would take if a rank, a link or a dimension were healthy.

Every function takes the graphs and their recorded ``Params`` and returns new ``Params`` per graph;
``replay`` then says how long the steps would take.

- ``steady``: every node at its median over the (steady) steps: the run's typical step.
- ``ideal``: every node at its typical time and no idle gaps (the what-if analyzer's ideal step):
  a node's typical time is over its peers (``peer_key``) in every step; compute uses the mean on
  op tables (the analyzer's statistic, so its published numbers are reproduced) and the median
  elsewhere (with a handful of ranks, one of them the fault, a mean would keep much of the fault);
  communication always the median. Idle gaps are dropped, as the analyzer drops launch delays.
- ``heal_rank``: the rank's compute at its peers' median (the ranks of its stage, same step).
- ``heal_link``: the transfers over a pair of ranks at the median of the same kind of op elsewhere.
- ``balance``: each rank's compute of a phase scaled so that the ranks of its CP (or PP) group do
  the group's mean.
- ``restore``: the ideal with some nodes (a DP rank, a stage, an op type) back at their recorded
  time: the decomposition of the slowdown.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tracekit.analysis.whatif.graph import StepGraph, WhatIfError
from tracekit.analysis.whatif.replay import Params

COMPUTE_LABELS = frozenset({"forward-compute", "backward-compute", "optimizer", "fwd", "bwd", "opt"})


def is_compute(g: StepGraph) -> np.ndarray:
    return (g.nodes["kind"] == "work").to_numpy() & g.nodes["label"].is_in(list(COMPUTE_LABELS)).to_numpy()


def _long(gs: list[StepGraph], ps: list[Params], cols: list[str]) -> pl.DataFrame:
    """One row per (graph, node, step): g, node, step index, dur, and the node columns asked for."""
    frames = []
    for gi, (g, p) in enumerate(zip(gs, ps)):
        n, S = p.dur.shape
        base = g.nodes.select("node", *cols)
        frames.append(pl.DataFrame({"g": np.full(n * S, gi), "node": np.repeat(np.arange(n), S),
                                    "s": np.tile(np.arange(S), n), "step": np.tile(np.array(g.steps), n),
                                    "dur": p.dur.reshape(-1)}).join(base, on="node", how="left"))
    return pl.concat(frames)


def _scatter(gs: list[StepGraph], ps: list[Params], rows: pl.DataFrame, col: str, zero_delay: bool = False,
             mask: pl.Expr | None = None) -> list[Params]:
    out = []
    for gi, (g, p) in enumerate(zip(gs, ps)):
        q = p.copy()
        if zero_delay:
            q.delay[:] = 0.0
        sel = rows.filter(pl.col("g") == gi)
        if mask is not None:
            sel = sel.filter(mask)
        sel = sel.filter(pl.col(col).is_not_null())
        q.dur[sel["node"].to_numpy(), sel["s"].to_numpy()] = sel[col].to_numpy()
        out.append(q)
    return out


def steady(gs: list[StepGraph], rec: list[Params], keep: set[int]) -> list[Params]:
    """Every node at its median over the steps in ``keep`` (its steady time), without idle gaps, in
    every step column. On a shared machine a disturbance (a descheduled rank, a slow transfer) lands
    on different ops in different steps; an op's median over steps drops it where a step's own time,
    even the least disturbed step's, keeps what landed in that step."""
    out = []
    for g, p in zip(gs, rec):
        cols = [i for i, s in enumerate(g.steps) if s in keep]
        if not cols:  # a structure seen only in excluded steps: its own steps are all there is
            cols = list(range(len(g.steps)))
        typ = np.median(p.dur[:, cols], axis=1, keepdims=True)
        out.append(Params(np.repeat(typ, p.dur.shape[1], axis=1), np.zeros_like(p.delay)))
    return out


def ideal(gs: list[StepGraph], rec: list[Params], compute_stat: str) -> list[Params]:
    rows = _long(gs, rec, ["peer_key", "is_comm"])
    stat = pl.col("dur").mean() if compute_stat == "mean" else pl.col("dur").median()
    typ = rows.group_by("peer_key", "is_comm").agg(pl.when(pl.col("is_comm").first()).then(pl.col("dur").median())
                                                   .otherwise(stat).alias("typ"))
    rows = rows.join(typ, on=["peer_key", "is_comm"], how="left")
    return _scatter(gs, rec, rows, "typ", zero_delay=True)


def heal_rank(gs: list[StepGraph], rec: list[Params], ranks: set[int]) -> list[Params]:
    """Each of ``ranks``' compute nodes at the median of its peers' in the same step: its DP replicas
    (same stage, same TP and CP shard: the same work on other data), else the other ranks of its stage."""
    rows = _long(gs, rec, ["rank", "pp", "tp", "cp", "peer_key"])
    comp = pl.concat([pl.DataFrame({"g": gi, "node": np.arange(g.n), "compute": is_compute(g)}) for gi, g in enumerate(gs)])
    rows = rows.join(comp, on=["g", "node"]).filter(pl.col("compute"))
    healthy = rows.filter(~pl.col("rank").is_in(list(ranks)))
    target = rows.filter(pl.col("rank").is_in(list(ranks)))
    if not target.height:
        raise WhatIfError(f"ranks {sorted(ranks)} have no compute in the replayed steps")
    for i, key in enumerate((["g", "s", "pp", "tp", "cp", "peer_key"], ["g", "s", "pp", "peer_key"])):
        peers = healthy.group_by(key).agg(pl.col("dur").median().alias(f"h{i}"))
        target = target.join(peers, on=key, how="left")
    return _scatter(gs, rec, target.with_columns(pl.coalesce("h0", "h1").alias("healthy")), "healthy")


def instance_ranks(g: StepGraph) -> list[frozenset[int]]:
    """The ranks taking part in each node's communication (empty for local work)."""
    ranks = g.column("rank")
    by_join: dict[int, set[int]] = {}
    for i, j in enumerate(g.join):
        if j >= 0:
            by_join.setdefault(int(j), set()).add(int(ranks[i]))
    out = [frozenset(by_join[int(j)]) if j >= 0 else frozenset() for j in g.join]
    for i, arr in enumerate(g.arrive):
        for a in arr:  # a receive and its send: the pair
            pair = frozenset({int(ranks[i]), int(ranks[a])})
            out[i] = out[a] = pair
    return out


def heal_link(gs: list[StepGraph], rec: list[Params], a: int, b: int) -> list[Params]:
    rows = _long(gs, rec, ["label", "is_comm"]).filter(pl.col("is_comm"))
    over = pl.concat([pl.DataFrame({"g": gi, "node": np.arange(g.n),
                                    "over": [a in m and b in m for m in instance_ranks(g)]}) for gi, g in enumerate(gs)])
    rows = rows.join(over, on=["g", "node"])
    if not rows["over"].any():
        raise WhatIfError(f"no communication between ranks {a} and {b} in the replayed steps")
    typical = rows.filter(~pl.col("over")).group_by("label").agg(pl.col("dur").median().alias("healthy"))
    return _scatter(gs, rec, rows.filter(pl.col("over")).join(typical, on="label", how="left"), "healthy")


def balance(gs: list[StepGraph], rec: list[Params], dim: str) -> list[Params]:
    """Each rank's compute of a label scaled to its ``dim`` group's mean (the group: ranks sharing
    every other coordinate)."""
    others = [d for d in ("dp", "pp", "cp", "tp") if d != dim]
    rows = _long(gs, rec, ["rank", "label", *others])
    comp = pl.concat([pl.DataFrame({"g": gi, "node": np.arange(g.n), "compute": is_compute(g)}) for gi, g in enumerate(gs)])
    rows = rows.join(comp, on=["g", "node"]).filter(pl.col("compute"))
    tot = rows.group_by("g", "s", "rank", "label", *others).agg(pl.col("dur").sum().alias("own"))
    tot = tot.with_columns(pl.col("own").mean().over("g", "s", "label", *others).alias("mean"),
                           pl.len().over("g", "s", "label", *others).alias("members"))
    if int(tot["members"].max() or 0) < 2:
        raise WhatIfError(f"no {dim.upper()} group with two or more ranks to balance")
    rows = rows.join(tot, on=["g", "s", "rank", "label", *others]).with_columns(
        (pl.col("dur") * pl.col("mean") / pl.col("own")).alias("balanced"))
    return _scatter(gs, rec, rows.filter(pl.col("own") > 0), "balanced")


def restore(gs: list[StepGraph], ideal_ps: list[Params], rec: list[Params], column: str, value) -> list[Params]:
    """The ideal, with the nodes whose ``column`` is ``value`` at their recorded durations."""
    out = []
    for g, ip, rp in zip(gs, ideal_ps, rec):
        q = ip.copy()
        sel = (g.nodes[column] == value).to_numpy()
        q.dur[sel] = rp.dur[sel]
        out.append(q)
    return out
