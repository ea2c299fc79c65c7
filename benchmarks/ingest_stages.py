"""Where ingest's CPU goes, stage by stage, on one of the benchmark's trace sets.

    python benchmarks/ingest_stages.py --set gen --ranks 64          # ingest_vs_hta.py's set
    python benchmarks/ingest_stages.py --set sim-profiler --ranks 64 # benchmarks/trace_sets.py's

Part 1, per file (``time.thread_time`` of one thread, averaged over the first ``--files`` traces
after a warm-up parse, each stage run on its own and the next one including it): the read, the decompression and split of the
``traceEvents`` array (jsonsplit), the native scanner into Arrow batches, the batches reduced to the
store's columns (kineto_rows' ``add``), the steps and final tables (``build``), the communication
tables and groups (kineto_comm, on the built rows), and the whole parse.

Part 2, the real ingest in this process (``tracekit.ingest.pipeline.ingest`` of the whole set with
``--workers`` threads into a fresh store): the thread CPU of the parse and of the commits (DuckDB's
insert and commit), the run's topology and the closing checkpoint, against the wall time and the
process's CPU (imports not included). Process CPU / wall is how many of the cores were busy.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from gen_traces import generate  # noqa: E402
from trace_sets import KINDS, WORK, build  # noqa: E402


class _Null:
    def write(self, data: bytes) -> int:
        return len(data)


def per_file(paths: list[Path]) -> dict[str, float]:
    import duckdb

    from tracekit.ingest import jsonsplit, kineto, kineto_rows
    from tracekit.ingest import parse as parse_mod

    con = duckdb.connect()
    con.execute("SET threads = 1")
    clock = time.thread_time
    spent: dict[str, float] = {}

    def stage(name: str, fn):  # noqa: ANN001, ANN202
        t = clock()
        out = fn()
        spent[name] = spent.get(name, 0.0) + clock() - t
        return out

    def read(p: Path) -> None:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass

    parse_mod.run(paths[0], True, frozenset(), con)  # warm-up: lazy imports and first-call costs untimed
    for p in paths:
        stage("read the file", lambda: read(p))
        stage("+ hash, inflate, split the array", lambda: jsonsplit.stream_events(p, _Null(), parse_mod.new_hasher()))
        stage("+ scan into Arrow batches", lambda: kineto.read_events(con, p, parse_mod.new_hasher(), lambda b: None))
        rows = kineto_rows.EventRows(con, str(p))
        stage("+ batches to the store's columns", lambda: kineto.read_events(con, p, parse_mod.new_hasher(), rows.add))
        built = stage("steps, step of each event (build)", rows.build)
        stage("communication tables and groups (kineto_comm)", lambda: comm_tables(con, p, built))
        stage("whole parse (parse.run)", lambda: parse_mod.run(p, True, frozenset(), con))
    return {k: v / len(paths) for k, v in spent.items()}


def comm_tables(con, path: Path, built) -> None:  # noqa: ANN001
    from tracekit.ingest import kineto_comm

    ev = kineto_comm.CommEvents(built.comm, con, path)
    first = built.steps[0].start_ns if built.steps else None
    kineto_comm.tables(ev, 0, first, built.comm_annotations)
    kineto_comm.groups(ev, built.comm_annotations, {}, path)


def _sched() -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of the calling thread, from
    /proc (Linux); (thread CPU, 0) elsewhere."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on, waiting = f.read().split()[:2]
        return int(on) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0


def whole(paths: list[Path], workers: int) -> tuple[float, float, dict[str, list[float]], dict[str, float]]:
    """Wall, process CPU, per part [on a core, waiting for a core, wall, calls], and when (seconds
    from the start) the first parse began and the last parse and commit ended."""
    from tracekit.ingest import parse as parse_mod
    from tracekit.ingest import pipeline, topo

    spent: dict[str, list[float]] = {}
    marks: dict[str, float] = {}
    lock = threading.Lock()
    w0 = time.perf_counter()

    def timed(mod, name: str, label: str) -> None:  # noqa: ANN001
        fn = getattr(mod, name)

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            (on, waiting), w = _sched(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                (on1, waiting1), w1 = _sched(), time.perf_counter()
                with lock:
                    s = spent.setdefault(label, [0.0, 0.0, 0.0, 0])
                    s[0] += on1 - on
                    s[1] += waiting1 - waiting
                    s[2] += w1 - w
                    s[3] += 1
                    marks.setdefault(f"{label} first", w - w0)
                    marks[f"{label} last"] = w1 - w0

        setattr(mod, name, wrapper)

    timed(parse_mod, "run", "parse (all files)")
    timed(pipeline, "_commit_batch", "commits (DuckDB insert + commit)")
    timed(topo, "finalize", "the run's topology")
    timed(pipeline, "_close", "closing checkpoint")
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        w0, c0 = time.perf_counter(), time.process_time()
        rep = pipeline.ingest([paths[0].parent], Path(tmp) / "s.duckdb", workers=workers)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if rep.failed:
        raise SystemExit(f"ingest failed: {rep.failed[0].error}")
    return wall, cpu, spent, marks


def raw_bytes(p: Path) -> int:
    if p.name.endswith(".gz"):
        with open(p, "rb") as f:
            f.seek(-4, os.SEEK_END)
            return int.from_bytes(f.read(4), "little")
    return p.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", dest="kind", choices=("gen",) + KINDS, default="gen")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--events", type=int, default=240_000, help="gen: events per rank")
    ap.add_argument("--steps", type=int, default=40, help="sim-*: steps")
    ap.add_argument("--files", type=int, default=8, help="files timed stage by stage")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    from tracekit.cli import PROCESS_DEFAULTS

    for k, v in PROCESS_DEFAULTS.items():  # as the CLI sets them, before pyarrow loads
        os.environ.setdefault(k, v)
    paths = generate(WORK / f"traces-{a.ranks}x{a.events}", a.ranks, a.events) if a.kind == "gen" \
        else build(a.kind, a.ranks, a.steps)
    sample = paths[:a.files]
    mb = sum(raw_bytes(p) for p in sample) / len(sample) / 1e6
    print(f"set {a.kind}, {len(paths)} files, {mb:.1f} MB of JSON per file; load {os.getloadavg()[0]:.1f}\n")
    print("| stage, per file (one thread) | CPU ms | MB/CPU-s |\n|---|---|---|")
    for name, s in per_file(sample).items():
        print(f"| {name} | {s * 1000:.1f} | {mb / s if s else float('inf'):,.0f} |")
    load = os.getloadavg()[0]
    wall, cpu, spent, marks = whole(paths, a.workers)
    total = sum(raw_bytes(p) for p in paths) / 1e6
    print(f"\ningest of all {len(paths)} files in this process, {a.workers} workers: wall {wall:.2f} s, "
          f"process CPU {cpu:.2f} s ({cpu / wall:.2f} cores busy), {total / wall:,.0f} MB/s; "
          f"load {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("Where the threads were (from /proc/self/task/*/schedstat): on a core; runnable but waiting "
          "for one (the machine's other work, or more of our threads than cores); blocked (the GIL, "
          "DuckDB's locks, I/O: our own idle).\n")
    print("| part | thread CPU s (on a core) | waiting for a core s | blocked s | share of process CPU | calls |")
    print("|---|---|---|---|---|---|")
    for name, (on, waiting, w, n) in spent.items():
        print(f"| {name} | {on:.2f} | {waiting:.2f} | {max(0.0, w - on - waiting):.2f} | {on / cpu:.0%} | {int(n)} |")
    parse, commits = "parse (all files)", "commits (DuckDB insert + commit)"
    print(f"\nfirst parse began at {marks[parse + ' first']:.2f} s; last parse ended at {marks[parse + ' last']:.2f} s, "
          f"last commit at {marks[commits + ' last']:.2f} s, the ingest at {wall:.2f} s")


if __name__ == "__main__":
    main()
