"""Does a slow rank's stated cost say how much the step grows? For simulated NCCL jobs (GPU kernel
traces: the what-if replay cannot run there), each faulted run is set against the same run without
the fault (same seed, same noise): the true cost is how much the simulator's own step times grew
(manifest), over the steps the finding names. The stated cost is compared with it, and so is the
rank's extra compute (what every finding stated before, and what is still stated, as "at most",
where no group's waits bound it).

    python benchmarks/cost_accuracy.py [--runs 40] [--seed 7]

Layouts draw each of TP, CP, PP, DP at 1 and above 1; slowdowns 1.1-2x, persistent or in 2 of 8
steps; kernel noise 2-10%, host clock skew to 2 s, DeviceMesh or plain names. Only runs whose lone
finding is the slow rank are scored (the others are counted).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import tracekit
from tracekit.ingest import ingest
from tracekit.simulate.config import SimConfig
from tracekit.simulate.run import simulate

LAYOUTS = [(2, 1, 2, 2), (2, 1, 4, 2), (1, 1, 8, 2), (4, 1, 4, 1), (2, 2, 2, 1), (2, 2, 1, 4), (8, 1, 1, 2),
           (1, 2, 2, 4), (2, 1, 2, 1), (1, 1, 4, 4), (4, 2, 1, 2), (2, 1, 1, 8)]


def _step_ms(run: Path) -> list[float]:
    return json.loads((run / "manifest.json").read_text())["simulated"]["step_ms"]


def _case(rng: random.Random, i: int) -> tuple[dict, int, float, tuple[int, ...] | None]:
    tp, cp, pp, dp = LAYOUTS[i % len(LAYOUTS)]
    cfg = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "seed": 7000 + i, "steps": 8, "layers": 2,
           "noise": rng.choice([0.02, 0.05, 0.1]), "skew_ms": rng.choice([0.0, 500.0, 2000.0]),
           "names": rng.choice(["mesh", "plain"])}
    rank = rng.randrange(tp * cp * pp * dp)
    factor = rng.choice([1.1, 1.2, 1.3, 1.5, 2.0])
    steps = tuple(sorted(rng.sample(range(1, 8), 2))) if rng.random() < 0.25 else None
    return cfg, rank, factor, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows, unscored = [], 0
    print("| run | layout tp cp pp dp | fault | true ms | stated ms | how | extra compute ms |", flush=True)
    print("|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="tk-cost-") as tmp:
        for i in range(args.runs):
            cfg, rank, factor, steps = _case(rng, i)
            spec = f"slow:rank={rank},factor={factor}" + (f",steps={'+'.join(map(str, steps))}" if steps else "")
            root = Path(tmp) / str(i)
            clean = simulate(SimConfig(**cfg), root / "clean")
            slow = simulate(SimConfig(**cfg, faults=(spec,)), root / "slow")
            ingest([slow], root / "s.duckdb", workers=1)
            with tracekit.open(root / "s.duckdb") as s:
                d = s.diagnose()
            lay = f"{cfg['tp']} {cfg['cp']} {cfg['pp']} {cfg['dp']}"
            ranked = [f for f in d.findings if f.ranks == (rank,) and f.kind in ("straggler", "transient")]
            if len(d.findings) != 1 or not ranked:
                unscored += 1
                print(f"| {i} | {lay} | {spec} | - | not scored: {len(d.findings)} findings, "
                      f"{[(f.kind, f.ranks) for f in d.findings]} | | |", flush=True)
                continue
            f = ranked[0]
            over = list(f.steps) if f.kind == "transient" else list(range(len(_step_ms(slow))))
            grew = statistics.mean(_step_ms(slow)[t] - _step_ms(clean)[t] for t in over)
            how = f.evidence.get("cost_from", "?") + (" (at most)" if f.cost_upper_bound else "")
            extra = f.evidence.get("extra_compute_ns", float("nan")) / 1e6
            rows.append((grew, f.cost_ns / 1e6, extra, f.cost_upper_bound, d.localization.step_time_ns / 1e6))
            print(f"| {i} | {lay} | {spec} | {grew:.2f} | {f.cost_ns / 1e6:.2f} | {how} | {extra:.2f} |", flush=True)
    print(f"\n{len(rows)} runs scored, {unscored} not (their findings were not the slow rank alone)\n")
    print("| stated | runs | median stated/true | within 25% or 1% of a step | above the true cost |")
    print("|---|---|---|---|---|")
    for name, pick in (("measured costs", lambda r: not r[3]), ("upper bounds ('at most')", lambda r: r[3])):
        sel = [r for r in rows if pick(r)]
        for label, col in ((f"{name}: stated", 1), (f"{name}: extra compute", 2)):
            if not sel:
                continue
            ratio = statistics.median(r[col] / r[0] for r in sel if r[0] > 0) if any(r[0] > 0 for r in sel) else float("nan")
            near = sum(abs(r[col] - r[0]) <= max(0.25 * abs(r[0]), 0.01 * r[4]) for r in sel)
            above = sum(r[col] >= r[0] for r in sel)
            print(f"| {label} | {len(sel)} | {ratio:.2f} | {near}/{len(sel)} | {above}/{len(sel)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
