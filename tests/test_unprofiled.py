"""Ranks without a profiler trace (half of a job profiled, as real jobs often do): judged by their
flight-recorder durations, never left out silently. Simulated NCCL jobs (skewed host clocks) through
the real ingest and ``store.diagnose``, with the traces of ranks 8-15 removed."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import polars as pl
import pytest

import tracekit
from tracekit.analysis.unprofiled import recorder_lateness
from tracekit.ingest import ingest
from tracekit.simulate.config import SimConfig
from tracekit.simulate.run import simulate

UNPROFILED = range(8, 16)


def _run(root: Path, faults: tuple[str, ...] = (), timed: bool = True, seed: int = 11):
    run = simulate(SimConfig(tp=2, pp=2, dp=4, steps=6, seed=seed, faults=faults, noise=0.05, skew_ms=2000.0,
                             layers=2), root / "run")
    (run / "manifest.json").unlink()
    for r in UNPROFILED:
        (run / "traces" / f"rank{r}.json.gz").unlink()
    if not timed:  # NCCL without TORCH_NCCL_ENABLE_TIMING: no start, completion or duration
        for dump in (run / "fr").iterdir():
            data = pickle.loads(dump.read_bytes())
            for e in data["entries"]:
                e.update(duration_ms=None, time_discovered_started_ns=None, time_discovered_completed_ns=None)
            dump.write_bytes(pickle.dumps(data))
    ingest([run], root / "s.duckdb", workers=1)
    with tracekit.open(root / "s.duckdb") as s:
        return s.diagnose()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, faults, timed in (("slow9", ("slow:rank=9,factor=1.3",), True), ("slow1", ("slow:rank=1,factor=1.3",), True),
                                ("clean", (), True), ("untimed", ("slow:rank=9,factor=1.3",), False)):
        out[name] = _run(tmp_path_factory.mktemp(name), faults, timed)
    return out


def test_a_straggler_without_a_trace_is_named_from_its_flight_recorder(runs):
    d = runs["slow9"]
    assert [(f.kind, f.ranks, f.cause) for f in d.findings] == [("straggler", (9,), "late_no_trace")], d.headline
    f = d.findings[0]
    assert f.confidence >= 0.9 and "flight recorder" in f.summary and "(dp 2, pp 0, tp 1)" in f.where
    assert 0.01 < f.cost_share < 0.5 and "profile rank 9" in f.next_step
    assert set(d.damaged) == set(UNPROFILED)  # still named as without a trace
    blob = json.loads(json.dumps(d.to_dict()))  # what --json prints (a cause without a category crashed it)
    assert blob["cause"]["category"] == "worker" and blob["recorder"]["late"] == [9]


def test_a_profiled_straggler_is_named_alone(runs):
    """Rank 1 slow: the unprofiled ranks of its DP group wait for it; none of them is late."""
    d = runs["slow1"]
    assert [(f.kind, f.ranks) for f in d.findings] == [("straggler", (1,))], d.headline


def test_a_clean_run_names_no_one_and_says_how_the_untraced_ranks_were_judged(runs):
    d = runs["clean"]
    assert not d.findings, d.headline
    assert "judged on their flight-recorder durations alone: " + ", ".join(
        f"rank {r}: no profiler trace" for r in UNPROFILED) in d.headline and d.localization.confidence > 0.5


def test_without_timed_records_no_straggler_is_not_sure(runs):
    """The recorder without durations (NCCL without TORCH_NCCL_ENABLE_TIMING): rank 9 cannot be seen,
    and "no straggler" must not read 0.97 as it did."""
    d = runs["untimed"]
    assert not d.findings
    assert d.localization.confidence <= 0.5 and "would not show" in d.cause.summary, d.headline


def _fr(durations: dict[int, list[float]], group: str = "0") -> pl.DataFrame:
    rows = [(r, group, "mesh_dp", seq, d, seq * 10**8, "completed", False, "nccl:all_reduce")
            for r, ds in durations.items() for seq, d in enumerate(ds)]
    return pl.DataFrame(rows, schema=["rank", "pg_name", "pg_desc", "collective_seq_id", "duration_ms",
                                      "time_created_ns", "state", "is_p2p", "profiling_name"], orient="row")


def test_lateness_is_the_other_members_mean_less_its_own_duration():
    import numpy as np

    rng = np.random.default_rng(0)
    base = {r: list(10.0 + rng.normal(0, 0.05, 40)) for r in range(4)}
    base[3] = [d - 2.0 for d in base[3]]  # reaches every collective 2 ms after the others
    got = recorder_lateness(_fr(base), [2, 3], step_ns=10 * 10**8)
    assert got.judged == (2, 3) and [x.rank for x in got.late] == [3]
    assert abs(got.late[0].late_ns / 1e6 - 2.0) < 0.1 and got.late[0].last_share == 1.0
    quiet = {r: list(10.0 + rng.normal(0, 0.05, 40)) for r in range(4)}
    assert not recorder_lateness(_fr(quiet), [0, 1, 2, 3], step_ns=10 * 10**8).late
    # a rank absent from the recorder, or whose entries carry no duration, is not judged
    untimed = _fr(quiet).with_columns(pl.when(pl.col("rank") == 1).then(None).otherwise(pl.col("duration_ms"))
                                      .alias("duration_ms"))
    got = recorder_lateness(untimed, [1, 7], step_ns=10 * 10**8)
    assert got.judged == () and got.unjudged == (1, 7)


def test_past_the_rows_read_at_most_the_untraced_ranks_are_unjudged_and_say_why(tmp_path, monkeypatch):
    import tracekit.analysis.unprofiled as unprofiled

    monkeypatch.setattr(unprofiled, "ROWS_MAX", 100)
    d = _run(tmp_path, ("slow:rank=9,factor=1.3",))
    assert not d.findings and d.localization.confidence <= 0.5
    assert "more than the 100 read at most" in d.cause.summary and "would not show" in d.cause.summary


def test_every_cause_a_finding_can_name_has_a_category_and_a_next_step():
    """A finding's cause becomes the primary Cause, whose --json carries its category: a cause added
    without one (late_no_trace) turned every --json of such a run into a crash."""
    from tracekit.analysis.findings import NEXT_STEP
    from tracekit.analysis.rootcause import CATEGORY

    causes = set(NEXT_STEP) - {"host_transfer"}  # a next step only (a CPU link's), never a cause
    assert causes <= set(CATEGORY), causes - set(CATEGORY)


def test_a_rank_late_by_waiting_on_its_pipeline_neighbour_is_its_victim():
    """Two replicas of two stages: rank 3 (stage 1) is slow; rank 2 (stage 0 of the same replica)
    waits on its receives from rank 3 and reaches its own DP collective as late. Only rank 3 is named."""
    import numpy as np

    rng = np.random.default_rng(1)
    n = 24
    dp0 = {0: list(10.0 + rng.normal(0, 0.05, n)), 2: list(7.0 + rng.normal(0, 0.05, n))}
    dp1 = {1: list(10.0 + rng.normal(0, 0.05, n)), 3: list(7.0 + rng.normal(0, 0.05, n))}
    recv = [(r, "pp", "pp", None, d, i * 10**8, "completed", True, "nccl:recv 0<-1")
            for r, base in ((0, 1.0), (1, 1.0), (2, 4.0), (3, 1.0)) for i, d in enumerate(base + rng.normal(0, 0.05, n))]
    fr = pl.concat([_fr(dp0, "dp0"), _fr(dp1, "dp1"),
                    pl.DataFrame(recv, schema=_fr(dp0).schema, orient="row")])
    got = recorder_lateness(fr, [2, 3], step_ns=10 * 10**8)
    assert [x.rank for x in got.late] == [3] and got.waited == (2,)
    # without the receives, both read late: the rule is what tells them apart
    both = recorder_lateness(fr.filter(~pl.col("is_p2p")), [2, 3], step_ns=10 * 10**8)
    assert [x.rank for x in both.late] == [2, 3]


def test_no_late_rank_is_only_as_sure_as_the_recorder_could_see():
    """Durations that scatter by a fifth of a step hide a rank late by a tenth of one (a grid draw's
    reduce-scatters of 100-250 ms hid a 1.3x rank, and "no straggler" read 0.99): at most 0.5."""
    import numpy as np

    rng = np.random.default_rng(2)
    quiet = {r: list(10.0 + rng.normal(0, 0.05, 40)) for r in range(4)}
    sure = recorder_lateness(_fr(quiet), [2, 3], step_ns=10 * 10**8)
    assert not sure.late and sure.detectable_frac < 0.01 and sure.none_confidence() > 0.9
    noisy = {r: list(100.0 + rng.normal(0, 80.0, 40)) for r in range(4)}
    blind = recorder_lateness(_fr(noisy), [2, 3], step_ns=10 * 10**8)
    assert not blind.late and blind.detectable_frac > 0.1 and blind.none_confidence() <= 0.5


def test_a_rank_late_on_average_but_in_under_persist_min_of_its_collectives_is_not_near_a_finding():
    """On a busy 2-core gloo run a punctual rank ran late on average, far past the bar, but in about
    half of its collectives: "no straggler" read 0.00 on three clean trainer runs."""
    import numpy as np

    rng = np.random.default_rng(3)
    ds = {r: list(10.0 + rng.normal(0, 0.05, 60)) for r in range(4)}
    ds[3] = [d - (3.0 if i % 20 < 9 else -0.1) for i, d in enumerate(ds[3])]  # late in 45% of them
    got = recorder_lateness(_fr(ds), [3], step_ns=10**8)  # a step per collective: past the 1% floor
    assert not got.late and got.none_confidence() > 0.5, (got.shortfall, got.none_confidence())


@pytest.mark.parametrize("cfg, slow, factor", [
    # the traced half of rank 7's DP group, [9, 11, 13, 15], read 'transfers 1.07x slower' (0.79)
    # beside it: their transfers wait for a member whose arrival no trace shows
    ({"seed": 1299, "names": "none", "noise": 0.1, "skew_ms": 0.0, "drift_ppm": 0.0}, 7, 1.1),
    # rank 4, stage 0 of rank 5's replica, was named too (0.73): it reached its DP collectives late
    # by the time it waited on its receives from rank 5
    ({"seed": 300, "names": "plain", "noise": 0.15, "skew_ms": 50.0, "drift_ppm": 20.0}, 5, 1.3),
])
def test_only_the_late_untraced_rank_is_named_not_what_it_delays(tmp_path, cfg, slow, factor):
    """Grid draw 0 of the untraced kind: ranks 0-7 of pp 2 x dp 8 without traces, one of them slow."""
    sim = simulate(SimConfig(tp=1, cp=1, pp=2, dp=8, steps=8, faults=(f"slow:rank={slow},factor={factor}",),
                             spikes=0.01, layers=4, **cfg), tmp_path / "run")
    (sim / "manifest.json").unlink()
    for r in range(8):
        (sim / "traces" / f"rank{r}.json.gz").unlink()
    ingest([sim], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        d = s.diagnose()
    assert [(f.kind, f.ranks, f.cause) for f in d.findings] == [("straggler", (slow,), "late_no_trace")], d.headline
