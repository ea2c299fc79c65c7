"""CP-wait breakdown: time in context-parallel collectives split into waiting for the last arrival
and transfer, and who the others waited on. The run's attribution is the library's ``cp_wait``;
the per-member and per-position sums are over the library's matched instances (one source per
rank: profiler rows where a rank has them, flight-recorder rows otherwise)."""

from __future__ import annotations

import polars as pl

from apps.data.store import DashboardData

COLUMNS = {"rank": pl.Int32, "cp": pl.Int32, "wait_ms": pl.Float64, "transfer_ms": pl.Float64,
           "others_waited_ms": pl.Float64, "last": pl.Int64, "instances": pl.Int64}


def cp_instances(data: DashboardData, run_id: str) -> pl.DataFrame:
    """The matched members of every CP-collective instance, with the instance's total wait."""
    def build() -> pl.DataFrame:
        m = data.matched(run_id).filter(pl.col("dim") == "cp")
        lay = data.layout(run_id)
        return m.with_columns(
            pl.col("wait_ns").sum().over("pg_name", "seq").alias("instance_wait_ns"),
            pl.col("rank").map_elements(lambda r: lay.coords(r).cp, return_dtype=pl.Int32).alias("cp"))
    return data.memo(("cp_instances", run_id), build)


def _per(m: pl.DataFrame, by: str) -> pl.DataFrame:
    """wait / transfer / others-waited sums per ``by`` (rank or cp position)."""
    if not m.height:
        return pl.DataFrame(schema={k: v for k, v in COLUMNS.items() if k in (by, *list(COLUMNS)[2:])})
    return m.group_by(by).agg(
        (pl.col("wait_ns").sum() / 1e6).alias("wait_ms"),
        (pl.col("transfer_ns").sum() / 1e6).alias("transfer_ms"),
        # when a member arrived last, everyone else's wait in that instance was on it
        (pl.when(pl.col("is_last")).then(pl.col("instance_wait_ns")).otherwise(0).sum() / 1e6)
        .alias("others_waited_ms"),
        pl.col("is_last").sum().cast(pl.Int64).alias("last"),
        pl.len().cast(pl.Int64).alias("instances"),
    ).sort(by)


def by_position(data: DashboardData, run_id: str) -> pl.DataFrame:
    """Per CP position (0 .. cp-1), over every CP group and step: cp, wait_ms, transfer_ms,
    others_waited_ms (how long the others waited on that position), last (instances it arrived
    last in), instances."""
    return data.memo(("cp_by_position", run_id), lambda: _per(cp_instances(data, run_id), "cp"))


def group_members(data: DashboardData, run_id: str, rank: int, step: int | None = None) -> pl.DataFrame:
    """The same sums for each member of ``rank``'s CP group (all steps, or one): rank, cp, ..."""
    group = list(data.layout(run_id).group(rank, "cp"))
    m = cp_instances(data, run_id).filter(pl.col("rank").is_in(group))
    if step is not None:
        m = m.filter(pl.col("step") == step)
    per = _per(m, "rank")
    members = pl.DataFrame({"rank": group, "cp": [data.coords(run_id, r).cp for r in group]},
                           schema={"rank": pl.Int32, "cp": pl.Int32})
    out = members.join(per.with_columns(pl.col("rank").cast(pl.Int32)), on="rank", how="left")
    return out.with_columns(pl.col("wait_ms", "transfer_ms", "others_waited_ms").fill_null(0.0),
                            pl.col("last", "instances").fill_null(0)).select(list(COLUMNS)).sort("rank")
