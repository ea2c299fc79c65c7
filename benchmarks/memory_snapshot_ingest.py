"""Ingesting a large CUDA memory snapshot: tracekit's streaming reader against torch's own
``torch.cuda._memory_viz`` (which ``pickle.load``s the whole snapshot), in one run.

The snapshot has the object layout of ``torch.cuda.memory._snapshot()`` (tests/cuda_snapshot.py:
shared key strings, frames symbolized once and shared, one frames list per allocation reused by its
free_completed and its block) and is written by ``pickle.dump`` as ``_dump_snapshot`` writes it.
It is cached under benchmarks/_work/. Each contender runs in its own process, which reports its
own wall time, CPU time and peak RSS (``VmHWM``: ``ru_maxrss`` would carry the parent's RSS over
the fork):

- tracekit parse: the streaming parse into Arrow tables (memory_events, memory_segments, memory_blocks);
- tracekit ingest: the same file through ``tracekit.ingest`` into a DuckDB store;
- tracekit memory analysis: the per-rank peak and live-at-peak over that store (``tracekit memory``'s
  work), checked against the generator's peak;
- pickle.load: the snapshot as Python objects (its in-memory size: RSS after minus before);
- memory_viz stats / trace_plot: ``python -m torch.cuda._memory_viz stats|trace_plot FILE``.

    PYTHONPATH=$PWD python benchmarks/memory_snapshot_ingest.py --entries 1600000
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "_work"

CHILD = r'''
import json, os, sys, time
def status_mb(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) / 1024
def rss_mb():
    return status_mb("VmRSS")
what, path, tmp = sys.argv[1], sys.argv[2], sys.argv[3]
import numpy, polars, pyarrow  # loaded (and first used) outside the measurement: a fixed cost
pyarrow.array(numpy.arange(3)), polars.DataFrame({"a": [1]}).sum()
before = rss_mb()
t0, c0 = time.perf_counter(), time.process_time()
extra = {}
if what == "parse":
    from pathlib import Path
    from tracekit.ingest.memory_snapshot import parse
    parsed = parse(Path(path))
    extra["rows"] = parsed.tables["memory_events"].num_rows
elif what == "ingest":
    from pathlib import Path
    from tracekit.ingest.pipeline import ingest
    rep = ingest([path], Path(tmp) / "s.duckdb", run_id="big")
    assert not rep.failed, rep.failed[0].error
    extra["stored_rows"] = rep.ok[0].rows  # memory_events + segments + blocks
    import shutil
    shutil.copy(Path(tmp) / "s.duckdb", path + ".duckdb")  # for the analysis contender
elif what == "analyse":
    from pathlib import Path
    from tracekit.analysis.memory_tables import load_tables
    from tracekit.analysis.memory import analyse
    run_id, tables, _, _ = load_tables(Path(path + ".duckdb"), None)
    res = analyse(tables["memory_events"], tables.get("memory_segments"), blocks=tables.get("memory_blocks"))
    live = res.live_at_peak("category")
    extra["peak"] = int(res.peaks["peak_allocated"][0])
    extra["rows"] = tables["memory_events"].height
elif what == "load":
    import pickle
    with open(path, "rb") as f:
        snap = pickle.load(f)
    extra["rows"] = len(snap["device_traces"][0])
    extra["object_mb"] = rss_mb() - before
else:
    import runpy
    sys.argv = ["_memory_viz", what, path] + (["-o", os.path.join(tmp, "out.html")] if what == "trace_plot" else [])
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        runpy.run_module("torch.cuda._memory_viz", run_name="__main__")
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                  "peak_rss_mb": status_mb("VmHWM"),
                  "base_rss_mb": before, **extra}))
'''


def snapshot_file(entries: int, seed: int) -> tuple[Path, dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from cuda_snapshot import cuda_snapshot

    path = WORK / f"cuda_snapshot_{entries}_{seed}.pickle"
    meta = path.with_suffix(".json")
    if not path.exists() or not meta.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        print(f"generating a snapshot of {entries:,} trace entries ...", flush=True)
        snap, truth = cuda_snapshot(entries, seed=seed)
        with open(path, "wb") as f:
            pickle.dump(snap, f)  # as torch.cuda.memory._dump_snapshot: the default protocol
        meta.write_text(json.dumps(truth))
        del snap
    return path, json.loads(meta.read_text())


def run(what: str, path: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", CHILD, what, str(path), tmp], capture_output=True,
                             text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_600_000, help="trace entries (1.6M: about 300 MB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", nargs="*", default=[], help="contenders to leave out (e.g. trace_plot)")
    args = ap.parse_args()
    path, truth = snapshot_file(args.entries, args.seed)
    size_mb = path.stat().st_size / 2**20
    print(f"snapshot {path.name}: {size_mb:.0f} MB, {truth['entries']:,} trace entries; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    rows = {}
    for what in ("parse", "ingest", "analyse", "load", "stats", "trace_plot"):
        if what in args.skip:
            continue
        print(f"  running {what} ...", flush=True)
        rows[what] = r = run(what, path)
        if what == "analyse":
            assert r["peak"] == truth["peak"], (r["peak"], truth["peak"])
        if "rows" in r and what != "ingest":
            assert r["rows"] == truth["entries"], (what, r["rows"])
    Path(str(path) + ".duckdb").unlink(missing_ok=True)
    ours = rows.get("parse")
    names = {"parse": "tracekit parse (streamed)", "ingest": "tracekit ingest (parse + DuckDB)",
             "analyse": "tracekit memory analysis (store)",
             "load": "pickle.load (the object graph)", "stats": "torch _memory_viz stats",
             "trace_plot": "torch _memory_viz trace_plot"}
    print(f"\n{'':34s} {'wall s':>8s} {'CPU s':>8s} {'peak RSS MB':>12s} {'RSS vs parse':>13s}")
    for what, r in rows.items():
        ratio = f"{r['peak_rss_mb'] / ours['peak_rss_mb']:.1f}x" if ours else "-"
        print(f"{names[what]:34s} {r['wall_s']:8.1f} {r['cpu_s']:8.1f} {r['peak_rss_mb']:12.0f} {ratio:>13s}")
    if "load" in rows:
        print(f"\nthe pickle as Python objects: {rows['load']['object_mb']:.0f} MB "
              f"({rows['load']['object_mb'] / size_mb:.1f}x the file); process base RSS "
              f"{rows['load']['base_rss_mb']:.0f} MB")
    if ours and "load" in rows:
        print(f"tracekit parse peak RSS above its base: {ours['peak_rss_mb'] - ours['base_rss_mb']:.0f} MB "
              f"= {(ours['peak_rss_mb'] - ours['base_rss_mb']) / rows['load']['object_mb']:.2f}x the object graph")
    print(f"load average now {os.getloadavg()[0]:.1f}; this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
