"""Step post-mortem: step times per rank, the slow steps, and what made each slow.

A step of the job lasts as long as its slowest rank (the next step's collectives wait for it). A
step is slow when that time exceeds the median step by ``slow_step_ratio`` and by
``slow_step_spreads`` robust spreads. For each slow step the excess is attributed by comparing every
rank's compute, idle gaps and communication in that step with the same rank's median over all steps:
the component with the largest excess on one rank, or on all ranks alike, is what made it slow.
Communication excess alone is usually waiting on someone else; it is named only when neither
compute nor gaps grew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from tracekit.analysis.rootcause import rank_step_metrics
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables


@dataclass(frozen=True)
class SlowStep:
    step: int
    step_ns: float  # the job's step time (slowest rank)
    excess_ns: float  # over the median step
    cause: str  # slow_compute | cpu_gaps | all_ranks_compute | communication | unexplained
    ranks: tuple[int, ...]  # the rank(s) the cause is about
    summary: str

    def to_dict(self) -> dict:
        return {"step": self.step, "step_ns": self.step_ns, "excess_ns": self.excess_ns, "cause": self.cause,
                "ranks": list(self.ranks), "summary": self.summary}


@dataclass(frozen=True)
class StepReport:
    per_rank: pl.DataFrame  # rank, step, step_ns, compute_ns, comm_ns, gap_ns
    per_step: pl.DataFrame  # step, step_ns (slowest rank), slowest_rank, slow
    median_step_ns: float
    slow: list[SlowStep] = field(default_factory=list)

    @property
    def headline(self) -> str:
        if not self.per_step.height:
            return "no steps recorded"
        med = self.median_step_ns / 1e6
        if not self.slow:
            return f"{self.per_step.height} steps, median {med:.1f} ms; no slow steps"
        worst = max(self.slow, key=lambda s: s.excess_ns)
        return (f"{self.per_step.height} steps, median {med:.1f} ms; {len(self.slow)} slow "
                f"(worst step {worst.step}: +{worst.excess_ns / 1e6:.1f} ms, {worst.summary})")

    def to_dict(self) -> dict:
        return {"headline": self.headline, "median_step_ns": self.median_step_ns,
                "per_step": self.per_step.to_dicts(), "slow_steps": [s.to_dict() for s in self.slow],
                "per_rank": self.per_rank.to_dicts()}


def _robust_spread(values: pl.Series) -> float:
    med = values.median()
    return float((values - med).abs().median() or 0.0) * 1.4826


def step_report(tables: RunTables, tunables: Tunables = Tunables()) -> StepReport:
    """Step times per rank and per step, the slow steps and the cause of each."""
    m = rank_step_metrics(tables).drop_nulls("step")
    per_rank = m.with_columns((pl.col("busy_ns") - pl.col("compute_ns")).clip(lower_bound=0).alias("comm_ns")).select(
        "rank", "step", pl.col("step_ns").cast(pl.Float64), pl.col("compute_ns").cast(pl.Float64),
        pl.col("comm_ns").cast(pl.Float64), pl.col("gap_ns").cast(pl.Float64)).sort("step", "rank")
    if not per_rank.height:
        empty = pl.DataFrame(schema={"step": pl.Int64, "step_ns": pl.Float64, "slowest_rank": pl.Int32,
                                     "slow": pl.Boolean})
        return StepReport(per_rank, empty, 0.0)
    per_step = per_rank.sort("step_ns", descending=True).group_by("step", maintain_order=True).agg(
        pl.col("step_ns").first(), pl.col("rank").first().alias("slowest_rank")).sort("step")
    med = float(per_step["step_ns"].median())
    bar = max(med * tunables.slow_step_ratio, med + tunables.slow_step_spreads * _robust_spread(per_step["step_ns"]))
    per_step = per_step.with_columns((pl.col("step_ns") > bar).alias("slow"))
    base = per_rank.group_by("rank").agg(pl.col("compute_ns", "comm_ns", "gap_ns").median().name.suffix("_med"))
    excess = per_rank.join(base, on="rank").with_columns(
        [(pl.col(c) - pl.col(f"{c}_med")).alias(f"{c}_x") for c in ("compute_ns", "comm_ns", "gap_ns")])
    slow = [_explain_step(excess.filter(pl.col("step") == s), s, t, t - med)
            for s, t in per_step.filter("slow").select("step", "step_ns").iter_rows()]
    return StepReport(per_rank, per_step, med, slow)


def _explain_step(ex: pl.DataFrame, step: int, step_ns: float, excess: float) -> SlowStep:
    half = 0.5 * excess
    comp = ex.sort("compute_ns_x", descending=True)
    grew = comp.filter(pl.col("compute_ns_x") >= half)
    if grew.height and grew.height >= max(2, (ex.height + 1) // 2) and grew.height > 1:
        return SlowStep(step, step_ns, excess, "all_ranks_compute", tuple(sorted(grew["rank"].to_list())),
                        f"{grew.height}/{ex.height} ranks computed longer (median +"
                        f"{grew['compute_ns_x'].median() / 1e6:.1f} ms): more work or a shared slowdown")
    top_c = comp.row(0, named=True)
    top_g = ex.sort("gap_ns_x", descending=True).row(0, named=True)
    if top_c["compute_ns_x"] >= half and top_c["compute_ns_x"] >= top_g["gap_ns_x"]:
        r = top_c["rank"]
        return SlowStep(step, step_ns, excess, "slow_compute", (r,),
                        f"rank {r} computed {top_c['compute_ns_x'] / 1e6:.1f} ms longer than its usual step")
    if top_g["gap_ns_x"] >= half:
        r = top_g["rank"]
        return SlowStep(step, step_ns, excess, "cpu_gaps", (r,),
                        f"rank {r} idled {top_g['gap_ns_x'] / 1e6:.1f} ms more between ops (CPU side)")
    top_m = ex.sort("comm_ns_x").row(0, named=True)  # least waiting: the one others waited for
    if float(ex["comm_ns_x"].median()) >= half:
        return SlowStep(step, step_ns, excess, "communication", (top_m["rank"],),
                        f"communication took {float(ex['comm_ns_x'].median()) / 1e6:.1f} ms longer on most ranks; "
                        f"rank {top_m['rank']} waited least (the others waited on it or on a slow link)")
    return SlowStep(step, step_ns, excess, "unexplained", (), "no rank's compute, gaps or communication explain it")
