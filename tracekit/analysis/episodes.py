"""Stragglers that do not persist, checked against compute speed (``compute_speed.py``).

Waits carry every kind of timing noise. A transient straggler (one rank, an episode of a few steps)
and a moving one (the slowness lands on a different rank from step to step) are findings only where
the ranks they name also computed slower than their peers in those steps; and a rank that computes
persistently slower than its peers names the culprit when the waits alone stayed open, or narrows a
late group to its slow member (``with_compute``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from tracekit.analysis.compute_speed import ComputeFinding, compute_excess
from tracekit.analysis.standout import spread, standout
from tracekit.analysis.tunables import Tunables
from tracekit.topology import OUTER_TO_INNER

if TYPE_CHECKING:  # localize imports this module
    from tracekit.analysis.localize import Localization


def transient(per_step: pl.DataFrame, speed: pl.DataFrame, step_ns: float,
               tun: Tunables) -> tuple[int, tuple[int, ...], float] | None:
    """A transient straggler: nothing persists, but one rank holds ``transient_share_min`` of the
    lateness of the steps that stand out (effect at least ``episode_effect_min_frac`` of a step) in
    two or more of them, and, where compute was recorded, computed slower than its stage peers in
    the steps that carry ``moving_compute_agree_min`` of its lateness. Weighing steps by their
    effect keeps a two-step episode of a 2x slowdown from being outvoted by per-step jitter, which
    names some rank in every step. Returns (rank, its episode's steps, share of the lateness)."""
    hits = per_step.filter(pl.col("culprit_rank").is_not_null()
                           & (pl.col("effect_ns") >= tun.episode_effect_min_frac * step_ns))
    if hits.height < 2:
        return None
    by_rank = hits.group_by("culprit_rank").agg(pl.col("effect_ns").sum(), pl.len()).sort("effect_ns", descending=True)
    rank, effect, n = by_rank.row(0)
    share = effect / float(hits["effect_ns"].sum())
    if n < 2 or share < tun.transient_share_min:
        return None
    own = hits.filter(pl.col("culprit_rank") == rank).select("step", "effect_ns")
    if not speed.height:
        return int(rank), tuple(sorted(own["step"].to_list())), float(share)
    excess, bar = compute_excess(speed, tun)
    slow = excess.filter((pl.col("rank") == rank) & (pl.col("excess") >= bar))["step"].to_list()
    episode = own.filter(pl.col("step").is_in(slow))
    if episode.height < 2 or float(episode["effect_ns"].sum()) < tun.moving_compute_agree_min * effect:
        return None
    return int(rank), tuple(sorted(episode["step"].to_list())), float(share)


def moving_ranks(loc: Localization, speed: pl.DataFrame, lay, tun: Tunables) -> str | None:
    """A moving straggler seen rank by rank, for when no level's members alternate cleanly (a slow
    device moving over three ranks of two replicas leaves one replica late in two steps of three,
    which reads as a dominant member at the DP level). The steps whose standout rank costs at least
    ``episode_effect_min_frac`` of a step and computed slower than its stage peers that step (the
    transient bar) cover ``moving_min_share`` of the steps; two or more ranks hold them and none
    holds ``persist_min`` of them. Returns the outermost level whose member changes among those
    steps (the level the slowness moves across), or None."""
    if not speed.height or not loc.per_step.height:
        return None
    hits = loc.per_step.filter(pl.col("culprit_rank").is_not_null()
                               & (pl.col("effect_ns") >= tun.episode_effect_min_frac * loc.step_time_ns))
    excess, bar = compute_excess(speed, tun)
    slow = excess.filter(pl.col("excess") >= bar).select("step", pl.col("rank").alias("culprit_rank"))
    hits = hits.join(slow, on=["step", "culprit_rank"], how="semi")
    T = loc.per_step.height
    if hits.height < max(2, math.ceil(tun.moving_min_share * T)):
        return None
    counts = hits["culprit_rank"].value_counts()["count"]
    if counts.len() < 2 or int(counts.max()) / hits.height >= tun.persist_min:
        return None
    return next((d for d in OUTER_TO_INNER if getattr(lay, d) > 1 and hits[d].n_unique() >= 2), None)


def with_compute(loc: Localization, cf: ComputeFinding, lay, speed: pl.DataFrame, tun: Tunables) -> Localization:
    """Combine the wait-based verdict with the compute-speed check (see the module docstring)."""
    loc = replace(loc, compute=cf)
    if loc.verdict == "no_straggler" and (episode := transient(loc.per_step, speed, loc.step_time_ns, tun)):
        rank, steps, share = episode
        loc = replace(loc, verdict="transient", culprit_rank=rank, culprit_ranks=(rank,),
                      coords=lay.coords(rank).as_dict(), confidence=share, episode_steps=steps)
    elif loc.verdict == "no_straggler" and cf.verdict != "culprit" and (level := moving_ranks(loc, speed, lay, tun)):
        levels = [replace(lv, verdict="moving") if lv.level == level else lv for lv in loc.levels]
        share = loc.per_step["culprit_rank"].is_not_null().mean()
        loc = replace(loc, verdict="moving", levels=levels, confidence=float(share or 0.0))
    if cf.verdict != "culprit":
        return loc
    r = cf.rank
    if loc.verdict == "straggler":
        return replace(loc, basis="both") if loc.culprit_rank == r else loc
    # a stage blamed in every replica while one rank of a stage computes slower than its peers: the
    # pipeline waits came from that rank (a heavier stage would slow all its ranks alike)
    if loc.verdict in ("group", "no_straggler", "moving", "transient", "stage") and (loc.verdict != "group"
                                                                                    or r in loc.culprit_ranks):
        conf = (cf.steps_slower / max(cf.steps_total, 1)) * (1 - math.exp(-cf.margin / cf.bar))
        return replace(loc, verdict="straggler", culprit_rank=r, culprit_ranks=(r,), coords=lay.coords(r).as_dict(),
                       confidence=float(conf), basis="both" if loc.verdict == "group" else "compute")
    return loc


def moving_supported(level: str, steps: list, mat: np.ndarray, speed: pl.DataFrame, coords: pl.DataFrame,
                      rng: dict[str, int], step_ns: float, tun: Tunables) -> bool:
    """A moving straggler (more work landing on a different member each step) shows in compute as
    well as in waits: in most steps where a member stood out, its extra compute over the other
    members (its ranks' mean, ns) explains at least ``moving_explained_min`` of the wait it caused.
    Waits that move while compute does not are timing noise. Only DP replicas and CP ranks see
    different data; at the TP and PP levels a moving straggler is a moving slow device, whose
    compute speed must also stand out each time (beyond ``compute_margin_min`` spreads of the
    step-to-step scatter of every rank's speed). Without compute records there is nothing to check
    against, and the waits stand."""
    if not speed.height:
        return True
    sel = coords
    for d, v in rng.items():
        sel = sel.filter(pl.col(d) == v)
    per = speed.join(sel.select("rank", level), on="rank").group_by("step", level).agg(
        pl.col("excess_ns").mean(), pl.col("log_ratio").mean())
    extra = {(int(t), int(m)): float(v) for t, m, v in per.select("step", level, "excess_ns").iter_rows()}
    speed_of = {(int(t), int(m)): float(v) for t, m, v in per.select("step", level, "log_ratio").iter_rows()}
    need_speed = level not in ("dp", "cp")
    if need_speed:
        resid = per.with_columns((pl.col("log_ratio") - pl.col("log_ratio").median().over("step")).alias("r"))
        resid = resid.filter(pl.col("log_ratio") < pl.col("log_ratio").max().over("step"))["r"].to_numpy()
        speed_bar = max(tun.compute_margin_min * max(spread(resid), tun.compute_noise_floor),
                        math.log(tun.compute_effect_min_ratio))
    n_standout = explained = 0
    for t, row in zip(steps, mat):
        top, effect, ok = standout(row, step_ns, tun, tun.effect_min_frac)
        if not ok:
            continue
        n_standout += 1
        vals = [extra.get((int(t), m)) for m in range(row.size)]
        if vals[top] is None or effect <= 0:
            continue
        others = [v for m, v in enumerate(vals) if m != top and v is not None]
        if not others or vals[top] - float(np.median(others)) < tun.moving_explained_min * effect:
            continue
        if need_speed:
            sp = [speed_of.get((int(t), m)) for m in range(row.size)]
            rest = [v for m, v in enumerate(sp) if m != top and v is not None]
            if sp[top] is None or not rest or sp[top] - float(np.median(rest)) < speed_bar:
                continue
        explained += 1
    return n_standout > 0 and explained / n_standout >= tun.moving_compute_agree_min
