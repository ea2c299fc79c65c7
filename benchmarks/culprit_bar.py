"""Where the persistent-straggler bar sits, measured on fresh simulated runs (seeds the diagnosis grid
does not use): how often a rank that is not slow clears it (false alarms) and how often a 3% and a 5%
slow rank do, at the bar in use and beside it; and the ceiling: a detector that knew each run's noise
exactly (normal kernel noise, every span pooled, 1% false alarms per run by Bonferroni).

    python benchmarks/culprit_bar.py --runs 400            # about 15 min here
    python benchmarks/culprit_bar.py --runs 60 --seed 2    # another draw

Each run: tracekit/simulate with a layout of benchmarks/diagnosis_grid.py, 8 steps, 4 layers, kernel
noise 2-15%, deschedule spikes, skewed and drifting clocks, DeviceMesh or plain names; clean (half of
the runs), one rank 1.03x or one rank 1.05x; then the real ingest and compute_speed, and
culprits.find_culprits at each bar (Tunables.culprit_margin_min). A false alarm is any persistent
finding on a rank that is not slow.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist

import polars as pl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

BARS = (2.0, 2.25, 2.5, 3.0)


def one_run(i: int, rng: random.Random, base_seed: int, work: Path) -> dict:
    import tracekit
    from diagnosis_grid import LAYOUTS
    from tracekit.analysis.compute_speed import compute_speed
    from tracekit.ingest import ingest
    from tracekit.simulate.config import SimConfig
    from tracekit.simulate.run import simulate

    tp, cp, pp, dp = rng.choice(LAYOUTS)
    world = tp * cp * pp * dp
    kind = rng.choice(["clean", "clean", "slow3", "slow5"])
    noise = rng.choice([0.02, 0.05, 0.1, 0.15])
    slow = rng.randrange(world)
    faults = () if kind == "clean" else (f"slow:rank={slow},factor={1.03 if kind == 'slow3' else 1.05}",)
    cfg = SimConfig(tp=tp, cp=cp, pp=pp, dp=dp, steps=8, seed=base_seed + i, faults=faults,
                    names=rng.choice(["mesh", "plain"]), noise=noise, spikes=rng.choice([0.0, 0.002, 0.01]),
                    skew_ms=rng.choice([0.0, 50.0, 2000.0]), drift_ppm=rng.choice([0.0, 20.0]), layers=4)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    simulate(cfg, work / "run")
    ingest([work / "run"], work / "s.duckdb", workers=1)
    with tracekit.open(work / "s.duckdb") as s:
        speed = compute_speed(s.run_tables())
    return {"kind": kind, "noise": noise, "slow": None if kind == "clean" else slow, "speed": speed, "world": world}


def judge(run: dict, bar: float) -> tuple[bool, bool]:
    """(a rank that is not slow was named, the slow rank was named)."""
    from tracekit.analysis.culprits import find_culprits
    from tracekit.analysis.tunables import Tunables

    found = find_culprits(run["speed"], replace(Tunables(), culprit_margin_min=bar))
    named = {f.rank for f in found.findings if f.kind == "persistent"}
    return bool(named - {run["slow"]}), run["slow"] in named


def oracle_power(run: dict, factor: float) -> float:
    """Chance that a test knowing the kernel noise finds the rank: every span pooled, its mean log
    ratio against its peers' in standard errors, over the Bonferroni bar for 1% per run."""
    spans = run["speed"].group_by("rank").agg(pl.col("spans").sum().alias("n"))["n"].median()
    n = run["world"]
    se = run["noise"] * math.sqrt(1 + 1 / max(n - 1, 1)) / math.sqrt(max(spans, 1))
    return NormalDist().cdf(math.log(factor) / se - NormalDist().inv_cdf(1 - 0.01 / n))


def _fmt(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def main() -> int:
    from tracekit.analysis.tunables import Tunables

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(7_000 + args.seed)
    work = Path(tempfile.mkdtemp(prefix="culprit_bar_"))
    runs, t0 = [], time.time()
    try:
        for i in range(args.runs):
            runs.append(one_run(i, rng, 100_000 + args.seed * 10_000, work / "case"))
            if (i + 1) % 20 == 0:
                print(f"[{i + 1}/{args.runs}] {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    in_use = Tunables().culprit_margin_min
    print(f"\n{len(runs)} fresh runs in {time.time() - t0:.0f} s; bar = culprit_margin_min + ln(ranks / 2), "
          f"in use: {in_use}\n")
    noises = (0.02, 0.05, 0.1, 0.15)

    def by_noise(hits: list[tuple[dict, float]]) -> str:
        return " / ".join(f"{_fmt(sum(h for r, h in hits if r['noise'] == nz))}/{sum(r['noise'] == nz for r, _ in hits)}"
                          for nz in noises)

    print("| culprit_margin_min | runs with a false alarm | 1.03x found | at noise 2 / 5 / 10 / 15% | 1.05x found "
          "| at noise 2 / 5 / 10 / 15% |")
    print("|---|---|---|---|---|---|")
    for bar in sorted(set(BARS) | {in_use}):
        judged = [(r, *judge(r, bar)) for r in runs]
        fa = sum(f for _, f, _ in judged)
        s3 = [(r, float(hit)) for r, _, hit in judged if r["kind"] == "slow3"]
        s5 = [(r, float(hit)) for r, _, hit in judged if r["kind"] == "slow5"]
        mark = " (in use)" if bar == in_use else ""
        print(f"| {bar}{mark} | {fa}/{len(runs)} ({fa / len(runs):.1%}) | {_fmt(sum(h for _, h in s3))}/{len(s3)} | "
              f"{by_noise(s3)} | {_fmt(sum(h for _, h in s5))}/{len(s5)} | {by_noise(s5)} |")
    s3 = [(r, oracle_power(r, 1.03)) for r in runs if r["kind"] == "slow3"]
    s5 = [(r, oracle_power(r, 1.05)) for r in runs if r["kind"] == "slow5"]
    print(f"| a detector that knew the noise (expected) | 1% by design | {_fmt(sum(h for _, h in s3))}/{len(s3)} | "
          f"{by_noise(s3)} | {_fmt(sum(h for _, h in s5))}/{len(s5)} | {by_noise(s5)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
