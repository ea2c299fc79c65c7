"""How long ``ray.init`` takes to start Ray on this machine with tracekit's arguments
(tracekit.ingest.on_ray.ray_init_args) and with variations of them, and how much CPU Ray's own
processes spend starting: each variant in a fresh interpreter, alternating, medians.

    python benchmarks/ray_start.py [--repeats 3]

Prints per variant: the wall of ``ray.init`` (import excluded), of ``ray.shutdown``, and the CPU
seconds of the processes Ray started (GCS, raylet, agents, workers) up to the shutdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "tracekit's (no dashboard, niceness 0)": ({}, {}),
    "Ray's defaults (dashboard per Ray)": ({"include_dashboard": None}, {}),
    "+ object store 80 MB": ({"object_store_memory": 80 << 20}, {}),
    "+ usage stats and metrics off": ({"_metrics_export_port": None},
                                      {"RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_metrics_collection": "0"}),
    "+ no prestarted workers": ({"_system_config": {"worker_niceness": 0, "prestart_worker_first_driver": False,
                                                    "enable_worker_prestart": False}}, {}),
}

CHILD = """
import json, os, sys, time
import ray
from tracekit.ingest.on_ray import ray_init_args
args = {**ray_init_args(None, None), **json.loads(sys.argv[1])}
args = {k: v for k, v in args.items() if v is not None or k == "include_dashboard"}
if args.get("include_dashboard", 0) is None:
    del args["include_dashboard"]
t0 = time.perf_counter()
ray.init(**args)
t1 = time.perf_counter()
stats = {}
for d in os.listdir("/proc"):
    try:
        f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        stats[int(d)] = (int(f[1]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError):
        pass
mine, cpu = {os.getpid()}, 0.0
for _ in range(6):  # descendants, a generation at a time
    for pid, (ppid, c) in stats.items():
        if ppid in mine and pid not in mine:
            mine.add(pid)
            cpu += c
t2 = time.perf_counter()
ray.shutdown()
t3 = time.perf_counter()
print(json.dumps({"init": t1 - t0, "shutdown": t3 - t2, "ray_cpu": cpu}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    loads = []
    for rep in range(a.repeats):
        order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            kwargs, env = VARIANTS[name]
            e = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            e.pop("RAY_ADDRESS", None)
            loads.append(os.getloadavg()[0])
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs)], env=e, capture_output=True,
                                 text=True, timeout=300)
            if out.returncode != 0:
                print(f"{name}: failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {name} run {rep + 1}: {runs[name][-1]}", file=sys.stderr, flush=True)
    print(f"\nray.init on this machine ({os.cpu_count()} cores), {a.repeats} run(s) each, medians "
          f"(runs in brackets); 1-minute load {min(loads):.1f}-{max(loads):.1f}\n")
    print("| variant | ray.init s | ray.shutdown s | Ray's processes' CPU-s to the shutdown |")
    print("|---|---|---|---|")
    for name, rs in runs.items():
        if not rs:
            print(f"| {name} | failed | | |")
            continue
        cols = []
        for key in ("init", "shutdown", "ray_cpu"):
            vals = [r[key] for r in rs]
            cols.append(f"{statistics.median(vals):.2f} ({', '.join(f'{v:.1f}' for v in vals)})")
        print(f"| {name} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
