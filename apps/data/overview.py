"""Run overview: step times over ranks, and where a run opens (its culprit in its slowest step)."""

from __future__ import annotations

import polars as pl

from apps.data.heatmap import rank_step
from apps.data.store import DashboardData


def step_times(data: DashboardData, run_id: str) -> pl.DataFrame:
    """Per step: median and max step time over ranks (ms), the slowest rank, how many ranks; from
    the heatmap's per-(rank, step) times (the library's: step spans, else the ranks' activity)."""
    return data.memo(("step_times", run_id), lambda: rank_step(data, run_id).group_by("step").agg(
        pl.col("step_ms").median().alias("median_ms"), pl.col("step_ms").max().alias("max_ms"),
        pl.col("rank").sort_by("step_ms").last().alias("slowest_rank"), pl.len().alias("ranks")).sort("step"))


def initial_focus(data: DashboardData, run_id: str) -> tuple[int, int]:
    """Where a run opens: the culprit (else the first of a culprit group, else rank 0) in the
    step whose slowest rank took longest."""
    def pick() -> tuple[int, int]:
        loc = data.diagnosis(run_id).localization
        rank = loc.culprit_rank if loc.culprit_rank is not None else (loc.culprit_ranks or (0,))[0]
        st = step_times(data, run_id)
        step = int(st.sort("max_ms")["step"][-1]) if st.height else 0
        return int(rank), step
    return data.memo(("focus", run_id), pick)
