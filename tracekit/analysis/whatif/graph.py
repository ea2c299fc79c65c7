"""The step's dependency graph, as data, and the timings recorded on it.

A step is a set of *nodes* on ranks. A ``work`` node runs on its rank alone for ``dur``. A ``join``
node is one member's part in a communication instance (a collective, or the two sides of a p2p
transfer): the instance starts once every member has arrived, and each member ends ``dur`` (its
transfer time) later. Every node also waits for its *preds* (nodes whose end it needs, on its own
rank or, for a send or receive, on its own lanes) and then, as recorded, for a *delay* (time the
record shows it idle with everything it needs done: launch gaps, host work nobody traced). An
asynchronous send is a work node (its ``dur`` is the posting time: its rank goes on after it); the
receive waits for it to be posted (``arrive``: nodes whose *start* a node's transfer waits for) and
ends ``dur`` after the later of the two.

Steps whose nodes are the same (the same ops on the same ranks) share one graph and are replayed
together: ``start``/``end`` are ``[node, step]`` arrays of recorded times, in ns from the step's
start (the earliest op of the step on any rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl


class WhatIfError(ValueError):
    """Tables the what-if replay cannot model (no steps, unknown structure, a dependency cycle)."""


@dataclass
class StepGraph:
    steps: list[int]  # the steps sharing this structure
    nodes: pl.DataFrame  # one row per node, in node order: node, rank, kind, label, optype, dp, pp, cp, tp, peer_key
    preds: list[list[int]]
    join: np.ndarray  # join id per node, -1 for work nodes
    start: np.ndarray  # [node, step] recorded start, ns from the step's start
    end: np.ndarray  # [node, step] recorded end (an async send: when it was posted)
    measured: np.ndarray  # [step] measured step time, ns
    arrive: list[list[int]] = field(default_factory=list)  # nodes whose start a node's transfer waits for
    order: list[list[int]] = field(default_factory=list)  # super-nodes (a join's members together), topological

    def __post_init__(self) -> None:
        if not self.arrive:
            self.arrive = [[] for _ in self.preds]
        if not self.order:
            self.order = topological_order([p + a for p, a in zip(self.preds, self.arrive)], self.join)

    @property
    def n(self) -> int:
        return len(self.preds)

    def column(self, name: str) -> np.ndarray:
        return self.nodes[name].to_numpy()


def topological_order(preds: list[list[int]], join: np.ndarray) -> list[list[int]]:
    """Super-nodes in an order where every node comes after its preds; a join's members form one
    super-node (its instance starts when the last of them arrives)."""
    n = len(preds)
    members: dict[int, list[int]] = {}
    for i in range(n):
        if join[i] >= 0:
            members.setdefault(int(join[i]), []).append(i)
    sid = np.empty(n, dtype=np.int64)
    supers: list[list[int]] = []
    seen: dict[int, int] = {}
    for i in range(n):
        j = int(join[i])
        if j < 0:
            sid[i] = len(supers)
            supers.append([i])
        elif j in seen:
            sid[i] = seen[j]
        else:
            seen[j] = sid[i] = len(supers)
            supers.append(members[j])
    indeg = np.zeros(len(supers), dtype=np.int64)
    succ: list[list[int]] = [[] for _ in supers]
    for s, mem in enumerate(supers):
        ups = {int(sid[p]) for m in mem for p in preds[m]}
        ups.discard(s)
        indeg[s] = len(ups)
        for u in ups:
            succ[u].append(s)
    ready = [s for s in range(len(supers)) if indeg[s] == 0]
    out: list[list[int]] = []
    while ready:
        s = ready.pop()
        out.append(supers[s])
        for v in succ[s]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    if len(out) != len(supers):
        stuck = [supers[s][0] for s in range(len(supers)) if indeg[s] > 0][:5]
        raise WhatIfError(f"the dependency graph has a cycle (nodes {stuck} never become ready)")
    return out


def ordinal(frame: pl.DataFrame, by: list[str], time_col: str = "start") -> pl.DataFrame:
    """Number each row within ``by`` in time order, from 0 (``ord``)."""
    return frame.sort([*by, time_col]).with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over(by).alias("ord"))


def group_steps(ops: pl.DataFrame, key: list[str]) -> list[tuple[list[int], pl.DataFrame]]:
    """Steps whose op keys (``key`` columns) are the same, each with their ops; steps of one group share a graph."""
    sig = ops.group_by("step").agg(pl.concat_str([pl.col(k).cast(pl.Utf8) for k in key], separator="|")
                                   .sort().str.join(";").hash().alias("sig"))
    out = []
    for _, grp in sig.sort("step").group_by("sig", maintain_order=True):
        steps = sorted(grp["step"].to_list())
        out.append((steps, ops.filter(pl.col("step").is_in(steps))))
    return out


def timing_arrays(ops: pl.DataFrame, nodes: pl.DataFrame, key: list[str], steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``[node, step]`` start and end arrays from ops carrying ``key`` columns, ``step``, ``start``, ``end``."""
    idx = nodes.select(*key, "node")
    j = ops.join(idx, on=key, how="inner")
    col = {s: i for i, s in enumerate(steps)}
    n, S = nodes.height, len(steps)
    start = np.full((n, S), np.nan)
    end = np.full((n, S), np.nan)
    si = np.array([col[s] for s in j["step"].to_list()], dtype=np.int64)
    ni = j["node"].to_numpy()
    start[ni, si] = j["start"].to_numpy()
    end[ni, si] = j["end"].to_numpy()
    if np.isnan(start).any():
        raise WhatIfError("steps grouped as alike lack some of their ops (internal: step grouping)")
    return start, end
