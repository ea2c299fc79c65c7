"""The dependency graph of a run whose ranks call communication in program order (trainer runs).

Each rank's step is a program: local work, a communication call, local work, another call... (the
reference trainer's collectives and receives block the rank; its sends are asynchronous: the rank
goes on once a send is posted, and only its peer waits for it). So a rank's nodes form one chain:
``work`` nodes (the time between two calls, or from the rank's step start to its first call and
from its last call to its step end) and ``join`` nodes (the calls). A collective instance joins its
group's members (same group, same sequence number); a send joins the receive with the same group,
the same (sender, receiver) pair and the same sequence number.

A work node is labelled with the compute phase it runs in (``fwd``/``bwd``/``opt`` from the
``tk.compute`` spans, else ``other``); its peers (``peer_key``) are the nodes at the same position
of the program of the ranks of the same pipeline stage, which run the same layers on the same shapes.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tracekit.analysis.tables import RunTables
from tracekit.analysis.whatif.graph import StepGraph, WhatIfError, group_steps, timing_arrays

KEY = ["rank", "pos"]
SOURCE_NAMES = {"fr": "the flight recorder", "kernel": "GPU kernels", "annotation": "tk.comm spans",
                "gloo": "gloo spans"}


def comm_calls(t: RunTables) -> pl.DataFrame:
    """One row per communication call with a step: rank, step, start, end, what (op and group), join
    key, async_send."""
    dims = dict(t.groups.select("pg_name", "dim").iter_rows())
    coll = t.collectives.filter(pl.col("step").is_not_null()).select(
        pl.col("rank").cast(pl.Int32), "step", pl.col("start_ns").alias("t0"), pl.col("end_ns").alias("t1"),
        pl.col("pg_name"), pl.col("op"),
        pl.format("c|{}|{}", pl.col("pg_name"), pl.col("seq")).alias("jkey"), pl.lit(False).alias("async_send"))
    p2p = t.p2p.filter(pl.col("step").is_not_null() & pl.col("peer").is_not_null()).select(
        pl.col("rank").cast(pl.Int32), "step", pl.col("start_ns").alias("t0"), pl.col("end_ns").alias("t1"),
        pl.col("pg_name"), pl.col("direction").alias("op"),
        pl.when(pl.col("direction") == "send").then(pl.format("p|{}|{}>{}|{}", "pg_name", "rank", "peer", "seq"))
        .otherwise(pl.format("p|{}|{}>{}|{}", "pg_name", "peer", "rank", "seq")).alias("jkey"),
        (pl.col("direction") == "send").alias("async_send"))
    calls = pl.concat([coll, p2p])
    if not calls.height:
        raise WhatIfError(_nothing_to_replay(t))
    dim = pl.col("pg_name").replace_strict(dims, default="other")
    return calls.with_columns(pl.format("{}-{}", dim, pl.col("op")).alias("label"))


def _nothing_to_replay(t: RunTables) -> str:
    """One line naming what a run without replayable communication calls lacks."""
    recorded = pl.concat([t.collectives.select("source"), t.p2p.select("source")])["source"]
    if recorded.len():
        by = ", ".join(f"{n} from {SOURCE_NAMES.get(s, s)}" for s, n in recorded.value_counts(sort=True).iter_rows())
        had = f"its {recorded.len()} communication records ({by}) have no step"
    else:
        had = "it recorded no communication"
    kernels = int((t.events["kind"] == "kernel").sum()) if t.events.height else 0
    extra = [f"{t.layout.world_size} rank" + ("s" if t.layout.world_size > 1 else "")]
    if kernels:
        extra.append(f"{kernels} GPU kernels")
    return (f"run {t.run_id!r} cannot be replayed: {had} ({', '.join(extra)}); the replay needs every rank's "
            "communication calls in program order within a step (the trainer's tk.comm spans, gloo "
            "record_param_comms) or an op table")


def build(t: RunTables) -> list[StepGraph]:
    kernel = pl.concat([t.collectives.select("source"), t.p2p.select("source")])["source"].eq("kernel").any()
    if kernel:  # a GPU runs its communication on streams of its own, overlapping compute: not one program order
        raise WhatIfError(f"run {t.run_id!r}: communication recorded as GPU kernels (several streams) is not modelled; "
                          "the replay needs the calls in program order (trainer tk.comm spans) or an op table")
    calls = comm_calls(t)
    offs = t.ranks.select(pl.col("rank").cast(pl.Int32), pl.col("clock_offset_ns").fill_null(0).alias("off"))
    steps = t.steps.select(pl.col("rank").cast(pl.Int32), "step", pl.col("start_ns").alias("s0"),
                           pl.col("end_ns").alias("s1"))
    steps = steps.join(calls.select("rank", "step").unique(), on=["rank", "step"])
    if not steps.height:
        raise WhatIfError(f"run {t.run_id!r}: no step has both a step span and communication calls")
    calls = calls.join(steps, on=["rank", "step"]).join(offs, on="rank", how="left")
    base = steps.join(offs, on="rank", how="left").group_by("step").agg((pl.col("s0") - pl.col("off")).min().alias("base"))
    calls = calls.join(base, on="step").with_columns(
        *[(pl.col(c) - pl.col("off") - pl.col("base")).cast(pl.Float64).alias(c) for c in ("t0", "t1", "s0", "s1")])
    calls = calls.sort("step", "rank", "t0").with_columns(pl.int_range(pl.len()).over("step", "rank").alias("k"))
    ops = _with_work(calls)
    ops = _label_work(ops, t, base, offs)
    coords = t.coords().select(pl.col("rank").cast(pl.Int32), "dp", "pp", "cp", "tp")
    ops = ops.join(coords, on="rank", how="left")
    return [_graph(s, grp) for s, grp in group_steps(ops, ["rank", "pos", "what"])]


def _with_work(calls: pl.DataFrame) -> pl.DataFrame:
    """Interleave work nodes: before each call, and one after the last (to the rank's step end)."""
    prev_end = pl.col("t1").shift(1).over("step", "rank")
    call_rows = calls.select("step", "rank", (2 * pl.col("k") + 1).alias("pos"), pl.col("t0").alias("start"),
                             pl.col("t1").alias("end"), pl.format("{}@{}", "label", "pg_name").alias("what"),
                             "label", "jkey", "async_send")
    work = calls.select("step", "rank", (2 * pl.col("k")).alias("pos"),
                        pl.coalesce(prev_end, pl.col("s0")).alias("start"), pl.col("t0").alias("end"))
    tail = calls.group_by("step", "rank").agg((2 * pl.col("k").max() + 2).alias("pos"), pl.col("t1").last().alias("start"),
                                              pl.col("s1").first().alias("end"))
    work = pl.concat([work, tail.select(work.columns)]).with_columns(
        pl.lit("work").alias("what"), pl.lit(None, pl.Utf8).alias("label"), pl.lit(None, pl.Utf8).alias("jkey"),
        pl.lit(False).alias("async_send"))
    return pl.concat([call_rows, work.select(call_rows.columns)]).sort("step", "rank", "pos")


def _label_work(ops: pl.DataFrame, t: RunTables, base: pl.DataFrame, offs: pl.DataFrame) -> pl.DataFrame:
    """A work node's label: the phase of the compute span holding its midpoint, else ``other``."""
    spans = t.events.filter((pl.col("kind") == "compute") & pl.col("phase").is_not_null() & pl.col("step").is_not_null())
    spans = spans.select(pl.col("rank").cast(pl.Int32), "step", "phase", "ts_ns", "dur_ns").join(base, on="step").join(
        offs, on="rank", how="left").select("rank", "step", "phase", (pl.col("ts_ns") - pl.col("off") - pl.col("base"))
                                            .cast(pl.Float64).alias("c0"), pl.col("dur_ns").cast(pl.Float64).alias("cd"))
    work = ops.filter(pl.col("what") == "work").with_columns(((pl.col("start") + pl.col("end")) / 2).alias("mid"))
    hit = work.join(spans, on=["rank", "step"], how="inner").filter(
        (pl.col("mid") >= pl.col("c0")) & (pl.col("mid") <= pl.col("c0") + pl.col("cd")))
    hit = hit.group_by("step", "rank", "pos").agg(pl.col("phase").first())
    ops = ops.join(hit, on=["step", "rank", "pos"], how="left")
    return ops.with_columns(pl.when(pl.col("what") == "work").then(pl.coalesce("phase", pl.lit("other")))
                            .otherwise(pl.col("label")).alias("label")).drop("phase")


def _graph(steps: list[int], ops: pl.DataFrame) -> StepGraph:
    first = ops.filter(pl.col("step") == steps[0]).sort("rank", "pos")
    nodes = first.select("rank", "pos", "what", "label", "jkey", "async_send", "dp", "pp", "cp", "tp").with_row_index("node")
    nodes = nodes.with_columns(pl.col("node").cast(pl.Int64))
    n = nodes.height
    preds: list[list[int]] = [[] for _ in range(n)]
    ranks = nodes["rank"].to_numpy()
    for i in range(1, n):
        if ranks[i] == ranks[i - 1]:
            preds[i].append(i - 1)
    join = np.full(n, -1, dtype=np.int64)
    arrive: list[list[int]] = [[] for _ in range(n)]
    sends = {k: i for i, (k, a) in enumerate(nodes.select("jkey", "async_send").iter_rows()) if a and k is not None}
    ids: dict[str, int] = {}
    for i, (k, a) in enumerate(nodes.select("jkey", "async_send").iter_rows()):
        if k is None or a:
            continue
        if k.startswith("p|"):  # a receive: its transfer starts once the send is posted
            if k in sends:
                arrive[i].append(sends[k])
        else:
            join[i] = ids.setdefault(k, len(ids))
    start, end = timing_arrays(ops, nodes, KEY, steps)
    is_work = nodes["what"] == "work"
    nodes = nodes.with_columns(
        pl.when(is_work).then(pl.lit("work")).otherwise(pl.lit("join")).alias("kind"),
        pl.col("what").alias("optype"),
        pl.format("{}|{}", pl.col("pp"), pl.col("pos")).alias("peer_key"),
        (~is_work).alias("is_comm"),
    )
    first_start = np.nanmin(start, axis=0)
    return StepGraph(steps=steps, nodes=nodes, preds=preds, join=join, start=start, end=end,
                     measured=end.max(axis=0) - first_start, arrive=arrive)

