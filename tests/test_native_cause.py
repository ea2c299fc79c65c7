"""The cause the diagnosis gives a slow device on a torch-native job (reference_trainer/native_job.py:
DTensor TP, gloo, plain torch.profiler; nothing annotated): its CPU ops are all slower, so it is a
slow worker, not data imbalance. With each kernel class's time summed (before attention_split took
a trimmed mean of span ratios), 4 of 25 stored torch-native runs of benchmarks/native_accuracy.py,
all at factor 1.3, had their slow device called data imbalance; whether a given run does depends on
the machine's load, so this one (tp 2, rank 1 computing 1.3x slower, 4 steps) pins the answer, not
that history.

The two processes share this machine's two cores with everything else on it: in some runs a rank's
CPU ops scatter by 11-41% from step to step (measured in 2026-11-27's suite runs: the test failed in
about one run of four, on the code of then and of the stop before), and then no 1.3x rank can stand
out over 8 steps, which the answer says ("a rank 168% slower would have stood out"); and once (at 5%
scatter, two other jobs on the cores) rank 1's CPU ops did not come out slower than rank 0's at all.
Such a run is no input for this test: it is run again, up to three times, and skipped if the
machine stays that noisy. The assertions are on runs quiet enough to measure a 1.3x rank, whose
slowdown shows in its compute (at least 1.15x rank 0's, median over the steps)."""

from __future__ import annotations

import math

import polars as pl
import pytest

import tracekit
from reference_trainer import native_job
from tracekit.analysis.compute_speed import compute_speed
from tracekit.ingest.pipeline import ingest

NOISY = math.log(1.10)  # compute scatter per step above which a 1.3x rank cannot be measured here
# the emulated slowdown must show in the compute at all: once in a full suite run (scatter 5%, load
# from two other jobs) the two ranks' CPU ops came out within noise of each other, "no straggler";
# this test is about the cause a slow device is given, not about the emulation under load
SHOWN = 1.15
ATTEMPTS = 3


@pytest.fixture(scope="module")
def diagnosis(tmp_path_factory):
    scatters = []
    for attempt in range(ATTEMPTS):
        out = tmp_path_factory.mktemp(f"native_cause{attempt}")
        native_job.run(native_job.parse_args(["--dp", "1", "--pp", "1", "--tp", "2", "--steps", "8", "--seed", "0",
                                              "--out", str(out / "run"), "--slow-rank", "1", "--slow-factor", "1.3"]))
        ingest([out / "run"], out / "s.duckdb")
        with tracekit.open(out / "s.duckdb") as s:
            d = s.diagnose()
            speed = compute_speed(s.run_tables())
        per_rank = dict(speed.group_by("rank").agg(pl.col("log_ratio").median()).iter_rows())
        shown = math.exp(per_rank.get(1, 0.0))  # against its only peer's same spans
        scatters.append((d.compute.sigma if d.compute is not None else float("inf"), shown))
        if scatters[-1][0] <= NOISY and shown >= SHOWN:
            return d
    pytest.skip(f"the machine was too noisy to measure a 1.3x rank: compute scatter per step, and rank 1's "
                f"compute over rank 0's, in {ATTEMPTS} runs: "
                f"{', '.join(f'{math.exp(x) - 1:.0%} and {r:.2f}x' for x, r in scatters)}")


def test_a_slow_device_on_a_native_job_is_a_slow_worker(diagnosis):
    stragglers = [f for f in diagnosis.findings if f.kind == "straggler"]
    assert [f.ranks for f in stragglers] == [(1,)], diagnosis.headline
    assert stragglers[0].cause == "slow_compute", stragglers[0].summary
