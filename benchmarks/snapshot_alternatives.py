"""Memory snapshots: tracekit's streaming pickle machine (C, and its Python reference) against the
standard library's unpickler with a refusing ``find_class``, on speed, peak memory and hostile input.

    PYTHONPATH=$PWD python benchmarks/snapshot_alternatives.py                  # 200k entries (about 38 MB)
    PYTHONPATH=$PWD python benchmarks/snapshot_alternatives.py --entries 400000 --repeats 3

Contenders, each in a process of its own (peak RSS is ``VmHWM`` above the RSS after imports), each
doing what ingest does with a snapshot file: its tables (memory_events, memory_segments,
memory_blocks) as Arrow.

- ``machine (C)`` / ``machine (Python)``: ``memory_snapshot.parse``, the streaming pickle machine
  (TRACEKIT_PICKLE_READER=native | python).
- ``stdlib strict``: ``pickle.Unpickler`` whose ``find_class`` refuses every global and whose
  ``persistent_load`` refuses too, loading the whole file, then ``memory_snapshot.parse_snapshot``
  walking the dict (the path ingest takes for files under 2 MiB, with tracekit's own unpickler).
- ``stdlib (tracekit)``: the same with ``tracekit.ingest.unpickle.load``, whose ``find_class``
  admits the four data constructors of protocols 0-1 (set, frozenset, bytearray, _codecs.encode).

"Bounded": the hostile inputs run with the process's address space capped (``RLIMIT_AS``) at its
size after imports plus ``--cap-mb``; an input that needs more ends in MemoryError instead of
taking the machine. Each hostile file is a few bytes to a few MB; the outcome column says what
the contender did with it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "_work"

CHILD = r'''
import json, os, pickle, resource, sys, time
who, path, repeats, cap_mb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from pathlib import Path
import numpy, polars, pyarrow
from tracekit.ingest import memory_snapshot, unpickle

def status_mb(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) / 1024

class Strict(pickle.Unpickler):
    def find_class(self, module, name):
        raise unpickle.UnsafePickleError(f"{path}: pickle refers to {module}.{name}; refused")
    def persistent_load(self, pid):
        raise unpickle.UnsafePickleError(f"{path}: pickle uses persistent ids; refused")

def run():
    p = Path(path)
    if who in ("native", "python"):
        return memory_snapshot.parse(p)
    if who == "strict":
        with open(p, "rb") as f:
            snap = Strict(f).load()
    else:
        snap = unpickle.load(p)
    return memory_snapshot.parse_snapshot(p, snap)

os.environ[unpickle.READER_ENV] = who if who in ("native", "python") else "native"
if cap_mb:
    vm = int(status_mb("VmSize") * 1024 * 1024) + (cap_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (vm, vm))
base = status_mb("VmHWM")
best, outcome, rows = float("inf"), "ok", None
for _ in range(repeats):
    c0 = time.process_time()
    try:
        parsed = run()
        rows = parsed.tables["memory_events"].num_rows
        del parsed
    except MemoryError:
        outcome = "MemoryError at the cap"
    except Exception as e:
        outcome = f"{type(e).__name__}: {str(e).replace(path, 'FILE')[:70]}"
        if isinstance(e.__context__, MemoryError):  # a MemoryError turned into the reader's own error
            outcome = f"MemoryError at the cap, reported as {type(e).__name__}"
    best = min(best, time.process_time() - c0)
print(json.dumps({"cpu_s": best, "peak_mb": status_mb("VmHWM") - base, "rows": rows, "outcome": outcome}))
'''

WHO = {"machine (C)": "native", "machine (Python)": "python", "stdlib strict": "strict",
       "stdlib (tracekit)": "tracekit"}


def child(who: str, path: Path, repeats: int, cap_mb: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, WHO[who], str(path), str(repeats), str(cap_mb)],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        return {"cpu_s": float("nan"), "peak_mb": float("nan"), "rows": None,
                "outcome": f"process died (rc {out.returncode}): {out.stderr.strip().splitlines()[-1][:60]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def snapshot_file(entries: int) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from cuda_snapshot import cuda_snapshot

    path = WORK / f"cuda_snapshot_{entries}_0.pickle"
    if not path.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        snap, _ = cuda_snapshot(entries, seed=0)
        with open(path, "wb") as f:
            pickle.dump(snap, f)  # as torch.cuda.memory._dump_snapshot
    return path


def hostile(tmp: Path) -> dict[str, Path]:
    """Inputs a snapshot reader must survive: each names a way to make an unpickler do work or
    hold memory out of proportion to the file."""
    head = b"\x80\x04}\x94(\x8c\x08segments\x94]"  # a snapshot-like start, as the tests' FORBIDDEN cases
    cases = {
        "os.system via REDUCE": pickle.dumps({"segments": [], "device_traces": [[_Boom()]]}, protocol=4),
        "bytearray(1.5e9) REDUCE": b"\x80\x02c__builtin__\nbytearray\nJ\x00\x2f\x68\x59\x85R.",
        "1.5 GB length, 20-byte file": head + b"\x8e" + struct.pack("<Q", 1_500_000_000) + b"xx",
        # one 1 KiB list referred to a million times: 2 MB of BINGETs, a million list entries
        "fan-out: 1M refs to one list": (b"\x80\x04}\x94(\x8c\x08segments\x94](" + b"](" + b"K\x01" * 1024 +
                                         b"eq\x02" + b"h\x02" * 1_000_000 + b"e\x8c\x0ddevice_traces]u."),
        "nesting 1M lists deep": b"\x80\x04}(\x8c\x08segments" + b"](" * 1_000_000 + b"e" * 1_000_000 + b"u.",
    }
    out = {}
    for name, data in cases.items():
        p = tmp / (name.split(":")[0].replace(" ", "_").replace("/", "") + ".pickle")
        p.write_bytes(data)
        out[name] = p
    return out


class _Boom:
    def __reduce__(self):
        return (os.system, ("true",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap-mb", type=int, default=1024, help="address space allowed above the imports, hostile runs")
    a = ap.parse_args()
    path = snapshot_file(a.entries)
    mb = path.stat().st_size / 2**20
    print(f"snapshot {path.name}: {mb:.0f} MB; best of {a.repeats}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"{'contender':18s} {'CPU s':>7s} {'vs C':>6s} {'peak MB':>8s} {'x file':>7s} {'rows':>9s}")
    base = None
    for who in WHO:
        r = child(who, path, a.repeats, 0)
        base = base or r["cpu_s"]
        print(f"{who:18s} {r['cpu_s']:7.2f} {r['cpu_s'] / base:5.1f}x {r['peak_mb']:8.0f} {r['peak_mb'] / mb:6.1f}x "
              f"{r['rows'] or 0:9,d}  {'' if r['outcome'] == 'ok' else r['outcome']}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, p in hostile(Path(tmp)).items():
            print(f"\nhostile: {name} ({p.stat().st_size:,} bytes), address space capped at +{a.cap_mb} MB")
            for who in WHO:
                r = child(who, p, 1, a.cap_mb)
                print(f"  {who:18s} {r['cpu_s']:6.2f} CPU s {r['peak_mb']:7.0f} MB  {r['outcome']}")


if __name__ == "__main__":
    main()
