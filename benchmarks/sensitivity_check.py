"""Is "no straggler ... a rank X% slower than its peers would have stood out; 3% needs about N
steps" true? For simulated clean runs (layouts, kernel noise 5-15%, skewed clocks), take the X and N
the answer states, then simulate the same run with one rank X slower, 0.7 X slower, and 3% slower
over N steps, and count how often that rank alone is named. The claim is a 90% power.

    python benchmarks/sensitivity_check.py [--runs 12]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

import tracekit
from tracekit.ingest import ingest
from tracekit.simulate.config import SimConfig
from tracekit.simulate.run import simulate

LAYOUTS = [(2, 1, 2, 2), (1, 2, 1, 8), (4, 1, 2, 2), (1, 1, 4, 2), (2, 2, 2, 2), (8, 1, 1, 2)]


def _diagnose(root: Path, **cfg):
    shutil.rmtree(root, ignore_errors=True)
    run = simulate(SimConfig(**{"layers": 2, "steps": 8, **cfg}), root / "run")
    (run / "manifest.json").unlink()
    ingest([run], root / "s.duckdb", workers=1)
    with tracekit.open(root / "s.duckdb") as s:
        return s.diagnose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=12)
    args = ap.parse_args()
    rng = random.Random(20261126)
    hits: dict[str, list[bool]] = {"at the stated X": [], "at 0.7 X": [], "3% over the stated steps": []}
    print("| run | layout tp cp pp dp | noise | stated X | stated steps for 3% | X | 0.7 X | 3% |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="tk-sens-") as tmp:
        for i in range(args.runs):
            tp, cp, pp, dp = LAYOUTS[i % len(LAYOUTS)]
            base = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "seed": 1000 + i, "noise": rng.choice([0.05, 0.1, 0.15]),
                    "names": rng.choice(["mesh", "plain"]), "skew_ms": rng.choice([0.0, 500.0, 2000.0])}
            clean = _diagnose(Path(tmp) / "c", **base)
            x, n = clean.compute.detectable_ratio, clean.compute.steps_for_sensitivity
            r = rng.randrange(tp * cp * pp * dp)
            row = []
            for key, factor, steps in (("at the stated X", x, 8), ("at 0.7 X", 1 + 0.7 * (x - 1), 8),
                                       ("3% over the stated steps", 1.03, n)):
                if key.startswith("3%") and not (x > 1.03 and n <= 120):
                    row.append("-")
                    continue
                d = _diagnose(Path(tmp) / "s", **{**base, "steps": steps}, faults=(f"slow:rank={r},factor={factor:.4f}",))
                ok = [(f.kind, f.ranks) for f in d.findings] == [("straggler", (r,))]
                hits[key].append(ok)
                row.append("found" if ok else "missed")
            print(f"| {i} | {tp} {cp} {pp} {dp} | {base['noise']:.2f} | {x - 1:.1%} | {n} | " + " | ".join(row) + " |",
                  flush=True)
            print(f"[{i + 1}/{args.runs}]", file=sys.stderr, flush=True)
    print("\n| slowdown | found | share |")
    print("|---|---|---|")
    for key, v in hits.items():
        print(f"| {key} | {sum(v)}/{len(v)} | {sum(v) / max(len(v), 1):.0%} |")


if __name__ == "__main__":
    main()
