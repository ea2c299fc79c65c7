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

from tracekit.analysis.compute_speed import _attention, _middle_mean, own_compute_spans
from tracekit.analysis.standout import spread
from tracekit.analysis.tables import RunTables, per_tables
from tracekit.analysis.tunables import Tunables

ALPHA = 0.01  # the chance that a run without imbalance names a rank, over all its ranks


@dataclass(frozen=True)
class DataHeavy:
    rank: int
    excess: float  # its attention kernels' ratio over its other kernels' (their peers' = 1)
    steps: tuple[int, ...]  # the steps it was heavy in
    extra_ns: float  # its attention compute beyond what its other kernels' speed gives, per step (median)
    margin: float  # log excess over its noise unit
    bar: float  # the margin it had to clear


@per_tables
def data_heavy(tables: RunTables, tun: Tunables = Tunables(), compared: int | None = None) -> tuple[DataHeavy, ...]:
    """Every rank whose attention kernels take persistently more than its other kernels say they
    should, against its stage peers; () where the spans carry no kernel names of both classes.
    ``compared``: how many ranks the tables' were picked from (a scoped diagnosis of a large job),
    so that the bar for the largest of many noisy excesses counts all of them."""
    spans = own_compute_spans(tables)
    if not spans.height:
        return ()
    spans = spans.join(tables.coords().select("rank", "pp"), on="rank")
    peers = ["pp", "step", "key"]
    n = pl.len().over(peers)
    spans = spans.with_columns(((pl.col("own_ns").sum().over(peers) - pl.col("own_ns")) / (n - 1)).alias("ref"),
                               _attention(pl.col("key")).alias("attn"))
    spans = spans.filter((n > 1) & (pl.col("own_ns") > 0) & (pl.col("ref") > 0))
    lr = (pl.col("own_ns") / pl.col("ref")).log()
    per = spans.group_by("step", "rank", "attn").agg(_middle_mean(lr).alias("lr"), pl.col("own_ns").sum().alias("own"),
                                                      pl.col("ref").sum().alias("ref"))
    a = per.filter(pl.col("attn")).select("step", "rank", pl.col("lr").alias("la"), "own", "ref")
    o = per.filter(~pl.col("attn")).select("step", "rank", pl.col("lr").alias("lo"))
    cells = a.join(o, on=["step", "rank"]).drop_nulls(["la", "lo"]).sort("rank", "step")
    if cells.height < 2 or cells["rank"].n_unique() < 2:
        return ()
    cells = cells.with_columns((pl.col("la") - pl.col("lo")).alias("x"))
    # the attention time its other kernels' speed would give, against what it took
    cells = cells.with_columns((pl.col("own") - pl.col("ref") * pl.col("lo").exp()).alias("extra"))
    by_rank = {r: g for (r,), g in cells.group_by("rank")}
    means = {r: _trimmed(g["x"].to_numpy()) for r, g in by_rank.items()}
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
        attention, other = math.exp(_trimmed(g["la"].to_numpy())), math.exp(_trimmed(g["lo"].to_numpy()))
        if more_attention_work(attention, other, tun) and effect / unit >= z and len(steps) >= tun.persist_min * x.size:
            extra = float(np.median(g.filter(pl.col("step").is_in(list(steps)))["extra"].to_numpy()))
            out.append(DataHeavy(int(r), math.exp(effect), steps, max(extra, 0.0), effect / unit, z))
    return tuple(out)


def more_attention_work(attention_ratio: float, other_ratio: float, tun: Tunables) -> bool:
    """Extra compute in the attention kernels alone (the other kernels' excess within a quarter of
    it): more data, not a slower device. A slow device slows every kernel, if not alike: a 1.5x
    CPU rank of a torch-native job on a shared host ran its attention 1.38x, its other ops 1.22x."""
    return (attention_ratio >= tun.attention_imbalance_ratio
            and other_ratio - 1 <= 0.5 * tun.work_explains_share * (attention_ratio - 1))


def _trimmed(x: np.ndarray) -> float:
    """The mean without the two extreme steps (culprits.py's persistent effect)."""
    return float(np.mean(np.sort(x)[1:-1])) if x.size >= 6 else float(np.median(x))
