"""Cold ``--engine ray`` ingest of two checkouts of tracekit, run alternately with the local ingest
(this machine's load moves by 2x within minutes, so only adjacent runs compare).

    git archive <before-commit> | tar -x -C /tmp/before   # plus the built *.so files
    python benchmarks/ingest_ray_ab.py --before /tmp/before --ranks 64 --rounds 5

Each round runs, in alternating order, ``tracekit ingest DIR --store S --workers N`` (local) and
``tracekit ingest DIR --out DS --engine ray`` with this checkout and with ``--before`` (each on
PYTHONPATH; no RAY_ADDRESS, so each command starts its own Ray), after a read of every trace.
The traces are ingest_vs_hta.py's (cached under benchmarks/_work/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gen_traces import generate  # noqa: E402
from ingest_vs_hta import WORK, measure, warm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the other checkout's root")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--events", type=int, default=240_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    traces = generate(WORK / f"traces-{a.ranks}x{a.events}", a.ranks, a.events, os.cpu_count() or 1)
    roots = {"local": ROOT, "ray cold, before": a.before.resolve(), "ray cold, this checkout": ROOT}
    walls: dict[str, list[float]] = {k: [] for k in roots}
    loads = []
    for rnd in range(a.rounds):
        for name in list(roots) if rnd % 2 == 0 else list(reversed(roots)):
            env = {**os.environ, "PYTHONPATH": str(roots[name])}
            env.pop("RAY_ADDRESS", None)
            with tempfile.TemporaryDirectory(dir=WORK) as tmp:
                out = ["--store", f"{tmp}/s.duckdb", "--workers", str(a.workers)] if name == "local" else \
                    ["--out", f"{tmp}/ds", "--engine", "ray"]
                # -P: the working directory's tracekit must not shadow the one on PYTHONPATH
                cmd = [sys.executable, "-P", "-c", "from tracekit.cli import main; main()", "ingest", str(traces[0].parent),
                       *out, "--json"]
                warm(traces)
                loads.append(os.getloadavg()[0])
                wall, _, _, _ = measure(cmd, env)
            walls[name].append(wall)
            print(f"  round {rnd + 1} {name:24s} {wall:6.1f} s (load {loads[-1]:.1f})", file=sys.stderr, flush=True)
    print(f"\n{a.ranks} ranks x {a.events:,} events, {a.rounds} rounds, load {min(loads):.1f}-{max(loads):.1f}\n")
    print("| command | wall s: median (rounds) | vs the round's local |")
    print("|---|---|---|")
    for name, ws in walls.items():
        ratios = ", ".join(f"{w / b:.2f}x" for w, b in zip(ws, walls["local"]))
        print(f"| {name} | {statistics.median(ws):.1f} ({', '.join(f'{w:.1f}' for w in ws)}) | {ratios} |")
    diffs = [x - y for x, y in zip(walls["ray cold, this checkout"], walls["ray cold, before"])]
    print(f"\nthis checkout - before, per round: {', '.join(f'{d:+.1f}' for d in diffs)} s "
          f"(median {statistics.median(diffs):+.1f})")


if __name__ == "__main__":
    main()
