"""Ingest the same Kineto traces into a DuckDB store, into a Parquet dataset here, and into a dataset
on Ray (local mode); check that the three hold the same rows; print wall, peak memory and CPU.

    python benchmarks/ingest_ray.py                   # 16 ranks of benchmarks/ingest_vs_hta.py's traces
    python benchmarks/ingest_ray.py --ranks 64        # its 64-rank set (3.9 GB of JSON)
    python benchmarks/ingest_ray.py --repeats 3       # alternating runs, medians (this VM drifts)

The traces are ingest_vs_hta.py's (benchmarks/gen_traces.py, cached under benchmarks/_work/). Each
engine runs the real CLI in a subprocess (interpreter start, imports and, for Ray, starting Ray
on this machine all count), after a read of every trace (page cache warm for each):

- ``duckdb``: ``tracekit ingest DIR --store S.duckdb`` (the local ingest);
- ``dataset``: ``tracekit ingest DIR --out DS`` (threads here, Parquet parts);
- ``ray``: ``tracekit ingest DIR --out DS --engine ray`` (one Ray task per trace, ``ray.init()``
  on this machine with one CPU per core);
- ``ray start``: Ray started and stopped on this machine and nothing else, the fixed part of ``ray``.

Same rows: for every table of tracekit.schema, the DuckDB store's rows and each dataset's rows
(read with DuckDB's read_parquet) differ by nothing in either direction (``EXCEPT ALL``, so
duplicates count), ingest times aside. Memory is the peak summed PSS of the command's process tree
(Ray's own daemons included while they are its children); CPU is user + system of the processes
the command waited for, which misses Ray's daemons: compare Ray's wall, not its CPU.
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
sys.path.insert(0, str(ROOT))
from gen_traces import generate  # noqa: E402
from ingest_vs_hta import WORK, measure, warm  # noqa: E402

VOLATILE = {"ingested_at", "seconds"}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--events", type=int, default=240_000, help="events per rank (~250 bytes each)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--gen-jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-check", action="store_true", help="skip the row-by-row comparison (minutes at 64 ranks)")
    a = ap.parse_args()
    traces = generate(WORK / f"traces-{a.ranks}x{a.events}", a.ranks, a.events, a.gen_jobs)
    mb = sum(p.stat().st_size for p in traces) / 1e6
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cli = [sys.executable, "-c", "from tracekit.cli import main; main()", "ingest", str(traces[0].parent)]
    results: dict[str, list[tuple[float, float, float]]] = {"duckdb": [], "dataset": [], "ray": [], "ray start": []}
    # what --engine ray pays before any file: Ray started and stopped on this machine, nothing else
    ray_start = [sys.executable, "-c", "import ray; ray.init(logging_level='ERROR', log_to_driver=False); "
                 "ray.shutdown()"]
    mismatches: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        for rep in range(a.repeats):
            outs = {"duckdb": Path(tmp) / f"s{rep}.duckdb", "dataset": Path(tmp) / f"ds{rep}",
                    "ray": Path(tmp) / f"ray{rep}"}
            cmds = {"duckdb": cli + ["--store", str(outs["duckdb"]), "--workers", str(a.workers), "--json"],
                    "dataset": cli + ["--out", str(outs["dataset"]), "--workers", str(a.workers), "--json"],
                    "ray": cli + ["--out", str(outs["ray"]), "--engine", "ray", "--json"]}
            cmds["ray start"] = ray_start
            order = list(cmds) if rep % 2 == 0 else list(reversed(cmds))
            for name in order:
                warm(traces)
                wall, peak, cpu, _ = measure(cmds[name], env)
                results[name].append((wall, peak, cpu))
                print(f"  {name:8s} run {rep + 1}: {wall:6.1f} s wall, {peak:6.0f} MB, {cpu:6.1f} CPU-s "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
            for name in ("dataset", "ray"):
                mismatches[name] = ["not checked"] if a.no_check else same_rows(outs["duckdb"], outs[name])
            for name in ("dataset", "ray"):  # free the disk for the next repeat
                import shutil

                shutil.rmtree(outs[name], ignore_errors=True)
            outs["duckdb"].unlink(missing_ok=True)
    base = statistics.median(w for w, _, _ in results["duckdb"])
    print(f"\n{a.ranks} ranks x {a.events:,} events, {mb:,.0f} MB of JSON, {a.workers} workers, "
          f"{os.cpu_count()} cores, {a.repeats} run(s) each (medians)\n")
    print(f"| engine | wall s | vs duckdb | peak MB | CPU-s | MB/s | same rows as duckdb |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        wall = statistics.median(w for w, _, _ in runs)
        peak = statistics.median(p for _, p, _ in runs)
        cpu = statistics.median(c for _, _, c in runs)
        same = "-" if name not in mismatches else "not checked" if a.no_check else \
            ("yes" if not mismatches[name] else "NO: " + ", ".join(mismatches[name]))
        print(f"| {name} | {wall:.1f} | {wall / base:.2f}x | {peak:,.0f} | {cpu:.1f} | {mb / wall:,.0f} | {same} |")


if __name__ == "__main__":
    main()
