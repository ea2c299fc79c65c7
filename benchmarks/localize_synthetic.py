"""Localization accuracy on the modelled 4D job of tests/synthetic_job.py (no trainer needed).

Prints top-1 accuracy per slowdown, cause accuracy and the false-alarm rate on fault-free runs,
next to a flat baseline (the rank with the shortest mean collective duration, which has no notion
of "no straggler"). The accuracy benchmark on real trainer runs is benchmarks/localize_accuracy.py.

    PYTHONPATH=. python benchmarks/localize_synthetic.py [--seeds 1] [--clean 24] [--noise 0.01] [--steps 8]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import polars as pl  # noqa: E402
from synthetic_job import Faults, make_job  # noqa: E402

from tracekit.analysis.diagnosis import diagnose  # noqa: E402
from tracekit.analysis.tables import RunTables  # noqa: E402
from tracekit.topology import Layout  # noqa: E402

LAYOUT = Layout(tp=2, cp=2, pp=2, dp=2)


def shortest_mean_collective(tables: RunTables) -> int:
    c = tables.collectives.with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("d"))
    return int(c.group_by("rank").agg(pl.col("d").mean()).sort("d").row(0)[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=1, help="runs per (position, slowdown)")
    ap.add_argument("--clean", type=int, default=24, help="fault-free runs")
    ap.add_argument("--noise", type=float, default=0.01, help="jitter (std, relative) of every compute op")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    kw = {"noise": args.noise, "steps": args.steps}
    hits, base_hits, total = defaultdict(int), defaultdict(int), defaultdict(int)
    causes = defaultdict(lambda: [0, 0])
    seed = 1000
    for factor in (1.05, 1.10, 1.30):
        for rank in range(LAYOUT.world_size):
            for _ in range(args.seeds):
                seed += 1
                t = RunTables.from_mapping(make_job(LAYOUT, faults=Faults(slow_rank=rank, slow_factor=factor), seed=seed, **kw))
                d = diagnose(t)
                total[factor] += 1
                hits[factor] += d.localization.culprit_rank == rank
                base_hits[factor] += shortest_mean_collective(t) == rank
                causes["slow_compute"][0] += d.cause.kind == "slow_compute"
                causes["slow_compute"][1] += 1
    for pair in ((0, 4), (9, 13), (2, 6), (11, 15)):
        seed += 1
        d = diagnose(RunTables.from_mapping(make_job(LAYOUT, faults=Faults(slow_link=pair), seed=seed, **kw)))
        causes["slow_link"][0] += d.cause.kind == "slow_link" and set(d.cause.ranks) == set(pair)
        causes["slow_link"][1] += 1
    for rank in (0, 5, 10, 15):
        seed += 1
        d = diagnose(RunTables.from_mapping(make_job(LAYOUT, faults=Faults(cpu_bound_rank=rank), seed=seed, **kw)))
        causes["cpu_bound"][0] += d.cause.kind == "cpu_bound" and d.localization.culprit_rank == rank
        causes["cpu_bound"][1] += 1
    false_alarms = 0
    for i in range(args.clean):
        d = diagnose(RunTables.from_mapping(make_job(LAYOUT, seed=i, **kw)))
        false_alarms += d.localization.verdict != "no_straggler"
    print(f"layout {LAYOUT}, {args.steps} steps x 4 micro-batches per run, {args.noise:.0%} jitter per compute op")
    print(f"{'slowdown':>9} {'runs':>5} {'tracekit top-1':>15} {'shortest-mean top-1':>20}")
    for f in sorted(total):
        print(f"{f - 1:>9.0%} {total[f]:>5} {hits[f] / total[f]:>15.1%} {base_hits[f] / total[f]:>20.1%}")
    for kind, (ok, n) in causes.items():
        print(f"cause {kind:<13} {ok}/{n} right")
    print(f"false alarms: tracekit {false_alarms}/{args.clean}, shortest-mean {args.clean}/{args.clean} (always names a rank)")


if __name__ == "__main__":
    main()
