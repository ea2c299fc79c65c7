"""What a slow rank costs the step (``rank_cost``): the what-if replay's saving where the run replays,
else, where it cannot run (GPU kernel traces), how long its peers waited on it.

A rank's extra compute is what it adds to its own timeline; the step grows by less where its
pipeline stage had slack. On the simulator (tp 2 x pp 4 x dp 2), a 1.3x rank of stage 1 adds
29.8 ms of compute a step while the step grows by 3.5 ms: the last stage, heavier, sets the pace.
Its peers show what the job waited. Per collective, the rank's lateness is its peers' median
duration less its own (each on its own clock, so no skew enters; the median, so that a second
late member does not hide the first); summed over a step's collectives of one group dimension,
it is how much later that group moved on. The least such sum over the rank's dimensions is what
it held back: a DP group gates whole replicas, so with DP > 1 it is the step's growth (within
0.4-2 ms on ten simulated layouts at 1.1-1.5x, where the extra compute was up to 8.6x too high).
With DP = 1 and PP > 1 only the pipeline's p2p gates the stages, and their slack does not show in
any group's waits: the number is then an upper bound, and said to be one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import polars as pl

from tracekit.analysis.collectives import match_collectives
from tracekit.analysis.tables import RunTables
from tracekit.analysis.whatif import WhatIfError, saving
from tracekit.topology import OUTER_TO_INNER, Layout


@dataclass(frozen=True)
class WaitCost:
    cost_ns: float  # per step (the median step), the least over its dimensions of its summed lateness (>= 0)
    dim: str  # the dimension it was measured in
    upper_bound: bool  # the pipeline's slack is not in it (DP = 1, PP > 1)
    by_dim_ns: dict[str, float]  # the summed lateness per step in each of its dimensions


def wait_cost(tables: RunTables, rank: int, steps: list[int] | None = None,
              others: Iterable[tuple[int, tuple[int, ...] | None]] = ()) -> WaitCost | None:
    """How long the job waited on ``rank`` per step (over ``steps``, default every step), from its
    peers' collective durations; None where it has no collective with a step beside its peers.
    ``others``: the other culprits, each with its steps (None: every step). A peer that stands for
    one of them in a step (its replica in a DP group, its TP group in a CP group, itself in a TP
    group) is late itself, and is left out of that step's median: two 1.3x ranks in the two
    replicas of a dp 2 job each read 0 ms in their DP groups."""
    m = match_collectives(tables)
    m = m.filter(pl.col("step").is_not_null() & (pl.col("dim") != "other"))
    if steps is not None:
        m = m.filter(pl.col("step").is_in(list(steps)))
    key = ["pg_name", "seq"]
    mine = m.filter(pl.col("rank") == rank).select(*key, "dim", "step", pl.col("duration_ns").alias("own"))
    if not mine.height:
        return None
    peers = m.join(mine.select(key), on=key).filter(pl.col("rank") != rank)
    peers = _untainted(peers, tables, [(int(r), s) for r, s in others if int(r) != rank])
    peers = peers.group_by(key).agg(pl.col("duration_ns").median().alias("peers"))
    late = mine.join(peers, on=key).with_columns((pl.col("peers") - pl.col("own")).alias("late"))
    if not late.height:
        return None
    # the median step: a replica's lateness carries every one of its ranks' noise and descheduled
    # spans (15% kernel noise: -37 to +143 ms a step around a 1.3 ms cost; the mean read 32 ms)
    per_dim = late.group_by("dim", "step").agg(pl.col("late").sum()).group_by("dim").agg(pl.col("late").median())
    by_dim = {str(d): float(v) for d, v in per_dim.iter_rows()}
    dim = min(by_dim, key=by_dim.get)
    return WaitCost(max(by_dim[dim], 0.0), dim, slack_unseen(tables.layout, by_dim), by_dim)


# what a member of a group of the dimension stands for: the ranks that wait with it
UNIT = {"dp": ("dp",), "pp": ("dp", "pp"), "cp": ("dp", "pp", "cp"), "tp": ("dp", "pp", "cp", "tp")}


def _untainted(peers: pl.DataFrame, tables: RunTables, others: list[tuple[int, tuple[int, ...] | None]]
               ) -> pl.DataFrame:
    """``peers`` rows without those whose unit holds another culprit in that step."""
    if not others or not peers.height:
        return peers
    coords = tables.coords().select("rank", "dp", "pp", "cp", "tp")
    all_steps = peers["step"].unique().to_list()
    culprits = pl.DataFrame([(r, s) for r, st in others for s in (all_steps if st is None else st)],
                            schema={"rank": pl.Int32, "step": peers["step"].dtype}, orient="row").join(coords, on="rank")
    peers = peers.join(coords, on="rank", how="left")
    kept = []
    for (dim,), rows in peers.group_by("dim"):
        unit = UNIT[next((d for d in OUTER_TO_INNER if d in str(dim).split("_")), "tp")]
        kept.append(rows.join(culprits.select("step", *unit).unique(), on=["step", *unit], how="anti"))
    return pl.concat(kept).drop("dp", "pp", "cp", "tp")


def slack_unseen(layout: Layout, dims) -> bool:
    """Whether waits measured in groups of ``dims`` can exceed what a rank costs the step: the
    pipeline's slack shows in no group's waits, unless a DP group (whole replicas waiting) is among
    them."""
    return layout.pp > 1 and not any("dp" in d.split("_") for d in dims)


def rank_cost(tables: RunTables, rank: int, steps: list[int] | None, extra_ns: float,
              others: Iterable[tuple[int, tuple[int, ...] | None]] = ()) -> tuple[float, str, bool]:
    """(ns per step, how it was measured, whether it is an upper bound only) of ``rank`` over
    ``steps`` (None: every step): what the what-if replay saves with it at its peers' speed, where
    the run replays (the trainer's program-order calls); else ``wait_cost`` (``others``: the other
    culprits), never above ``extra_ns``, its extra compute; else that extra compute, which the
    step's slack and overlap may absorb (an upper bound)."""
    extra = max(extra_ns, 0.0)
    try:
        saved, _ = saving(tables, [rank], steps)
        return max(saved, 0.0), "what-if replay", False
    except WhatIfError:
        pass
    waited = wait_cost(tables, rank, steps, others)
    if waited is None:
        return extra, "extra compute", True
    if waited.cost_ns >= extra:
        return extra, "extra compute", waited.upper_bound
    return waited.cost_ns, f"waits in its {waited.dim.upper()} groups", waited.upper_bound
