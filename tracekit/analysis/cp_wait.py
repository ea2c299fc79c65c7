"""CP-wait attribution (Llama 3 training paper, sec. 7.3.2; ALGORITHMS.md).

All-gather CP communication is exposed: a rank sits in each CP collective from its arrival to the
completion. That time splits into waiting for the last member to arrive and the transfer after it.
The waiting is attributed to what made the last arrival late. Within one step and CP group the
members synchronize at every CP collective, so a member's total wait is at most the compute it
lacked against the group's slowest member: ``min(wait_r, max(compute) - compute_r)`` of it is
explained by compute imbalance. When attention work per rank is known (sum of len^2 over the
document pieces it holds), the imbalance is called document-mask imbalance if the slowest member
also had the most attention work. The figure: "X% of exposed CP time is waiting, Y% of that is
explained by <cause>, slowest/fastest compute ratio Z".
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from tracekit.analysis.collectives import match_collectives
from tracekit.analysis.localize import step_time_ns
from tracekit.analysis.rootcause import rank_step_metrics
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables


@dataclass(frozen=True)
class CPWait:
    per_rank: pl.DataFrame  # rank, exposed_ns, wait_ns, transfer_ns, explained_ns, exposed_frac (of its steps)
    per_group_step: pl.DataFrame  # pg_name, step, wait_ns, explained_ns, compute_ratio, slowest_rank, work_ratio
    exposed_ns: float
    wait_ns: float
    transfer_ns: float
    explained_ns: float
    exposed_frac: float  # exposed CP time / step time, over all ranks and steps
    compute_ratio: float  # slowest/fastest CP member's compute per (group, step), weighted by that wait
    work_ratio: float | None  # the same for attention work, when known
    cause: str  # document_mask_imbalance | compute_imbalance | unexplained | none | no_cp

    @property
    def wait_frac(self) -> float:
        return self.wait_ns / self.exposed_ns if self.exposed_ns else 0.0

    @property
    def explained_frac(self) -> float:
        return self.explained_ns / self.wait_ns if self.wait_ns else 0.0

    @property
    def headline(self) -> str:
        if self.cause == "no_cp":
            return "no context-parallel collectives in this run"
        what = {"document_mask_imbalance": "document-mask (attention work) imbalance",
                "compute_imbalance": "compute imbalance between CP ranks",
                "unexplained": "nothing in the compute (unexplained)", "none": "noise"}[self.cause]
        work = f", attention work ratio {self.work_ratio:.2f}" if self.work_ratio is not None else ""
        return (f"exposed CP communication is {self.exposed_frac:.1%} of step time; {self.wait_frac:.1%} of it is "
                f"waiting for the last CP rank, {self.explained_frac:.0%} of the waiting explained by {what}; "
                f"slowest/fastest compute ratio {self.compute_ratio:.2f}{work}")

    def to_dict(self) -> dict:
        return {"headline": self.headline, "cause": self.cause, "exposed_ns": self.exposed_ns,
                "wait_ns": self.wait_ns, "transfer_ns": self.transfer_ns, "explained_ns": self.explained_ns,
                "exposed_frac": self.exposed_frac, "wait_frac": self.wait_frac,
                "explained_frac": self.explained_frac, "compute_ratio": self.compute_ratio,
                "work_ratio": self.work_ratio, "per_rank": self.per_rank.to_dicts(),
                "per_group_step": self.per_group_step.to_dicts()}


def cp_wait(tables: RunTables, tunables: Tunables = Tunables(), work: pl.DataFrame | None = None) -> CPWait:
    """Exposed CP time per rank and in total, split into wait and transfer, and attributed.
    ``work`` (rank, step, work) is optional attention work per rank and step."""
    m = match_collectives(tables).filter(pl.col("dim") == "cp")
    if not m.height:
        empty = pl.DataFrame()
        return CPWait(empty, empty, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, None, "no_cp")
    # A member waits inside its own span only: one whose span ended before the last member arrived
    # (an enqueue-only span, clocks that disagree) waited its whole span, no more, and transferred
    # nothing; so wait + transfer = exposed and every share stays within [0, 1].
    wait = pl.min_horizontal(pl.col("wait_ns").clip(lower_bound=0), pl.col("duration_ns").clip(lower_bound=0))
    m = m.with_columns(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64), wait.alias("wait_ns"))
    m = m.with_columns((pl.col("duration_ns").clip(lower_bound=0) - pl.col("wait_ns")).alias("transfer_ns"))
    comp = rank_step_metrics(tables).select("rank", "step", "compute_ns", "step_ns")
    per = m.group_by("pg_name", "step", "rank").agg(
        pl.col("duration_ns").sum().alias("exposed_ns"), pl.col("wait_ns").sum(), pl.col("transfer_ns").sum())
    per = per.join(comp, on=["rank", "step"], how="left").with_columns(pl.col("compute_ns").fill_null(0))
    if work is not None:
        w = work.group_by("rank", "step").agg(pl.col("work").sum()).with_columns(
            pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64))
        per = per.join(w, on=["rank", "step"], how="left")
    else:
        per = per.with_columns(pl.lit(None, pl.Float64).alias("work"))
    key = ["pg_name", "step"]
    per = per.with_columns(
        pl.min_horizontal("wait_ns", (pl.col("compute_ns").max().over(key) - pl.col("compute_ns")).clip(lower_bound=0))
        .alias("explained_ns"))
    groups = per.group_by(key).agg(
        pl.col("wait_ns").sum(), pl.col("explained_ns").sum(),
        (pl.col("compute_ns").max() / pl.col("compute_ns").min()).alias("compute_ratio"),
        pl.col("rank").sort_by("compute_ns").last().alias("slowest_rank"),
        pl.col("rank").sort_by("work").last().alias("most_work_rank"),
        (pl.col("work").max() / pl.col("work").min()).alias("work_ratio"),
    ).sort(key)
    per_rank = per.group_by("rank").agg(
        pl.col("exposed_ns", "wait_ns", "transfer_ns", "explained_ns").sum(), pl.col("step_ns").sum().alias("_steps"),
    ).with_columns((pl.col("exposed_ns") / pl.col("_steps")).alias("exposed_frac")).drop("_steps").sort("rank")
    totals = {c: float(per[c].sum()) for c in ("exposed_ns", "wait_ns", "transfer_ns", "explained_ns")}
    steps_total = float(per.select(pl.col("step_ns").sum()).item() or 0.0) or step_time_ns(tables) * per.height
    ratio = _weighted(groups, "compute_ratio") or 1.0
    work_ratio = _weighted(groups, "work_ratio")
    explained = totals["explained_ns"] / totals["wait_ns"] if totals["wait_ns"] else 0.0
    if totals["wait_ns"] < tunables.effect_min_frac * steps_total:
        cause = "none"
    elif explained < tunables.cp_explained_min:
        cause = "unexplained"
    elif work_ratio is not None and _work_follows_compute(groups):
        cause = "document_mask_imbalance"
    else:
        cause = "compute_imbalance"
    return CPWait(per_rank, groups, totals["exposed_ns"], totals["wait_ns"], totals["transfer_ns"],
                  totals["explained_ns"], totals["exposed_ns"] / steps_total if steps_total else 0.0,
                  ratio, work_ratio, cause)


def _work_follows_compute(groups: pl.DataFrame) -> bool:
    """The slowest CP member is the one with the most attention work in most (group, step)s."""
    g = groups.drop_nulls("most_work_rank")
    return bool(g.height) and float((g["slowest_rank"] == g["most_work_rank"]).mean()) >= 0.5


def _weighted(groups: pl.DataFrame, col: str) -> float | None:
    """Mean of a per-(group, step) ratio weighted by the wait there: the imbalance where it costs."""
    g = groups.drop_nulls(col).filter(pl.col(col).is_finite())
    if not g.height:
        return None
    w = g["wait_ns"].cast(pl.Float64)
    return float((g[col] * w).sum() / w.sum()) if w.sum() > 0 else float(g[col].median())
