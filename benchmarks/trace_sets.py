"""Kineto trace sets for the ingest benchmarks, beyond gen_traces.py's own generator.

``sim-*`` sets come from ``tracekit simulate --detail`` (a 4D job's traces with aten ops, nccl:
annotations and ac2g flow events: a different event mix, args and names from gen_traces.py's), in
three encodings of the same events:

- ``sim-gz``: as the simulator writes them, compact JSON gzipped (level 3);
- ``sim-profiler``: uncompressed, rewritten in the profiler's own multi-line layout (an event over
  several lines, args on their own lines, as Kineto's ``ChromeTraceLogger`` writes them);
- ``sim-compact``: uncompressed, one line of compact JSON per file.

    python benchmarks/trace_sets.py sim-profiler --ranks 64 --steps 40

Sets are cached under benchmarks/_work/ (a marker file says a set is complete).
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work"
KINDS = ("sim-gz", "sim-profiler", "sim-compact")
# 64 ranks = tp 2 x pp 4 x dp 8; other sizes keep tp 2 x pp 4
TP, PP = 2, 4


def _event(e: dict) -> str:
    """One event in the profiler's layout (libkineto's output.cpp writes each event like this)."""
    args = e.get("args")
    head = ", ".join(f'"{k}": {json.dumps(v)}' for k, v in e.items() if k not in ("args", "ts", "dur"))
    times = ", ".join(f'"{k}": {json.dumps(e[k])}' for k in ("ts", "dur") if k in e)
    text = f"  {{\n    {head}" + (f",\n    {times}" if times else "")
    if args is not None:
        inner = ", ".join(f'"{k}": {json.dumps(v)}' for k, v in args.items())
        text += f",\n    \"args\": {{\n      {inner}\n    }}"
    return text + "\n  }"


def rewrite(src: Path, dst: Path, layout: str) -> None:
    doc = json.loads(gzip.open(src).read())
    if layout == "compact":
        dst.write_text(json.dumps(doc, separators=(",", ":")))
        return
    keys = list(doc)  # in the simulator's order, which is the profiler's: traceName and the base after the array
    at = keys.index("traceEvents")
    with open(dst, "w") as f:
        f.write("{\n" + "".join(f'  "{k}": {json.dumps(doc[k])},\n' for k in keys[:at]))
        f.write('  "traceEvents": [\n')
        f.write(",\n".join(_event(e) for e in doc["traceEvents"]))
        f.write("\n  ]" + "".join(f',\n  "{k}": {json.dumps(doc[k])}' for k in keys[at + 1:]) + "\n}\n")


def _rewrite(job: tuple[Path, Path, str]) -> None:
    rewrite(*job)


def build(kind: str, ranks: int, steps: int, jobs: int = 1) -> list[Path]:
    """The set's trace files (made on first use)."""
    if kind not in KINDS:
        raise SystemExit(f"unknown set {kind!r}: {', '.join(KINDS)}")
    dp = ranks // (TP * PP)
    if dp * TP * PP != ranks:
        raise SystemExit(f"--ranks must be a multiple of {TP * PP}")
    sim = WORK / f"sim-{ranks}x{steps}"
    if not (sim / ".complete").exists():
        shutil.rmtree(sim, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-c", "from tracekit.cli import main; main()", "simulate", "--tp", str(TP),
                        "--pp", str(PP), "--dp", str(dp), "--steps", str(steps), "--layers", "4", "--detail",
                        "--format", "kineto", "--out", str(sim)], check=True, env=env, stdout=subprocess.DEVNULL)
        (sim / ".complete").touch()
    src = sorted((sim / "traces").glob("*.json.gz"))
    if kind == "sim-gz":
        return src
    out = WORK / f"{kind}-{ranks}x{steps}"
    dst = [out / p.name[:-3] for p in src]
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        work = [(s, d, kind.split("-")[1]) for s, d in zip(src, dst)]
        with multiprocessing.Pool(max(1, jobs)) as pool:
            pool.map(_rewrite, work, chunksize=1)
        (out / ".complete").touch()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    paths = build(a.kind, a.ranks, a.steps, a.jobs)
    print(f"{len(paths)} files, {sum(p.stat().st_size for p in paths) / 1e6:,.0f} MB on disk under {paths[0].parent}")


if __name__ == "__main__":
    main()
