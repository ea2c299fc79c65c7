"""Rank x step heatmap: step time, lateness (how long peers waited on the rank) and wait share,
per (rank, step), with each rank's 4D coordinates. Built once per run from the library's tables."""

from __future__ import annotations

import polars as pl

from apps.data.store import DashboardData
from tracekit.analysis.rootcause import rank_step_metrics
from tracekit.analysis.scores import collective_scores, pipeline_scores

METRICS = ("step_ms", "lateness_ms", "wait_share")
KEY = ["rank", "step"]


def _keyed(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64))


def blame(data: DashboardData, run_id: str) -> pl.DataFrame:
    """(rank, step, lateness_ms): how long peers waited on the rank, as the localizer scores it
    (collective levels plus pipeline receives blamed on their producer), summed over levels."""
    tables = data.tables(run_id)
    matched = data.matched(run_id)
    parts = [collective_scores(tables, lv, matched) for lv in ("dp", "cp", "tp")]
    if tables.p2p.height:
        parts.append(pipeline_scores(tables))
    parts = [_keyed(p).select(*KEY, "score") for p in parts if p.height]
    if not parts:
        return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "lateness_ms": pl.Float64})
    return pl.concat(parts).group_by(KEY).agg((pl.col("score").sum() / 1e6).alias("lateness_ms"))


def own_wait(data: DashboardData, run_id: str) -> pl.DataFrame:
    """(rank, step, wait_ms): the rank's own waiting. In a collective, its time beyond the
    instance's shortest member (durations on the rank's own clock need no alignment); in the
    pipeline, its receives."""
    m = data.matched(run_id)
    coll = m.with_columns((pl.col("duration_ns") - pl.col("duration_ns").min().over("pg_name", "seq")).alias("w"))
    p2p = data.tables(run_id).p2p.filter(pl.col("direction") == "recv").with_columns(
        (pl.col("end_ns") - pl.col("start_ns")).alias("w"))
    parts = [_keyed(f.select("rank", "step", "w")) for f in (coll, p2p) if f.height]
    if not parts:
        return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "wait_ms": pl.Float64})
    return pl.concat(parts).drop_nulls("step").group_by(KEY).agg((pl.col("w").sum() / 1e6).alias("wait_ms"))


def rank_step(data: DashboardData, run_id: str) -> pl.DataFrame:
    """rank, step, step_ms, lateness_ms, wait_ms, wait_share (of the step, 0..1), dp, pp, cp, tp;
    sorted by rank and step. Step times as the library measures them (step spans, else activity)."""
    def build() -> pl.DataFrame:
        steps = _keyed(rank_step_metrics(data.tables(run_id)).select(
            "rank", "step", (pl.col("step_ns") / 1e6).alias("step_ms"))).drop_nulls("step")
        df = (steps.join(blame(data, run_id), on=KEY, how="left")
              .join(own_wait(data, run_id), on=KEY, how="left")
              .with_columns(pl.col("lateness_ms").fill_null(0.0), pl.col("wait_ms").fill_null(0.0)))
        lay = data.layout(run_id)
        ranks = list(range(lay.world_size))
        coords = pl.DataFrame({"rank": ranks, **{d: [getattr(lay.coords(r), d) for r in ranks]
                                                 for d in ("dp", "pp", "cp", "tp")}},
                              schema={"rank": pl.Int32, **{d: pl.Int32 for d in ("dp", "pp", "cp", "tp")}})
        return df.join(coords, on="rank", how="left").sort(KEY).with_columns(
            (pl.col("wait_ms") / pl.col("step_ms")).clip(0, 1).fill_nan(0.0).alias("wait_share"))
    return data.memo(("rank_step", run_id), build)
