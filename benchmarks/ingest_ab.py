"""`tracekit ingest` of the same inputs by two (or more) checkouts, alternating, for CPU time.

    python benchmarks/ingest_ab.py --trees /tmp/tracekit-before,. --rounds 8 benchmarks/_work/sim-profiler-64x40

Each round runs the real CLI (``python -P -c 'from tracekit.cli import main; main()' ingest PATH
--store S``, a new store each time) once per checkout, with PYTHONPATH set to that checkout, in
turn, the order reversed every other round so that neither side always runs first. A checkout may
carry environment variables after a ``|``: ``.|MALLOC_ARENA_MAX=2;OTHER=1``. Reported per run: user
and system CPU seconds of the command and everything it waited for (``os.wait4``), wall time, the
1-minute load average, peak RSS and minor page faults; then the medians per checkout. CPU time is
what a shared machine moves least; compare medians of several rounds, never single runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(tree: str, path: Path) -> tuple[float, float, float, float, int]:
    """(user+sys CPU s, wall s, user s, peak RSS MB, minor faults) of one ingest."""
    root, _, extra = tree.partition("|")
    env = {**os.environ, "PYTHONPATH": str(Path(root).resolve()),
           **dict(kv.split("=", 1) for kv in extra.split(";") if kv)}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-P", "-c", "from tracekit.cli import main; main()", "ingest", str(path.resolve()),
               "--store", str(Path(tmp) / "s.duckdb"), "--json"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tmp)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        err = proc.stderr.read().decode() if proc.stderr else ""
    if status != 0:
        raise SystemExit(f"{tree}: ingest of {path} failed:\n{err[-2000:]}")
    return ru.ru_utime + ru.ru_stime, wall, ru.ru_utime, ru.ru_maxrss / 1024, ru.ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", required=True, help="checkouts, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("path", type=Path)
    a = ap.parse_args()
    trees = a.trees.split(",")
    got: dict[str, list[tuple]] = {t: [] for t in trees}
    print("| round | checkout | CPU s | user s | wall s | load | peak MB | minor faults |\n|---|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        for t in trees if r % 2 == 0 else trees[::-1]:
            load = os.getloadavg()[0]
            cpu, wall, user, rss, flt = run(t, a.path)
            got[t].append((cpu, wall, user))
            print(f"| {r} | {t} | {cpu:.2f} | {user:.2f} | {wall:.2f} | {load:.1f} | {rss:.0f} | {flt:,} |", flush=True)
    print("\n| checkout | median CPU s | median user s | median wall s | runs |\n|---|---|---|---|---|")
    for t, v in got.items():
        print(f"| {t} | {statistics.median(x[0] for x in v):.3f} | {statistics.median(x[2] for x in v):.3f} | "
              f"{statistics.median(x[1] for x in v):.2f} | {len(v)} |")


if __name__ == "__main__":
    main()
