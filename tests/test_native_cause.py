"""The cause the diagnosis gives a slow device on a torch-native job (reference_trainer/native_job.py:
DTensor TP, gloo, plain torch.profiler; nothing annotated): its CPU ops are all slower, so it is a
slow worker, not data imbalance. With each kernel class's time summed (before attention_split took
a trimmed mean of span ratios), 4 of 25 stored torch-native runs of benchmarks/native_accuracy.py,
all at factor 1.3, had their slow device called data imbalance; whether a given run does depends on
the machine's load, so this one (tp 2, rank 1 computing 1.3x slower, 4 steps) pins the answer, not
that history."""

from __future__ import annotations

import pytest

import tracekit
from reference_trainer import native_job
from tracekit.ingest.pipeline import ingest


@pytest.fixture(scope="module")
def diagnosis(tmp_path_factory):
    out = tmp_path_factory.mktemp("native_cause")
    native_job.run(native_job.parse_args(["--dp", "1", "--pp", "1", "--tp", "2", "--steps", "4", "--seed", "0",
                                          "--out", str(out / "run"), "--slow-rank", "1", "--slow-factor", "1.3"]))
    ingest([out / "run"], out / "s.duckdb")
    with tracekit.open(out / "s.duckdb") as s:
        return s.diagnose()


def test_a_slow_device_on_a_native_job_is_a_slow_worker(diagnosis):
    stragglers = [f for f in diagnosis.findings if f.kind == "straggler"]
    assert [f.ranks for f in stragglers] == [(1,)], diagnosis.headline
    assert stragglers[0].cause == "slow_compute", stragglers[0].summary
