"""The dependency graph of an op-table run (FORMATS.md section 4; ``tracekit.ingest.optable``).

Each worker (a store rank) records whole ops: forward/backward compute per micro-batch, p2p sends
and receives, the DP collectives, and the post-backward ops. What each op waits for (a Megatron-style
1F1B step without overlapped gradient reduction, vpp = 1):
- compute runs in its recorded order, one op after the other;
- the i-th receive of a kind is posted once the previous compute of that kind finished, and the
  compute that consumes it waits for it; the i-th send of a kind leaves after the compute that made it;
  sends and receives of one kind queue behind each other;
- a stage's ``params-all-gather`` and ``grads-reduce-scatter`` queue on one lane; the first forward
  of a model chunk waits for the chunk's all-gather;
- after the last compute: gc, the TP layernorm all-reduce, the embedding all-reduce (first and last
  stage), the gradient reduce-scatters, the clip all-reduce and the optimizer, in that order.
Joins: a send with its receive on the neighbouring stage of the same replica; an all-gather or a
reduce-scatter with the same one on every replica of its stage; the embedding all-reduce of a
replica's first and last stage; the clip all-reduce across every worker (the gradient norm is global).
The TP layernorm all-reduce is folded into its worker, so it is local work.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tracekit.analysis.tables import RunTables
from tracekit.analysis.whatif.graph import StepGraph, WhatIfError, group_steps, ordinal, timing_arrays

FWD, BWD = "forward-compute", "backward-compute"
RECV_OF = {"forward-recv": FWD, "backward-recv": BWD}
SEND_OF = {"forward-send": FWD, "backward-send": BWD}
POST_CHAIN = ("gc", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "grads-reduce-scatter",
              "optimizer-clip-main-grad", "optimizer")
DP_LANE = ("params-all-gather", "grads-reduce-scatter")
# Optypes that are communication for the ideal (their typical time is a median, the analyzer's choice).
COMM_OPTYPES = frozenset({*RECV_OF, *SEND_OF, *DP_LANE, "layernorm-grads-all-reduce",
                          "embedding-grads-all-reduce", "optimizer-clip-main-grad"})
PP_LABEL = {"forward-send": "forward-pp-comm", "forward-recv": "forward-pp-comm",
            "backward-send": "backward-pp-comm", "backward-recv": "backward-pp-comm"}
KEY = ["rank", "optype", "ord"]


def op_table_ops(t: RunTables) -> pl.DataFrame:
    """One row per op: rank, dp, pp, step, optype, ord (its number within rank, step and optype), start, end."""
    ev = t.events.filter(pl.col("step").is_not_null())
    if not ev.height:
        raise WhatIfError(f"run {t.run_id!r} has no ops with a step")
    offs = t.ranks.select(pl.col("rank").cast(pl.Int32), pl.col("dp").cast(pl.Int64), pl.col("pp").cast(pl.Int64),
                          pl.col("clock_offset_ns").fill_null(0))
    ops = ev.select(pl.col("rank").cast(pl.Int32), "step", pl.col("name").alias("optype"), "vstage",
                    pl.col("ts_ns").alias("t0"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("t1"))
    ops = ops.join(offs, on="rank").with_columns((pl.col("t0") - pl.col("clock_offset_ns")).alias("t0"),
                                                  (pl.col("t1") - pl.col("clock_offset_ns")).alias("t1"))
    base = ops.group_by("step").agg(pl.col("t0").min().alias("base"))
    ops = ops.join(base, on="step").with_columns((pl.col("t0") - pl.col("base")).cast(pl.Float64).alias("start"),
                                                 (pl.col("t1") - pl.col("base")).cast(pl.Float64).alias("end"))
    return ordinal(ops.drop("t0", "t1", "base", "clock_offset_ns"), ["step", "rank", "optype"])


def build(t: RunTables) -> list[StepGraph]:
    """One graph per group of alike steps."""
    meta = t.manifest.get("wia_meta", {})
    vpp = int(meta.get("vpp_size", 1) or 1)
    if vpp > 1:  # the 1F1B dependencies below pair the i-th receive with the i-th compute of one chunk
        raise WhatIfError(f"run {t.run_id!r}: interleaved pipelines (vpp_size {vpp} > 1) are not modelled for op "
                          "tables: their dependencies assume one model chunk per stage")
    ops = op_table_ops(t)
    return [_graph(steps, grp) for steps, grp in group_steps(ops, KEY)]


def _graph(steps: list[int], ops: pl.DataFrame) -> StepGraph:
    first = ops.filter(pl.col("step") == steps[0]).sort("rank", "start", "optype")
    nodes = first.select("rank", "dp", "pp", "optype", "ord", "vstage", "start", "end").with_row_index("node")
    nodes = nodes.with_columns(pl.col("node").cast(pl.Int64))
    preds: list[list[int]] = [[] for _ in range(nodes.height)]
    for (rank,), own in nodes.partition_by("rank", as_dict=True, maintain_order=True).items():
        _rank_deps(own, preds, rank)
    join = _joins(nodes)
    start, end = timing_arrays(ops, nodes, KEY, steps)
    labels = nodes.with_columns(
        pl.lit("work").alias("kind"),
        pl.col("optype").replace(PP_LABEL).alias("label"),
        pl.col("optype").alias("peer_key"),
        pl.col("optype").is_in(list(COMM_OPTYPES)).alias("is_comm"),
        pl.lit(0).alias("cp"), pl.lit(0).alias("tp"),
    ).with_columns(pl.when(pl.Series(join >= 0)).then(pl.lit("join")).otherwise(pl.col("kind")).alias("kind"))
    return StepGraph(steps=steps, nodes=labels.drop("start", "end"), preds=preds, join=join, start=start, end=end,
                     measured=end.max(axis=0) - start.min(axis=0))


def _rank_deps(own: pl.DataFrame, preds: list[list[int]], rank: int) -> None:
    by_type: dict[str, list[tuple[float, int]]] = {}
    for node, optype, start, end in own.select("node", "optype", "start", "end").iter_rows():
        by_type.setdefault(optype, []).append((start, int(node)))
    for v in by_type.values():
        v.sort()
    ids = {k: [n for _, n in v] for k, v in by_type.items()}
    ends = dict(zip(own["node"].to_list(), own["end"].to_list()))
    compute = [n for _, n in sorted(by_type.get(FWD, []) + by_type.get(BWD, []))]
    _chain(compute, preds)
    for kind, ctype in RECV_OF.items():
        comps, recvs = ids.get(ctype, []), ids.get(kind, [])
        shift = _shift(len(recvs), len(comps), kind, rank)
        for i, r in enumerate(recvs):
            j = i + shift
            preds[comps[j]].append(r)
            if j >= 1:
                preds[r].append(comps[j - 1])
        _chain(recvs, preds)
    for kind, ctype in SEND_OF.items():
        comps, sends = ids.get(ctype, []), ids.get(kind, [])
        _shift(len(sends), len(comps), kind, rank)
        for i, s in enumerate(sends):
            preds[s].append(comps[i])
        _chain(sends, preds)
    lane = [n for _, n in sorted(by_type.get(DP_LANE[0], []) + by_type.get(DP_LANE[1], []))]
    _chain(lane, preds)
    fwd = by_type.get(FWD, [])
    if fwd:  # the first forward (of its chunk; one chunk per stage here) waits for the last all-gather before it
        ags = [n for s, n in by_type.get("params-all-gather", []) if s <= fwd[0][0]]
        if ags:
            preds[fwd[0][1]].append(ags[-1])
    post = [n for kind in POST_CHAIN for n in ids.get(kind, [])]
    if compute and post:
        last = max(compute, key=lambda n: ends[n])
        preds[post[0]].append(last)
    _chain(post, preds)


def _shift(n_comm: int, n_comp: int, kind: str, rank: int) -> int:
    if n_comm in (0, n_comp):
        return 0
    if n_comm == n_comp - 1:  # the first stage's first receive is not recorded
        return 1
    raise WhatIfError(f"rank {rank}: {n_comm} {kind} ops for {n_comp} compute ops; cannot pair them")


def _chain(seq: list[int], preds: list[list[int]]) -> None:
    for a, b in zip(seq, seq[1:]):
        preds[b].append(a)


def _joins(nodes: pl.DataFrame) -> np.ndarray:
    join = np.full(nodes.height, -1, dtype=np.int64)
    groups: dict[tuple, list[int]] = {}
    for node, rank, dp, stage, optype, k in nodes.select("node", "rank", "dp", "pp", "optype", "ord").iter_rows():
        if optype in ("forward-send", "backward-recv"):
            key = ("p2p", "forward" if optype == "forward-send" else "backward", dp, stage, stage + 1, k)
        elif optype in ("forward-recv", "backward-send"):
            key = ("p2p", "forward" if optype == "forward-recv" else "backward", dp, stage - 1, stage, k)
        elif optype in DP_LANE:
            key = (optype, stage, k)
        elif optype == "embedding-grads-all-reduce":
            key = (optype, dp, k)
        elif optype == "optimizer-clip-main-grad":
            key = (optype, k)
        else:
            continue
        groups.setdefault(key, []).append(int(node))
    for gid, members in enumerate(groups.values()):
        join[members] = gid
    return _merge_batches(nodes, join)


def _merge_batches(nodes: pl.DataFrame, join: np.ndarray) -> np.ndarray:
    """p2p ops a rank issued together (same start and end: one batched send/recv) complete
    together: their transfers form one join."""
    p2p = nodes.filter(pl.col("optype").is_in(list(RECV_OF) + list(SEND_OF)))
    parent = {int(j): int(j) for j in set(join[p2p["node"].to_numpy()])}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for batch in p2p.group_by("rank", "start", "end").agg(pl.col("node")).filter(pl.col("node").list.len() > 1)["node"]:
        roots = [find(int(join[n])) for n in batch]
        for r in roots[1:]:
            parent[r] = roots[0]
    out = join.copy()
    for i in p2p["node"].to_list():
        out[i] = find(int(join[i]))
    return out
