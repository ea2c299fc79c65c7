"""The persistent test's guard against healthy ranks that differ (culprits.find_culprits), on
compute_speed-shaped tables: each rank's per-step log compute ratio is its own persistent offset (a
chip a little faster or slower, sd 1%) plus per-step noise, none of them a fault."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from tracekit.analysis.culprits import find_culprits


def _speed(offsets: np.ndarray, stages: list[int], rng: np.random.Generator, step_sd: float, steps: int = 8
           ) -> pl.DataFrame:
    rows = [(t, r, st, float(o + rng.normal(0, step_sd)))
            for t in range(steps) for r, (o, st) in enumerate(zip(offsets, stages))]
    df = pl.DataFrame(rows, schema=["step", "rank", "pp", "log_ratio"], orient="row")
    return df.with_columns(pl.col("step").cast(pl.Int64), pl.col("rank").cast(pl.Int32), pl.col("pp").cast(pl.Int32),
                           pl.col("log_ratio").alias("log_total"), pl.lit(0.0).alias("excess_ns"),
                           pl.lit(1e6).alias("ref_ns"), pl.lit(40, pl.UInt32).alias("spans"))


@pytest.mark.parametrize("step_sd", [0.01, 0.02])
def test_chips_that_differ_in_two_stages_of_four_are_seldom_named(step_sd):
    """300 seeded clean runs of 2 stages x 4 ranks whose chips differ by sd 1%: with the candidate's
    stage peers in the guard (no other rank of its stage named by the first look) 14-15 name a rank;
    with the other stage's 4 ranks alone, 23-24."""
    stages = [0, 0, 0, 0, 1, 1, 1, 1]
    named = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        named += bool(find_culprits(_speed(rng.normal(0, 0.01, 8), stages, rng, step_sd)).findings)
    assert named <= 18, named


def test_two_slow_ranks_of_a_stage_of_four_are_both_named():
    stages = [0, 0, 0, 0, 1, 1, 1, 1]
    for seed in range(50):
        rng = np.random.default_rng(seed)
        offsets = rng.normal(0, 0.002, 8)
        offsets[[1, 3]] += np.log(1.1)
        found = find_culprits(_speed(offsets, stages, rng, 0.01))
        assert sorted(f.rank for f in found.findings if f.kind == "persistent") == [1, 3], seed


@pytest.mark.parametrize("slower, named, sure", [(1.0, False, (0.99, 0.99)), (1.01, False, (0.9, 0.99)),
                                                 (1.018, False, (0.0, 0.6)),
                                                 (1.04, True, None)])
def test_no_straggler_is_as_sure_as_the_nearest_rank_is_far_from_a_finding(slower, named, sure):
    """4 ranks, one of them ``slower`` in every step, the steps' scatter 0.3%: a rank 1% slower stands
    many noise units out, above the bar, yet half the 2% effect floor away, so "no straggler" is
    sure (on the bar alone it read 0.00, as 4 clean gloo runs on 2 cores did, rank 0 1.0% slower);
    at 1.8%, near the floor, it is not; at 4% the rank is named. With none slower, 0.99 at most, as
    a finding's confidence: a rank slower by less than the floor can always be there."""
    rng = np.random.default_rng(3)
    offsets = np.zeros(4)
    offsets[0] = np.log(slower)
    found = find_culprits(_speed(offsets, [0, 0, 0, 0], rng, 0.003, steps=6))
    assert bool(found.findings) == named
    if sure is not None:
        if slower > 1:
            assert found.top_margin > found.bar  # the bar alone would say "a straggler is at hand"
        assert sure[0] <= found.none_confidence() <= sure[1], (found.shortfall, found.none_confidence())
