"""Ingest the same Kineto traces into a DuckDB store, into a Parquet dataset here, and into a dataset
on Ray, started cold by the command or already running; check that they hold the same rows; print
wall, peak memory and CPU.

    python benchmarks/ingest_ray.py                   # 16 ranks of benchmarks/ingest_vs_hta.py's traces
    python benchmarks/ingest_ray.py --ranks 64        # its 64-rank set (3.9 GB of JSON)
    python benchmarks/ingest_ray.py --repeats 3       # alternating runs, medians (this VM drifts)

The traces are ingest_vs_hta.py's (benchmarks/gen_traces.py, cached under benchmarks/_work/). Each
engine runs the real CLI in a subprocess (interpreter start, imports and, for Ray, reaching or
starting Ray all count), after a read of every trace (page cache warm for each):

- ``local``: ``tracekit ingest DIR --store S.duckdb`` (the local ingest, the baseline);
- ``dataset``: ``tracekit ingest DIR --out DS`` (threads here, Parquet parts);
- ``ray cold``: ``tracekit ingest DIR --out DS --engine ray``: the command starts Ray on this
  machine (``ray.init()``, one CPU per core, workers at its own priority) and stops it;
- ``ray cluster``: ``tracekit ingest DIR --out DS --engine ray --address HOST:PORT`` against a Ray
  cluster on this machine that the benchmark starts before the timing (``ray start --head --block
  --num-cpus <workers>``, in its own temporary folder so that no other ``ray.init()`` on the machine
  finds it; 2 s to settle; workers at niceness 0 as ``ray cold``'s, or ``--cluster-niceness``) and
  stops after it (SIGTERM to that ``ray start``, which stops its own
  processes: never ``ray stop``, which stops every Ray on the machine). Up only around its own
  runs, so that its idle daemons take nothing from the other engines'. A team that runs Ray has
  its cluster up: this is the issue's "local mode" for them;
- ``ray start``: Ray started and stopped on this machine and nothing else, the fixed part of
  ``ray cold``.

Same rows: for every table of tracekit.schema, the DuckDB store's rows and each dataset's rows
(read with DuckDB's read_parquet) differ by nothing in either direction (``EXCEPT ALL``, so
duplicates count), ingest times aside. Memory is the peak summed PSS of the command's process tree
(Ray's own daemons included while they are its children: in ``ray cold``, not in ``ray cluster``);
CPU is user + system of the processes the command waited for, which misses Ray's workers and
daemons: compare Ray's wall, not its CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from gen_traces import generate  # noqa: E402
from ingest_vs_hta import WORK, measure, warm  # noqa: E402

VOLATILE = {"ingested_at", "seconds"}
ENGINES = ("local", "dataset", "ray cold", "ray cluster", "ray start")
OUTPUTS = {"dataset": "ds", "ray cold": "raycold", "ray cluster": "raycluster"}  # engines writing a dataset


def same_rows(store: Path, ds: Path) -> list[str]:
    """Tables whose rows differ between the store and the dataset (empty: all the same)."""
    import duckdb

    from tracekit import dataset, schema

    con = duckdb.connect()
    con.execute(f"ATTACH '{store}' AS s (READ_ONLY)")
    bad = []
    for t in schema.TABLES:
        cols = ", ".join(f'"{c}"' for c in schema.columns(t) if c not in VOLATILE)
        mine = f"SELECT {cols} FROM ({dataset.table_sql(ds, t)})"
        ref = f"SELECT {cols} FROM s.{t}"
        diff = con.execute(f"SELECT (SELECT count(*) FROM ({ref} EXCEPT ALL {mine})) + "
                           f"(SELECT count(*) FROM ({mine} EXCEPT ALL {ref}))").fetchall()[0][0]
        if diff:
            bad.append(f"{t} ({diff} rows differ)")
    con.close()
    return bad


class RayCluster:
    """A Ray head on this machine for the benchmark's runs: ``ray start --head --block`` in its own
    temporary folder (so no other ``ray.init()`` here finds it); stopped by SIGTERM to that one
    process, which takes its node's processes down with it."""

    def __init__(self, cpus: int, env: dict, niceness: int) -> None:
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.tmp = tempfile.mkdtemp(prefix="tkray-", dir="/tmp")  # Ray's socket paths must stay short
        self.log = open(os.path.join(self.tmp, "start.log"), "w+")
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        self.proc = subprocess.Popen([ray, "start", "--head", "--block", f"--num-cpus={cpus}",
                                      "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.tmp}",
                                      f"--port={port}", "--node-ip-address=127.0.0.1",
                                      "--system-config=" + json.dumps({"worker_niceness": niceness})],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"ray start exited with {self.proc.returncode}; see {self.log.name}")
            self.log.seek(0)
            if "block forever" in self.log.read():
                return
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"ray start did not come up in 120 s; see {self.log.name}")

    def stop(self) -> None:
        import shutil
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--events", type=int, default=240_000, help="events per rank (~250 bytes each)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--gen-jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-check", action="store_true", help="skip the row-by-row comparison (minutes at 64 ranks)")
    ap.add_argument("--cluster-niceness", type=int, default=0,
                    help="the cluster's worker_niceness: 0, as the engine's own start gives its workers; Ray's "
                         "default is 15, under which every other process on a shared machine goes first")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    a = ap.parse_args()
    traces = generate(WORK / f"traces-{a.ranks}x{a.events}", a.ranks, a.events, a.gen_jobs)
    mb = sum(p.stat().st_size for p in traces) / 1e6
    # RAY_AUTH_MODE: the benchmark's own cluster is reached by address, where Ray >= 2.5x would
    # otherwise ask for the token that its `ray start` made
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "RAY_AUTH_MODE": "disabled"}
    cli = [sys.executable, "-c", "from tracekit.cli import main; main()", "ingest", str(traces[0].parent)]
    engines = [e for e in ENGINES if e in a.engines or e == "local"]
    results: dict[str, list[tuple[float, float, float]]] = {e: [] for e in engines}
    # what --engine ray pays before any file: Ray started and stopped on this machine, nothing else
    ray_start = [sys.executable, "-c", "import ray; from tracekit.ingest.on_ray import ray_init_args; "
                 "ray.init(**ray_init_args(None, None)); ray.shutdown()"]
    mismatches: dict[str, list[list[str]]] = {e: [] for e in engines if e in OUTPUTS}
    # The cluster is up only around its own runs (started and settled before the timing, stopped
    # after it), so that its idle daemons take nothing from the other engines' runs.
    cluster: RayCluster | None = None
    try:
        with tempfile.TemporaryDirectory(dir=WORK) as tmp:
            for rep in range(a.repeats):
                outs = {e: Path(tmp) / f"{OUTPUTS.get(e, e)}{rep}" for e in ENGINES}
                outs["local"] = Path(tmp) / f"s{rep}.duckdb"
                cmds = {"local": cli + ["--store", str(outs["local"]), "--workers", str(a.workers), "--json"],
                        "dataset": cli + ["--out", str(outs["dataset"]), "--workers", str(a.workers), "--json"],
                        "ray cold": cli + ["--out", str(outs["ray cold"]), "--engine", "ray", "--json"],
                        "ray cluster": cli + ["--out", str(outs["ray cluster"]), "--engine", "ray", "--json"],
                        "ray start": ray_start}
                order = engines if rep % 2 == 0 else list(reversed(engines))
                for name in order:
                    cmd = cmds[name]
                    if name == "ray cluster":
                        cluster = RayCluster(a.workers, env, a.cluster_niceness)
                        cmd = cmd[:-1] + ["--address", cluster.address, "--json"]
                        time.sleep(2)  # its start settles, as on a cluster that has been up a while
                    warm(traces)
                    load = os.getloadavg()[0]
                    wall, peak, cpu, _ = measure(cmd, env)
                    if cluster is not None:
                        cluster.stop()
                        cluster = None
                    results[name].append((wall, peak, cpu))
                    print(f"  {name:11s} run {rep + 1}: {wall:6.1f} s wall, {peak:6.0f} MB, {cpu:6.1f} CPU-s "
                          f"(load {load:.1f} before, {os.getloadavg()[0]:.1f} after)", file=sys.stderr, flush=True)
                for name in mismatches:
                    mismatches[name].append(["not checked"] if a.no_check else same_rows(outs["local"], outs[name]))
                import shutil

                for name in mismatches:  # free the disk for the next repeat
                    shutil.rmtree(outs[name], ignore_errors=True)
                outs["local"].unlink(missing_ok=True)
    finally:
        if cluster is not None:
            cluster.stop()
    base = statistics.median(w for w, _, _ in results["local"])
    print(f"\n{a.ranks} ranks x {a.events:,} events, {mb:,.0f} MB of JSON, {a.workers} workers, "
          f"{os.cpu_count()} cores, {a.repeats} run(s) each (medians; per-run walls in brackets)\n")
    print("| engine | wall s | vs local | per-run ratio | peak MB | CPU-s | MB/s | same rows as local |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        wall = statistics.median(w for w, _, _ in runs)
        peak = statistics.median(p for _, p, _ in runs)
        cpu = statistics.median(c for _, _, c in runs)
        ratios = ", ".join(f"{w / b:.2f}x" for (w, _, _), (b, _, _) in zip(runs, results["local"]))
        if name not in mismatches:
            same = "-"
        elif a.no_check:
            same = "not checked"
        else:
            bad = sorted({m for rep in mismatches[name] for m in rep})
            same = "yes" if not bad else "NO: " + ", ".join(bad)
        walls = ", ".join(f"{w:.1f}" for w, _, _ in runs)
        print(f"| {name} | {wall:.1f} ({walls}) | {wall / base:.2f}x | {ratios} | {peak:,.0f} | {cpu:.1f} | "
              f"{mb / wall:,.0f} | {same} |")


if __name__ == "__main__":
    main()
