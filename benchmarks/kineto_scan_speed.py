"""Reading one Kineto trace's events: the native scanner against DuckDB's JSON reader and the
stdlib json module (what Holistic Trace Analysis uses), on the same file, in one run.

    python benchmarks/kineto_scan_speed.py                 # a generated 61 MB NCCL-flavour trace
    python benchmarks/kineto_scan_speed.py TRACE.json[.gz] --repeats 5

Each reader produces the same fields (kineto.COLUMNS of every X event): the scanner as Arrow
batches (tracekit's ingest path), DuckDB as a table (the fallback when the extension is not built),
json as Python objects (HTA's parse, before its DataFrame work). All three read the decompressed
event array from memory, on one thread, so the figures compare parsers, not disks. Reported: best
of ``--repeats`` runs, MB of JSON per CPU second of the reading thread, and ratios to the scanner.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import duckdb

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from gen_traces import generate  # noqa: E402

from tracekit.ingest import kineto, kineto_scan  # noqa: E402
from tracekit.ingest.jsonsplit import stream_events  # noqa: E402


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    path = a.trace or generate(HERE / "_work" / "traces-8x240000", 8, 240_000)[0]
    raw = path.read_bytes()
    text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    array = io.BytesIO()
    stream_events(path, array)
    array = array.getvalue()
    mb = len(text) / 1e6

    def scanner() -> None:
        batches = []
        sink = kineto_scan.EventSink(path, kineto.COLUMNS, batches.append, keep=("ph", "X"))
        for i in range(0, len(array), 1 << 20):
            sink.write(memoryview(array)[i:i + (1 << 20)])
        sink.close()

    con = duckdb.connect()
    con.execute("SET threads = 1")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "events.json")
        Path(src).write_bytes(array)
        con.execute(f"CREATE TABLE warm AS SELECT 1 FROM {kineto._reader(src)} LIMIT 1")  # page cache, extension

        def duck() -> None:
            con.execute("DROP TABLE IF EXISTS t")
            con.execute(f"CREATE TABLE t AS SELECT * FROM {kineto._reader(src)} WHERE ph = 'X'")

        def stdlib() -> None:
            json.loads(text)

        rows = {"native scanner (tracekit)": scanner if kineto_scan.AVAILABLE else None,
                "DuckDB read_json (fallback)": duck, "json.loads (HTA's parser)": stdlib}
        times = {k: _best(f, a.repeats) for k, f in rows.items() if f is not None}
    base = times.get("native scanner (tracekit)")
    print(f"{path}: {mb:.0f} MB of JSON; best of {a.repeats}, CPU seconds of the reading thread")
    print(f"{'reader':30s} {'CPU s':>7s} {'MB/CPU-s':>9s} {'scanner is':>11s}")
    for k, t in times.items():
        ratio = f"{t / base:.1f}x faster" if base and k != "native scanner (tracekit)" else ""
        print(f"{k:30s} {t:7.3f} {mb / t:9.0f} {ratio:>11s}")
    if base is None:
        print("the native scanner is not built (no C compiler at install time)")


if __name__ == "__main__":
    main()
