"""The estimator next to measured memory: per rank, what was live at the peak against what the
estimate says, component by component, so that the gap between the two totals is explained.

Measured bytes come from the snapshot's categories (tracekit.analysis.memory's live-at-peak by
category) mapped to the estimator's components; what the estimator has no term for (temporaries,
blocks without a category) is the component ``other``, estimated at 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import polars as pl

from tracekit.analysis.memory import KEY, MemoryAnalysis, MemoryDataError
from tracekit.memory.estimate import MemoryEstimate

# Snapshot categories (torch's memory profiler names) -> estimator components.
CATEGORY_COMPONENT = {
    "parameter": "weights", "gradient": "gradients", "optimizer_state": "optimizer",
    "activation": "activations", "autograd_detail": "activations", "input": "activations",
    "temporary": "other", "unknown": "other",
}
COMPARED = ("weights", "gradients", "optimizer", "activations", "other")
CONFIG_KEYS = ("tp", "cp", "pp", "dp", "vstages", "schedule", "zero_stage", "micro_batches",
               "micro_batch_size", "seq_len", "compute_dtype", "grad_accum_dtype")


def compare_with_estimate(live: pl.DataFrame, estimates: Mapping[int, MemoryEstimate]) -> pl.DataFrame:
    """Measured bytes live at each rank's peak (``live_at_peak(..., by='category')``) next to an
    estimate per rank (``{rank: MemoryEstimate}``), by component: run_id, rank, component,
    estimated, measured, difference (measured - estimated). Categories the estimator has no term
    for (temporaries, uncategorized blocks) land in 'other', estimated 0."""
    missing = sorted(set(live["rank"].unique().to_list()) - set(estimates))
    if missing:
        raise MemoryDataError(f"no estimate for ranks {missing}")
    measured = live.with_columns(
        pl.col("category").replace_strict(CATEGORY_COMPONENT, default="other").alias("component")
    ).group_by(KEY + ["component"]).agg(pl.col("bytes").sum().alias("measured"))
    est = pl.DataFrame(
        [{"rank": r, "component": c, "estimated": float(getattr(e, c)) if c != "other" else 0.0}
         for r, e in estimates.items() for c in COMPARED],
        schema={"rank": live.schema["rank"], "component": pl.Utf8, "estimated": pl.Float64})
    runs = live.select(KEY).unique()
    return (runs.join(est, on="rank").join(measured, on=KEY + ["component"], how="left")
            .with_columns(pl.col("measured").fill_null(0))
            .with_columns((pl.col("measured") - pl.col("estimated")).alias("difference"))
            .with_columns(pl.col("component").cast(pl.Enum(list(COMPARED))))
            .sort(KEY + ["component"]).with_columns(pl.col("component").cast(pl.Utf8)))


def by_rank(components: pl.DataFrame, peaks: pl.DataFrame) -> pl.DataFrame:
    """One row per rank: the measured peak, the estimated total, their difference and ratio, the
    difference per component (``<component>_difference``) and the component with the largest gap."""
    totals = components.group_by(KEY).agg(pl.col("estimated").sum(), pl.col("measured").sum())
    wide = components.pivot(on="component", index=KEY, values="difference")
    wide = wide.rename({c: f"{c}_difference" for c in COMPARED if c in wide.columns})
    gap = (components.with_columns(pl.col("difference").abs().alias("gap"))
           .sort("gap", descending=True).group_by(KEY).agg(pl.col("component").first().alias("largest_gap")))
    cols = [c for c in ("pp", "peak_seq", "peak_phase") if c in peaks.columns]
    out = (peaks.select(*KEY, "peak_allocated", *cols)
           .join(totals, on=KEY).join(wide, on=KEY).join(gap, on=KEY)
           .with_columns((pl.col("peak_allocated") - pl.col("estimated")).alias("difference"),
                         (pl.col("peak_allocated") / pl.col("estimated")).alias("measured_over_estimated")))
    if (out["measured"] != out["peak_allocated"]).any():  # live-at-peak must add up to the peak
        raise MemoryDataError("live-at-peak bytes do not add up to the peak")
    return out.drop("measured").sort(KEY)


@dataclass(frozen=True)
class MemoryComparison:
    """Estimate vs measured for one run: by rank and by (rank, component), the estimates used and
    the trainer config they were computed for."""

    by_rank: pl.DataFrame
    by_component: pl.DataFrame
    estimates: dict[int, MemoryEstimate] = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def trainer_comparison(result: MemoryAnalysis, manifest: Mapping, peaks: pl.DataFrame | None = None
                       ) -> MemoryComparison:
    """The estimator applied to a reference-trainer run's own config (its manifest: dims, layout,
    dtypes, ZeRO stage, schedule) next to the measured peak of every rank in ``result``.
    ``peaks`` may be ``result.peaks`` with more columns (e.g. from ``imbalance``)."""
    from tracekit.memory.trainer import trainer_estimate

    profiled = (manifest.get("artifacts") or {}).get("profiled_steps") or [1]
    after_first = min(profiled) > 0  # from the second step on, last step's reduced shard is live
    ranks = result.peaks["rank"].to_list()
    estimates = {int(r): trainer_estimate(manifest, int(r), after_first_step=after_first) for r in ranks}
    components = compare_with_estimate(result.live_at_peak("category"), estimates)
    cfg = manifest.get("config", {})
    return MemoryComparison(by_rank=by_rank(components, result.peaks if peaks is None else peaks),
                            by_component=components, estimates=estimates,
                            config={k: cfg[k] for k in CONFIG_KEYS if k in cfg})
