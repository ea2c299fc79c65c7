"""Ingest the same Kineto traces with tracekit and with Holistic Trace Analysis; print MB/s and memory.

    python benchmarks/ingest_vs_hta.py                 # 8 ranks, 61 MB and 240k events each
    python benchmarks/ingest_vs_hta.py --ranks 8 64    # both sizes (64 ranks: 3.9 GB, about 8 min)
    python benchmarks/ingest_vs_hta.py --repeats 3     # alternating runs, medians (this VM drifts by 25%)

    python benchmarks/ingest_vs_hta.py --hta-python python3   # an existing HTA install (no network)
    python benchmarks/ingest_vs_hta.py --floor         # also: what any ingest must pay here (below)
    python benchmarks/ingest_vs_hta.py --set sim-profiler --ranks 64   # another generator (below)

``--set`` picks the traces: ``gen`` (the default, below) or tracekit simulate's ``--detail`` traces
(another event mix, args and names, aten ops and ac2g flows) as the simulator writes them
(``sim-gz``: compact, gzipped), or rewritten uncompressed in the profiler's multi-line layout
(``sim-profiler``) or as one compact line (``sim-compact``); see benchmarks/trace_sets.py.

Traces (NCCL flavour, benchmarks/gen_traces.py, written by --gen-jobs processes, one per core by
default) are cached under benchmarks/_work/. HTA 0.5.0 runs in
its own venv (benchmarks/_work/hta-venv, pandas<3), created on first use with --no-deps and an
explicit dependency list so that it never pulls torch; it runs ``TraceAnalysis(trace_dir=...)`` with
its defaults (stdlib json parser, a fork pool of min(ranks, cores) workers, and for more than 8
ranks a first parse of rank 0 under tracemalloc to size the pool). Both tools run as subprocesses
on the same files, one after the other, each after a read of every file (page cache warm for
both); wall time includes interpreter start and imports for both. tracekit's own modules are
byte-compiled first (``compileall``), as pip does when it installs a package and as HTA's are in its
venv: an editable checkout under ``PYTHONDONTWRITEBYTECODE`` would otherwise compile them from
source on every run (about 0.05-0.1 s on this VM).
Memory is the peak, over the run, of the summed proportional set size (PSS,
/proc/<pid>/smaps_rollup) of the tool's whole process tree, so pages shared by forked workers are
not counted twice. MB/s is uncompressed JSON bytes per second of wall time; MB/CPU-s per second of
user + system CPU of the tool and every process it waited for, which depends far less on what
else the machine runs than wall time does (this machine is shared: read the load column).

``--floor`` measures, in the same run, three lower bounds on tracekit's wall time, against the 20x
target's budget (HTA's wall / 20): ``fixed``, the CLI ingesting one trace of one event
(interpreter, imports, store, log); ``bytes``, each file decompressed (when gzip) and passed over
once (a count of '{', in C) by as many processes as workers, pool start included; and ``scan
only``, the imports plus the native scanner reading every trace with the same workers into Arrow
batches that are then dropped: no normalization, no store. Whatever ingest does beyond reading
the bytes comes on top of ``scan only``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work"
HTA_VENV = WORK / "hta-venv"
HTA_DEPS = ["pandas<3", "numpy", "networkx", "plotly", "pydot", "psutil", "pyyaml"]
sys.path.insert(0, str(HERE))
from gen_traces import generate  # noqa: E402
from trace_sets import KINDS, build  # noqa: E402

# Each file's rank given from its name: HTA finds a file's rank with the regex '"rank":\\s+(\\d+)',
# which compact JSON ('"rank":3') never matches; every such file would then be rank 0 and HTA
# would read one file of the set.
HTA_RUN = """
import os, re, sys
from hta.trace_analysis import TraceAnalysis
files = {int(re.search(r"rank(\\d+)", f).group(1)): os.path.join(sys.argv[1], f)
         for f in os.listdir(sys.argv[1]) if f.endswith((".json", ".json.gz"))}
a = TraceAnalysis(trace_files=files, trace_dir=sys.argv[1])
print(len(a.t.get_ranks()), "ranks", sum(len(a.t.get_trace(r)) for r in a.t.get_ranks()), "events")
"""


# The floor: the imports ingest needs, then each worker streams its traces through the scanner
# (kineto.read_events, the Arrow batches dropped as they come).
SCAN_ONLY = """
import os, sys, threading
from tracekit.cli import PROCESS_DEFAULTS
for k, v in PROCESS_DEFAULTS.items():
    os.environ.setdefault(k, v)  # as the CLI sets them, before pyarrow loads
from pathlib import Path
import tracekit.ingest.pipeline
from tracekit.ingest import kineto
files, lock = sorted(p for p in Path(sys.argv[1]).iterdir() if ".json" in p.name), threading.Lock()
def work():
    while True:
        with lock:
            if not files:
                return
            path = files.pop()
        kineto.read_events(None, path, None, lambda batch: None)
workers = [threading.Thread(target=work) for _ in range(int(sys.argv[2]))]
for w in workers:
    w.start()
for w in workers:
    w.join()
"""

# The bytes floor: decompression (gzip) and one pass over the bytes (a count of '{' in C), each
# file in one of `workers` processes (pool start included), with ingest's own reader of the bytes.
BYTES_ONLY = """
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
def one(path):
    from tracekit.ingest.jsonsplit import _Source
    src, n = _Source(Path(path), None), 0
    while (block := src.read()):
        n += block.count(b"{")
    return n
if __name__ == "__main__":
    files = sorted(str(p) for p in Path(sys.argv[1]).iterdir() if ".json" in p.name)
    with ProcessPoolExecutor(int(sys.argv[2])) as pool:
        print(sum(pool.map(one, files)))
"""
TINY_TRACE = ('{"distributedInfo": {"rank": 0, "world_size": 1, "backend": "gloo"}, "traceEvents": ['
              '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]}')


def ensure_hta(python: str | None = None) -> Path:
    """The interpreter that runs HTA: ``python`` as given (an existing installation, e.g. on a machine
    without network), else the benchmark's own venv, created on first use."""
    if python is not None:
        if subprocess.run([python, "-c", "import hta.trace_analysis"], capture_output=True).returncode != 0:
            raise SystemExit(f"{python} cannot import hta.trace_analysis")
        return Path(python)
    py = HTA_VENV / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import hta.trace_analysis"], capture_output=True).returncode == 0:
        return py
    subprocess.run([sys.executable, "-m", "venv", str(HTA_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--no-deps", "holistictraceanalysis==0.5.0"], check=True)
    subprocess.run(pip + HTA_DEPS, check=True)
    torch = subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0
    if torch:
        raise SystemExit("HTA venv unexpectedly contains torch; refusing to continue")
    return py


def _tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, float, float, str]:
    """(wall seconds, peak summed PSS in MB, CPU seconds, stdout) of running ``cmd`` to completion.

    CPU is user + system time of the command and every process it waited for (HTA's pool
    workers, for instance): unlike wall time it barely depends on what else the machine runs.
    """
    cpu0 = _cpu_children()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, sum(_pss_kb(p) for p in _tree(proc.pid)))
            stop.wait(0.1)  # sampling /proc costs CPU too; both tools pay the same

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode not in (0,):
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}):\n{err[-3000:]}")
    return wall, peak / 1024, _cpu_children() - cpu0, out


def warm(paths: list[Path]) -> None:
    """Read the traces once so that both tools find them in the page cache (whichever ran second
    would otherwise get warm files and the first cold ones)."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


def raw_size(path: Path) -> int:
    """Bytes of JSON in a trace: a gzip file's from its trailer (its size mod 2^32; traces are smaller)."""
    if path.name.endswith(".gz"):
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            return int.from_bytes(f.read(4), "little")
    return path.stat().st_size


def run_case(ranks: int, events: int, workers: int, hta: bool, hta_python: str | None = None,
             gen_jobs: int = 1, floor: bool = False, kind: str = "gen", steps: int = 40,
             stores: tuple[str, ...] = ("duckdb",)) -> dict:
    traces = generate(WORK / f"traces-{ranks}x{events}", ranks, events, gen_jobs) if kind == "gen" \
        else build(kind, ranks, steps, gen_jobs)
    mb = sum(raw_size(p) for p in traces) / 1e6
    res: dict = {"ranks": ranks, "raw_mb": mb}
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-c", "from tracekit.cli import main; main()", "ingest", str(traces[0].parent),
               "--store", str(Path(tmp) / "bench.duckdb"), "--workers", str(workers), "--json"]
        for store in stores:  # the DuckDB file, or the Parquet dataset (`--out`) that every command reads too
            run = cmd if store == "duckdb" else cmd[:5] + ["--out", str(Path(tmp) / "bench-ds")] + cmd[7:]
            warm(traces)
            load = os.getloadavg()[0]
            res[TOOL[store]] = (*measure(run, env)[:3], load)
        if floor:
            tiny = Path(tmp) / "tiny"  # one trace of one event: interpreter, imports, store, log
            tiny.mkdir()
            (tiny / "rank0.json").write_text(TINY_TRACE)
            fixed = cmd[:4] + [str(tiny), "--store", str(Path(tmp) / "tiny.duckdb"), "--json"]
            res["fixed"] = (*measure(fixed, env)[:3], os.getloadavg()[0])
            warm(traces)
            warm(traces)
            pass_ = [sys.executable, "-c", BYTES_ONLY, str(traces[0].parent), str(workers)]
            res["bytes"] = (*measure(pass_, env)[:3], os.getloadavg()[0])
            warm(traces)
            scan = [sys.executable, "-c", SCAN_ONLY, str(traces[0].parent), str(workers)]
            res["scan only"] = (*measure(scan, env)[:3], os.getloadavg()[0])
    if hta:
        py = ensure_hta(hta_python)
        warm(traces)
        load = os.getloadavg()[0]
        *hta_run, out = measure([str(py), "-c", HTA_RUN, str(traces[0].parent)])
        if int(out.split()[-4]) != len(traces):
            raise SystemExit(f"HTA read {out.strip()} of {len(traces)} traces")
        res["hta"] = (*hta_run, load)
    return res


TOOL = {"duckdb": "tracekit", "dataset": "tk-ds"}  # the table's tool column, per store


def byte_compile() -> None:
    """Write tracekit's .pyc files, as an install would (see the module docstring)."""
    import compileall

    compileall.compile_dir(str(ROOT / "tracekit"), quiet=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8])
    ap.add_argument("--events", type=int, default=240_000, help="events per rank (~250 bytes each)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each tool, alternating (a shared machine drifts): the summary gives medians")
    ap.add_argument("--skip-hta", action="store_true")
    ap.add_argument("--hta-python", help="an interpreter that already has HTA 0.5.0 and pandas<3 (else a venv is made)")
    ap.add_argument("--floor", action="store_true",
                    help="also measure the fixed cost and a scan-only read, against the 20x budget")
    ap.add_argument("--set", dest="kind", choices=("gen",) + KINDS, default="gen",
                    help="gen: gen_traces.py's set (--events per rank); sim-*: tracekit simulate --detail's "
                         "traces (--steps), as written (gz) or rewritten (benchmarks/trace_sets.py)")
    ap.add_argument("--steps", type=int, default=40, help="steps of the sim-* sets")
    ap.add_argument("--store", choices=("duckdb", "dataset", "both"), default="duckdb",
                    help="what tracekit ingests into: a DuckDB file (--store), a Parquet dataset (--out, the "
                         "tk-ds rows), or both in each repeat")
    ap.add_argument("--gen-jobs", type=int, default=os.cpu_count() or 1, help="processes generating the traces")
    a = ap.parse_args()
    stores = ("duckdb", "dataset") if a.store == "both" else (a.store,)
    WORK.mkdir(exist_ok=True)
    byte_compile()
    print(f"set {a.kind}; cpus={os.cpu_count()} workers={a.workers}; load = 1-min load average when the tool started; "
          f"raw MB = uncompressed JSON")
    print(f"{'ranks':>5} {'raw MB':>7} {'tool':>8} {'load':>5} {'wall s':>7} {'MB/s':>7} {'CPU s':>7} "
          f"{'MB/CPU-s':>8} {'peak MB':>8} {'peak/raw':>8}")
    for r in a.ranks:
        runs = []
        for _ in range(a.repeats):
            res = run_case(r, a.events, a.workers, not a.skip_hta, a.hta_python, a.gen_jobs, a.floor, a.kind,
                           a.steps, stores)
            runs.append(res)
            for tool in ("tracekit", "tk-ds", "hta", "fixed", "bytes", "scan only"):
                if tool in res:
                    wall, peak, cpu, load = res[tool]
                    mb = res["raw_mb"] if tool != "fixed" else float("nan")  # reads no trace
                    print(f"{r:>5} {res['raw_mb']:>7.0f} {tool:>8} {load:>5.1f} {wall:>7.2f} "
                          f"{mb / wall:>7.1f} {cpu:>7.2f} {mb / cpu:>8.1f} {peak:>8.0f} "
                          f"{peak / res['raw_mb']:>8.2f}")
        for tk in (TOOL[s] for s in stores):
            if "hta" not in runs[0]:
                break
            med = {t: [statistics.median(x[t][i] for x in runs) for i in range(3)] for t in (tk, "hta")}
            (tw, tp, tc), (hw, hp, hc) = med[tk], med["hta"]
            walls = [x["hta"][0] / x[tk][0] for x in runs]
            print(f"{r:>5} ratio{' of medians' if a.repeats > 1 else ''}: {tk} throughput = {hw / tw:.1f}x HTA "
                  f"(wall{f', runs {min(walls):.1f}-{max(walls):.1f}x' if a.repeats > 1 else ''}), "
                  f"{hc / tc:.1f}x HTA (CPU); peak memory = {tp / hp:.2f}x HTA (load now {os.getloadavg()[0]:.1f})")
            if a.floor and "fixed" in runs[0]:
                budget = hw / 20
                parts = {t: statistics.median(x[t][0] for x in runs) for t in ("fixed", "bytes", "scan only", tk)}
                print(f"{r:>5} 20x budget {budget:.2f} s: " + ", ".join(
                    f"{t} {v:.2f} s = {v / budget:.0%}" for t, v in parts.items()))


if __name__ == "__main__":
    main()
