"""Kineto event readers: tracekit's C scanner against maintained JSON libraries, on both layouts.

    PYTHONPATH=$PWD python benchmarks/kineto_alternatives.py                  # 100k events (25 MB)
    PYTHONPATH=$PWD python benchmarks/kineto_alternatives.py --events 200000 --repeats 3

Every reader turns one trace's X events into Arrow record batches with the schema of
``kineto.COLUMNS`` (what kineto_rows takes), starting from the file on disk:

- ``scanner``: ingest's own path (``kineto.read_events``, TRACEKIT_KINETO_READER=native): the array
  streamed through the C scanner in 4 MiB pieces.
- ``duckdb``: the same with TRACEKIT_KINETO_READER=duckdb: the array copied to a temporary file,
  then DuckDB's ``read_json`` (one thread, as an ingest worker's cursor).
- ``msgspec``: ``msgspec.json.decode`` of the whole file into typed Structs (only the needed keys),
  then Arrow columns built from them column by column (numbers in text columns turned into their
  JSON text, as both readers above give them).
- ``simdjson``: pysimdjson's ``Parser.parse`` of the whole file, then the same columns through its
  lazy proxies.

For the two libraries the table also gives the parse alone (``parse only``: the document decoded,
no columns built), a floor for any binding that still has to hand Arrow columns on.

Layouts: ``profiler`` is benchmarks/gen_traces.py's, the profiler's own (an event over several
lines); ``compact`` is the same document re-serialized on one line without spaces. Each reader runs
in its own process, ``--repeats`` times: best CPU seconds (process, all threads) and the peak RSS
above the process's RSS after its imports (``VmHWM``). ``--end-to-end`` also times
``tracekit ingest FILE`` (one worker) with each of the two integrated readers. The two library
readers are checked to give the scanner's rows (names, times, correlation) before timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work"
sys.path.insert(0, str(HERE))
from gen_traces import generate  # noqa: E402

CHILD = r'''
import json, os, sys, time
from tracekit.cli import PROCESS_DEFAULTS
for k, v in PROCESS_DEFAULTS.items():
    os.environ.setdefault(k, v)
reader, path, repeats, check = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "check"
from pathlib import Path
import duckdb, pyarrow as pa
from tracekit.ingest import kineto, kineto_rows, kineto_scan

SCHEMA = kineto_scan.schema(kineto.COLUMNS)
ARGS = [f.name for f in SCHEMA.field("args").type]

def hwm_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024

def text(v):  # a JSON value in a VARCHAR column: strings as they are, anything else as its JSON text
    return v if v is None or isinstance(v, str) else json.dumps(v, separators=(",", ":"))

def batches_from(rows, on_batch):
    """rows: (ph, cat, name, pid, tid, ts, dur, args-dict-or-None) of X events"""
    n = kineto_scan.BATCH_ROWS
    for i in range(0, len(rows), n):
        part = rows[i:i + n]
        cols = list(zip(*part))
        args = [a or {} for a in cols[7]]
        arr = [pa.array([text(v) for v in c], pa.string()) for c in cols[:5]]
        arr += [pa.array(cols[5], pa.float64()), pa.array(cols[6], pa.float64())]
        arr.append(pa.StructArray.from_arrays([pa.array([text(a.get(k)) for a in args], pa.string()) for k in ARGS],
                                              names=ARGS, mask=pa.array([a is None for a in cols[7]])))
        on_batch(pa.RecordBatch.from_arrays(arr, schema=SCHEMA))

if reader == "msgspec":
    import msgspec
    from typing import Any, Optional
    attrs = [k.replace(" ", "_").replace(".", "_") for k in ARGS]
    Args = msgspec.defstruct("Args", [(a, Optional[Any], msgspec.field(default=None, name=k))
                                      for a, k in zip(attrs, ARGS)])
    Event = msgspec.defstruct("Event", [("ph", Optional[str], None), ("cat", Optional[str], None),
                                        ("name", Optional[str], None), ("pid", Optional[Any], None),
                                        ("tid", Optional[Any], None), ("ts", Optional[float], None),
                                        ("dur", Optional[float], None), ("args", Optional[Args], None)])
    Trace = msgspec.defstruct("Trace", [("traceEvents", list[Event])])
    decoder = msgspec.json.Decoder(Trace)

    def parse_only():
        with open(path, "rb") as f:
            return decoder.decode(f.read())

    def read(on_batch):
        xs = [e for e in parse_only().traceEvents if e.ph == "X"]
        n = kineto_scan.BATCH_ROWS
        for i in range(0, len(xs), n):  # column by column over the Structs: no per-event dict
            part = xs[i:i + n]
            args = [e.args for e in part]
            cols = [pa.array([e.ph for e in part], pa.string()), pa.array([e.cat for e in part], pa.string()),
                    pa.array([e.name for e in part], pa.string()), pa.array([text(e.pid) for e in part], pa.string()),
                    pa.array([text(e.tid) for e in part], pa.string()), pa.array([e.ts for e in part], pa.float64()),
                    pa.array([e.dur for e in part], pa.float64()),
                    pa.StructArray.from_arrays(
                        [pa.array([None if x is None else text(getattr(x, at)) for x in args], pa.string())
                         for at in attrs], names=ARGS, mask=pa.array([x is None for x in args]))]
            on_batch(pa.RecordBatch.from_arrays(cols, schema=SCHEMA))
elif reader == "simdjson":
    import simdjson
    parser = simdjson.Parser()

    def parse_only():
        with open(path, "rb") as f:
            return parser.parse(f.read())

    def read(on_batch):
        doc = parse_only()
        rows = []
        for e in doc["traceEvents"]:
            if e.get("ph") != "X":
                continue
            a = e.get("args")
            rows.append((e.get("ph"), e.get("cat"), e.get("name"), e.get("pid"), e.get("tid"), e.get("ts"),
                         e.get("dur"), None if a is None else {k: a.get(k) for k in ARGS}))
        del doc
        batches_from(rows, on_batch)
else:
    os.environ[kineto.READER_ENV] = reader
    con = duckdb.connect()
    con.execute("SET threads = 1")

    def read(on_batch):
        kineto.read_events(con, Path(path), None, on_batch)

    parse_only = None

if check:
    got = []
    read(got.append)
    t = pa.Table.from_batches(got, SCHEMA)
    print(json.dumps({"rows": t.num_rows, "name": t.column("name").to_pylist(), "ts": t.column("ts").to_pylist(),
                      "dur": t.column("dur").to_pylist(),
                      "corr": t.column("args").combine_chunks().field("correlation").to_pylist()}))
    sys.exit(0)
base = hwm_mb()
best = wall = float("inf")
rows = 0
for _ in range(repeats):
    got = [0]
    t0, c0 = time.perf_counter(), time.process_time()
    read(lambda b: got.__setitem__(0, got[0] + b.num_rows))
    best, wall = min(best, time.process_time() - c0), min(wall, time.perf_counter() - t0)
    rows = got[0]
peak = hwm_mb() - base
parse = float("inf")
for _ in range(repeats if parse_only else 0):  # the library's own parse, without building the columns
    c0 = time.process_time()
    doc = parse_only()
    parse = min(parse, time.process_time() - c0)
    del doc
print(json.dumps({"cpu_s": best, "wall_s": wall, "rows": rows, "peak_mb": peak,
                  "parse_s": parse if parse_only else None}))
'''

READERS = ("scanner", "duckdb", "msgspec", "simdjson")
ENV_NAME = {"scanner": "native", "duckdb": "duckdb"}


def child(reader: str, path: Path, repeats: int, check: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, ENV_NAME.get(reader, reader), str(path), str(repeats),
                          "check" if check else "time"], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{reader} on {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ingest_cpu(reader: str, path: Path, repeats: int) -> float:
    """Best user+system CPU seconds of `tracekit ingest FILE` (one worker) with this reader."""
    best = float("inf")
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACEKIT_KINETO_READER": ENV_NAME[reader]}
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, "-c", "from tracekit.cli import main; main()", "ingest", str(path),
                            "--store", os.path.join(tmp, "s.duckdb"), "--workers", "1", "--threads", "--json"],
                           check=True, capture_output=True, env=env, timeout=900)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            best = min(best, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return best


def layouts(events: int) -> dict[str, Path]:
    profiler = generate(WORK / f"traces-1x{events}", 1, events)[0]
    compact = WORK / f"compact-1x{events}" / "rank0.json"
    if not compact.exists():
        compact.parent.mkdir(parents=True, exist_ok=True)
        doc = json.loads(profiler.read_bytes())
        compact.write_text(json.dumps(doc, separators=(",", ":")))
    return {"profiler": profiler, "compact": compact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--readers", nargs="*", default=list(READERS), choices=READERS)
    ap.add_argument("--end-to-end", action="store_true", help="also tracekit ingest with scanner / duckdb")
    a = ap.parse_args()
    for r, module in (("msgspec", "msgspec"), ("simdjson", "simdjson")):
        if r in a.readers and importlib.util.find_spec(module) is None:
            print(f"{r}: not installed (pip install 'tracekit[bench]'); left out")
            a.readers.remove(r)
    files = layouts(a.events)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; best of {a.repeats}")
    for layout, path in files.items():
        mb = path.stat().st_size / 1e6
        truth = child("scanner", path, 1, check=True)
        for r in a.readers:
            if r != "scanner":
                got = child(r, path, 1, check=True)
                assert got == truth, f"{r} on {layout}: rows differ from the scanner's"
        print(f"\n{layout} layout: {path} ({mb:.1f} MB, {truth['rows']:,} X events; every reader gave the "
              "scanner's rows)")
        print(f"{'reader':10s} {'CPU s':>7s} {'wall s':>7s} {'MB/CPU-s':>9s} {'vs scanner':>11s} {'peak MB':>8s} "
              f"{'parse only CPU s':>17s}")
        base = None
        for r in a.readers:
            got = child(r, path, a.repeats)
            base = base or got["cpu_s"]
            print(f"{r:10s} {got['cpu_s']:7.3f} {got['wall_s']:7.3f} {mb / got['cpu_s']:9.0f} "
                  f"{got['cpu_s'] / base:10.2f}x {got['peak_mb']:8.0f} "
                  + (f"{got['parse_s']:17.3f}" if got["parse_s"] is not None else f"{'-':>17s}"))
        if a.end_to_end:
            cpu = {r: ingest_cpu(r, path, a.repeats) for r in ("scanner", "duckdb")}
            print(f"tracekit ingest, one worker, CPU s: scanner {cpu['scanner']:.2f}, duckdb {cpu['duckdb']:.2f} "
                  f"({cpu['duckdb'] / cpu['scanner']:.2f}x)")


if __name__ == "__main__":
    main()
