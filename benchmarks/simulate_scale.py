"""Wall time and peak memory of the job simulator by world size (issue 24's sizes).

The model alone (``run_model``: every op of every rank on the true clock) at 64 to 16,384 ranks,
and the Kineto + flight-recorder writers where they are meant to be used (up to a few hundred
ranks). Each size runs in a fresh process so that peak RSS is its own.

    PYTHONPATH=$PWD python benchmarks/simulate_scale.py [--steps 20] [--write-up-to 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

LAYOUTS = [(64, dict(tp=8, cp=1, pp=4, dp=2)), (1024, dict(tp=8, cp=2, pp=16, dp=4)),
           (4096, dict(tp=8, cp=2, pp=16, dp=16)), (16384, dict(tp=8, cp=2, pp=16, dp=64))]
WRITE = [(64, dict(tp=8, cp=1, pp=4, dp=2)), (256, dict(tp=8, cp=2, pp=4, dp=4))]

CHILD = """
import json, resource, sys, time, tempfile
from tracekit.simulate import SimConfig, run_model, simulate
kw, steps, write = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
cfg = SimConfig(steps=steps, noise=0.05, spikes=0.0005, skew_ms=2000, faults=("slow:rank=5,factor=1.05",), **kw)
t = time.perf_counter()
if write:
    with tempfile.TemporaryDirectory() as d:
        simulate(cfg, d)
        import os
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
    ops = None
else:
    trace, _ = run_model(cfg)
    ops, size = sum(len(o) for o in trace.ops), None
print(json.dumps({"s": time.perf_counter() - t, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "ops": ops, "bytes": size}))
"""


def run(kw: dict, steps: int, write: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw), str(steps), "1" if write else "0"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--write-up-to", type=int, default=256, help="largest world written as Kineto + FR")
    ap.add_argument("--model-up-to", type=int, default=16384)
    a = ap.parse_args()
    print(f"{'what':<22}{'ranks':>7}{'layout':>22}{'steps':>6}{'wall s':>9}{'peak MB':>9}{'ops / MB out':>14}")
    for n, kw in LAYOUTS:
        if n <= a.model_up_to:
            r = run(kw, a.steps, False)
            lay = "x".join(f"{k}{v}" for k, v in kw.items())
            print(f"{'model (run_model)':<22}{n:>7}{lay:>22}{a.steps:>6}{r['s']:>9.2f}{r['rss_mb']:>9.0f}"
                  f"{r['ops']:>14}")
    for n, kw in WRITE:
        if n <= a.write_up_to:
            r = run(kw, a.steps, True)
            lay = "x".join(f"{k}{v}" for k, v in kw.items())
            print(f"{'kineto + fr (simulate)':<22}{n:>7}{lay:>22}{a.steps:>6}{r['s']:>9.2f}{r['rss_mb']:>9.0f}"
                  f"{r['bytes'] / 2**20:>14.1f}")


if __name__ == "__main__":
    main()
