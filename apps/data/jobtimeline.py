"""The whole job on one clock: every span of every rank (compute, collectives split into wait and
transfer, pipeline send/receive as p2p), as rectangles for Datashader, each rank's step windows,
and the ranks the findings mark.

One query per run (memoized, shared by sessions); the browser never receives the spans, only the
raster Datashader makes of the part in view (apps/views/jobtimeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import polars as pl

from apps.data.store import DashboardData
from apps.data.timeline import aligned_spans

JOB_KINDS = ("compute", "wait", "transfer", "p2p")
# each rank's row is split into three sub-rows, so overlapping lanes do not hide each other
SUBROW = {"compute": (-0.42, -0.14), "collective": (-0.14, 0.14), "p2p": (0.14, 0.42)}


@dataclass(frozen=True)
class JobTimeline:
    rects: pd.DataFrame  # x0, x1 (ms from origin), y0, y1 (rank +- sub-row), kind (categorical)
    steps: pl.DataFrame  # rank, step, start_ms, end_ms
    origin_ns: int  # the run's earliest step start (common clock)
    spans: int
    ranks: int


def job_timeline(data: DashboardData, run_id: str) -> JobTimeline:
    return data.memo(("job_timeline", run_id), lambda: _build(data, run_id))


def _build(data: DashboardData, run_id: str) -> JobTimeline:
    spans = aligned_spans(data, run_id, None, None)
    steps = data.on_common_clock(data.sql(
        "SELECT rank, step, start_ns AS s, end_ns AS e FROM steps WHERE run_id = $r AND step IS NOT NULL "
        "ORDER BY rank, step", {"r": run_id}), run_id, "s", "e")
    starts = [int(x) for x in (steps["s"].min() if steps.height else None, spans["s"].min() if spans.height else None)
              if x is not None]
    origin = min(starts) if starts else 0
    lo = {k: v[0] for k, v in SUBROW.items()}
    hi = {k: v[1] for k, v in SUBROW.items()}
    r = spans.select(
        ((pl.col("s") - origin) / 1e6).alias("x0"), ((pl.col("e") - origin) / 1e6).alias("x1"),
        (pl.col("rank") + pl.col("lane").replace_strict(lo, return_dtype=pl.Float64)).alias("y0"),
        (pl.col("rank") + pl.col("lane").replace_strict(hi, return_dtype=pl.Float64)).alias("y1"),
        pl.when(pl.col("lane") == "p2p").then(pl.lit("p2p")).otherwise(pl.col("kind")).alias("kind"))
    rects = r.to_pandas()
    rects["kind"] = pd.Categorical(rects["kind"], categories=list(JOB_KINDS))
    st = steps.select(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64),
                      ((pl.col("s") - origin) / 1e6).alias("start_ms"), ((pl.col("e") - origin) / 1e6).alias("end_ms"))
    return JobTimeline(rects=rects, steps=st, origin_ns=origin, spans=spans.height,
                       ranks=int(spans["rank"].n_unique()) if spans.height else 0)


def step_at(job: JobTimeline, rank: int, x_ms: float) -> int | None:
    """The step ``rank`` was in at ``x_ms`` (the nearest one when between steps)."""
    mine = job.steps.filter(pl.col("rank") == rank)
    if not mine.height:
        mine = job.steps
    if not mine.height:
        return None
    dist = pl.max_horizontal(pl.col("start_ms") - x_ms, x_ms - pl.col("end_ms"), pl.lit(0.0))
    return int(mine.with_columns(dist.alias("d")).sort("d", "step")["step"][0])


def step_window(job: JobTimeline, rank: int, step: int) -> tuple[float, float] | None:
    row = job.steps.filter((pl.col("rank") == rank) & (pl.col("step") == step))
    return (float(row["start_ms"][0]), float(row["end_ms"][0])) if row.height else None


def marked_ranks(data: DashboardData, run_id: str) -> tuple[list[int], list[int], str]:
    """(culprits, their group, what the group is): the first (costliest) finding's ranks and the
    members of the group in which the localizer's deepest chosen level compared them (a hang:
    the rank that never joined and the ranks blocked behind it). From the same Diagnosis
    `tracekit report` renders."""
    d = data.diagnosis(run_id)
    lay = data.layout(run_id)
    if d.localization.verdict == "hang":
        h = data.hangs(run_id)
        return list(h.culprits), list(h.blocked), "blocked behind them"
    if not d.findings:
        return [], [], ""
    culprits = sorted(d.findings[0].ranks)
    if not culprits:
        return [], [], ""
    levels = [lv for lv in d.localization.levels if lv.chosen is not None]
    dim = levels[-1].level if levels else "dp"
    group = sorted({m for r in culprits if r < lay.world_size for m in lay.group(r, dim)} - set(culprits))
    return culprits, group, f"its {dim.upper()} group"
