"""Run overview: step times over ranks, and where a run opens (its culprit in its slowest step)."""

from __future__ import annotations

import polars as pl

from apps.data.store import DashboardData


def step_times(data: DashboardData, run_id: str) -> pl.DataFrame:
    """Per step: median and max step time over ranks (ms), the slowest rank, how many ranks."""
    return data.memo(("step_times", run_id), lambda: data.sql("""
        SELECT step, median(end_ns - start_ns) / 1e6 AS median_ms, max(end_ns - start_ns) / 1e6 AS max_ms,
               arg_max(rank, end_ns - start_ns) AS slowest_rank, count(*) AS ranks
        FROM steps WHERE run_id = $r GROUP BY step ORDER BY step""", {"r": run_id}))


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
