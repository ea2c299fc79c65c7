"""Ranks that get more attention work than their stage peers: data imbalance, told apart from speed.

A slow device slows every kernel alike; more tokens of long documents (document-mask imbalance,
Llama 3 sec. 7.3.2) lengthen only the attention kernels, whose cost follows the data. So per
(step, rank) the attention kernels' log ratio to the same spans on the stage's other ranks is set
against the other kernels' ratio: the difference is the rank's extra attention work, whatever its
device's speed. A rank is data-heavy when, over the steps, its attention kernels take at least
``attention_imbalance_ratio`` of its peers' with its other kernels within a quarter of that excess
(``more_attention_work``), and the excess clears the largest of its stage's noisy excesses
(Bonferroni over the ranks, the noise pooled over every cell). With CP = 2 half of a stage is heavy: the ranks'
whole-compute speeds then split in two, no slow device stands out against that spread, and the
diagnosis measures device speed on the other kernels alone (``compute_speed(device_only=True)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import polars as pl

from tracekit.analysis.compute_speed import classed_spans, middle_mean
from tracekit.analysis.culprits import margin_confidence, persistent_effect
from tracekit.analysis.findings import NEXT_STEP, Finding, where
from tracekit.analysis.standout import spread
from tracekit.analysis.tables import RunTables, per_tables
from tracekit.analysis.tunables import Tunables
from tracekit.analysis.whatif import WhatIfError, saving

ALPHA = 0.01  # the chance that a run without imbalance names a rank, over all its ranks


@dataclass(frozen=True)
class DataHeavy:
    rank: int
    excess: float  # its attention kernels' ratio over its other kernels' (their peers' = 1)
    steps: tuple[int, ...]  # the steps it was heavy in
    extra_ns: float  # its attention compute beyond what its other kernels' speed gives, per step (median)
    margin: float  # log excess over its noise unit
    bar: float  # the margin it had to clear
    steps_total: int  # the steps it was compared over


@per_tables
def data_heavy(tables: RunTables, tun: Tunables = Tunables(), compared: int | None = None) -> tuple[DataHeavy, ...]:
    """Every rank whose attention kernels take persistently more than its other kernels say they
    should, against its stage peers; () where the spans carry no kernel names of both classes.
    ``compared``: how many ranks the tables' were picked from (a scoped diagnosis of a large job),
    so that the bar for the largest of many noisy excesses counts all of them."""
    per = classed_spans(tables).group_by("step", "rank", "attn").agg(
        middle_mean(pl.col("lr")).alias("lr"), pl.col("own_ns").sum().alias("own"), pl.col("ref").sum().alias("ref"))
    a = per.filter(pl.col("attn")).select("step", "rank", pl.col("lr").alias("la"), "own", "ref")
    o = per.filter(~pl.col("attn")).select("step", "rank", pl.col("lr").alias("lo"))
    cells = a.join(o, on=["step", "rank"]).drop_nulls(["la", "lo"]).sort("rank", "step")
    if cells.height < 2 or cells["rank"].n_unique() < 2:
        return ()
    cells = cells.with_columns((pl.col("la") - pl.col("lo")).alias("x"))
    # the attention time its other kernels' speed would give, against what it took
    cells = cells.with_columns((pl.col("own") - pl.col("ref") * pl.col("lo").exp()).alias("extra"))
    by_rank = {r: g for (r,), g in cells.group_by("rank")}
    means = {r: persistent_effect(g["x"].to_numpy()) for r, g in by_rank.items()}
    resid = np.concatenate([g["x"].to_numpy() - means[r] for r, g in by_rank.items()])
    sigma = max(spread(resid), tun.compute_noise_floor)
    z = NormalDist().inv_cdf(1 - ALPHA / max(len(by_rank), compared or 0))
    out = []
    for r, g in sorted(by_rank.items()):
        x = g["x"].to_numpy()
        kept = x.size - 2 if x.size >= 6 else x.size
        if kept < tun.compute_min_steps:
            continue
        effect, unit = means[r], sigma / math.sqrt(kept)
        steps = tuple(int(t) for t, v in zip(g["step"], x) if v > effect / 2)
        attention, other = math.exp(persistent_effect(g["la"].to_numpy())), math.exp(persistent_effect(g["lo"].to_numpy()))
        if more_attention_work(attention, other, tun) and effect / unit >= z and len(steps) >= tun.persist_min * x.size:
            extra = float(np.median(g.filter(pl.col("step").is_in(list(steps)))["extra"].to_numpy()))
            out.append(DataHeavy(int(r), math.exp(effect), steps, max(extra, 0.0), effect / unit, z, int(x.size)))
    return tuple(out)


def more_attention_work(attention_ratio: float, other_ratio: float, tun: Tunables) -> bool:
    """Extra compute in the attention kernels alone (the other kernels' excess within a quarter of
    it): more data, not a slower device. A slow device slows every kernel, if not alike: a 1.5x
    CPU rank of a torch-native job on a shared host ran its attention 1.38x, its other ops 1.22x."""
    return (attention_ratio >= tun.attention_imbalance_ratio
            and other_ratio - 1 <= 0.5 * tun.work_explains_share * (attention_ratio - 1))


def heavy_findings(tables: RunTables, heavy: tuple[DataHeavy, ...], step_ns: float) -> list[Finding]:
    """The data-heavy ranks as one data-imbalance finding, its cost what balancing them would save
    (the what-if replay), else their largest extra attention compute."""
    if not heavy:
        return []
    ranks = tuple(h.rank for h in heavy)
    steps = tuple(sorted({s for h in heavy for s in h.steps}))
    cost = max(h.extra_ns for h in heavy)
    try:
        saved, _ = saving(tables, list(ranks))
        cost = max(saved, 0.0) or cost
    except WhatIfError:
        pass
    conf = max(margin_confidence(h.margin, h.bar, len(h.steps) / h.steps_total) for h in heavy)
    return [data_finding(tables, ranks, steps, cost, cost / step_ns, conf,
                         {"attention_excess": max(h.excess for h in heavy), "ranks_heavy": len(ranks)})]


def merge_data_imbalance(findings: list[Finding], tables: RunTables) -> list[Finding]:
    """Rank findings whose cause is data imbalance are one finding: the data, not the ranks."""
    moving = [f for f in findings if f.cause == "data_imbalance" and f.ranks
              and f.kind in ("straggler", "transient", "moving", "data_imbalance")]
    if len(moving) < 2:
        return findings
    rest = [f for f in findings if f not in moving]
    ranks = tuple(sorted({r for f in moving for r in f.ranks}))
    steps = tuple(sorted({s for f in moving for s in f.steps}))
    return [data_finding(tables, ranks, steps, max(f.cost_ns for f in moving), max(f.cost_share for f in moving),
                         max(f.confidence for f in moving), {"ranks_merged": len(moving)})] + rest


def data_finding(tables: RunTables, ranks: tuple[int, ...], steps: tuple[int, ...], cost: float, share: float,
                 confidence: float, evidence: dict) -> Finding:
    """One data-imbalance finding over ``ranks``: what every such finding says."""
    return Finding("data_imbalance", ranks, where(tables, ranks), steps, cost, share, confidence, "data_imbalance",
                   f"{where(tables, ranks)} compute more because they get more attention work (up to "
                   f"{cost / 1e6:.1f} ms per step): data imbalance, not slower devices",
                   NEXT_STEP["data_imbalance"], evidence)
