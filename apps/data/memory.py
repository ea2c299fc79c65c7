"""Memory of one rank over time: allocated bytes (the library's ``timeline`` of the allocator
trace), its step boundaries, and the estimator's prediction when the run has a trainer manifest.

Snapshot times are on the clock the recorder used. A CUDA snapshot's are epoch times, the steps'
clock; a snapshot made from a profile (``_profile_to_snapshot``) keeps the profiler's own clock,
which the store does not relate to epoch time. ``rank_curve`` says which: on the steps' clock the
curve can share the timeline's time axis, otherwise only its own.

The figures are the library's ``analyse`` over the same rows `tracekit memory` reads (the trace
and the blocks live at the snapshot that the trace never saw allocated), so the page's peak is
the CLI's; the trace alone (what this view used before) misses those blocks and reads low.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from apps.data.store import DashboardData
from tracekit.analysis.memory import analyse

MEMORY_POINTS = 1500  # time buckets per rank; each keeps its lowest and highest allocated value


@dataclass(frozen=True)
class MemoryCurve:
    points: pl.DataFrame  # t_ns (aligned when on_step_clock), allocated_mib, action, size, frame, stack; time order
    steps: pl.DataFrame  # step, start_ns, end_ns of the rank (aligned)
    on_step_clock: bool  # the snapshot's times fall within the rank's steps
    peak_mib: float
    peak_t_ns: int | None
    peak_frame: str  # the allocation that reached the peak: its site ('file:line:function') ...
    peak_category: str  # ... and category, as `tracekit memory` names them
    sites: pl.DataFrame  # live at the peak by allocation site: frame, bytes, blocks, share
    peak_stack: str | None  # the whole stack of the allocation that reached the peak (memory_events.frames)
    stacks_stored: bool  # False: the store predates memory_events.frames (ingest again to fill it)


def memory_ranks(data: DashboardData, run_id: str) -> list[int]:
    return data.memo(("memory_ranks", run_id), lambda: data.sql(
        "SELECT DISTINCT rank FROM memory_events WHERE run_id = $r ORDER BY rank", {"r": run_id})["rank"].to_list())


def rank_curve(data: DashboardData, run_id: str, rank: int) -> MemoryCurve:
    return data.recent(("memory", run_id, rank), lambda: _curve(data, run_id, rank))


def _curve(data: DashboardData, run_id: str, rank: int) -> MemoryCurve:
    p = {"r": run_id, "k": rank}
    stored = data.has_column("memory_events", "frames")  # a store from before stacks were kept: NULL
    events = data.sql("SELECT run_id, rank, seq, ts_ns, action, addr, size, category, frame, "
                      + ("frames" if stored else "NULL::VARCHAR AS frames")
                      + " FROM memory_events WHERE run_id = $r AND rank = $k ORDER BY seq", p)
    blocks = data.sql("SELECT * FROM memory_blocks WHERE run_id = $r AND rank = $k", p)
    offset = data.clock_offsets(run_id).filter(pl.col("rank") == rank)["offset_ns"]
    offset = int(offset[0] or 0) if offset.len() else 0
    steps = data.sql("SELECT step, start_ns, end_ns FROM steps WHERE run_id = $r AND rank = $k ORDER BY step", p)
    result = analyse(events.drop("frames"), blocks=blocks)  # MemoryDataError (a ValueError): the page says so
    peak = result.peaks.row(0, named=True)
    tl = result.timeline.select("seq", "ts_ns", "allocated").join(
        events.select("seq", "action", "size", pl.col("frame").fill_null("<unknown>"),
                      pl.col("frames").fill_null("(no stack recorded)").alias("stack")), on="seq", how="left"
    ).drop_nulls("ts_ns").sort("seq")
    on_clock = bool(steps.height and tl.height) and (
        tl["ts_ns"].max() >= steps["start_ns"].min() and tl["ts_ns"].min() <= steps["end_ns"].max())
    shift = offset if on_clock else 0
    tl = tl.select((pl.col("ts_ns") - shift).alias("t_ns"), (pl.col("allocated") / 2**20).alias("allocated_mib"),
                   "action", "size", "frame", "stack")
    steps = steps.with_columns(pl.col("start_ns") - offset, pl.col("end_ns") - offset)
    sites = result.live_at_peak(by="frame").select("frame", "bytes", "blocks", "share")
    return MemoryCurve(points=_thin(tl), steps=steps, on_step_clock=on_clock,
                       peak_mib=peak["peak_allocated"] / 2**20,
                       peak_t_ns=None if peak["peak_ts_ns"] is None else peak["peak_ts_ns"] - shift,
                       peak_frame=peak["peak_frame"] or "<unknown>", peak_category=peak["peak_category"] or "unknown",
                       sites=sites, stacks_stored=stored,
                       peak_stack=events.filter(pl.col("seq") == peak["peak_seq"])["frames"].first()
                       if peak.get("peak_seq") is not None else None)


def _thin(tl: pl.DataFrame, buckets: int = MEMORY_POINTS) -> pl.DataFrame:
    """At most two points per time bucket, its lowest and highest, so spikes survive."""
    if tl.height <= 2 * buckets:
        return tl
    lo, hi = tl["t_ns"].min(), tl["t_ns"].max()
    width = max((hi - lo) / buckets, 1)
    b = tl.with_columns(((pl.col("t_ns") - lo) / width).floor().cast(pl.Int64).alias("_b"),
                        pl.int_range(pl.len()).alias("_i"))
    ends = b.group_by("_b").agg(pl.col("_i").get(pl.col("allocated_mib").arg_min()).alias("a"),
                                pl.col("_i").get(pl.col("allocated_mib").arg_max()).alias("z"))
    keep = pl.concat([ends["a"], ends["z"]]).implode()
    return b.filter(pl.col("_i").is_in(keep)).drop("_b", "_i")


def estimate_mib(data: DashboardData, run_id: str, rank: int) -> float | None:
    """The estimator's total for ``rank`` from the trainer manifest, when the run has one."""
    from tracekit.memory.llama_dims import EstimateError
    from tracekit.memory.trainer import trainer_estimate

    manifest = data.run_info(run_id)["manifest"]
    if "config" not in manifest:
        return None
    try:
        return trainer_estimate(manifest, rank).total / 2**20
    except (EstimateError, KeyError, TypeError, ValueError):
        return None
