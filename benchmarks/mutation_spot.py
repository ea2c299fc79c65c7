"""Spot mutation testing of the straggler analysis (tracekit/analysis/*.py) and the Kineto comm
tables (tracekit/ingest/kineto_comm.py): does the default suite notice a plausible bug?

    PYTHONPATH=. python benchmarks/mutation_spot.py [--timeout 240] [--only cp_wait.min_max,...] [--list]

Each mutant is one textual change (an operator swap, min/max, a comparison flipped, a constant
changed, a term dropped) in a scratch copy of the repository (copied to a temporary directory once;
the working tree is never touched), checked against the few default-suite test files that cover
that code (``-x``, ``-m 'not slow'``, a per-mutant timeout); a mutant those pass is run against the
rest of the default suite that exercises the same code (WIDE_*). A mutant is killed when the tests
fail (or time out: reported apart), survives when both selections pass. The unmutated copy must pass each test
selection first (the baseline), else its mutants are not run. Prints a markdown table, the kill
rate and the survivors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
A = "tracekit/analysis/"
KC = "tracekit/ingest/kineto_comm.py"

# test selections (files and -k expressions), small so that a mutant costs a minute at most
CP = ("tests/test_analysis_bounds.py",)
DIAG = ("tests/test_diagnosis_kinds.py", "tests/test_diagnosis_units.py", "tests/test_analysis_localize.py")
LOC = ("tests/test_diagnosis_units.py", "tests/test_analysis_localize.py")
HANGS = ("tests/test_analysis_hangs.py",)
COLL = ("tests/test_analysis_collectives.py", "tests/test_analysis_bounds.py")
STEPS = ("tests/test_analysis_cli.py", "-k", "steps or blip or report")
COMM = ("tests/test_ingest_kineto_comm.py",)
# What a survivor of its small selection is run against next: the rest of the default suite that
# exercises the analysis (simulated NCCL jobs, the CLI, the what-if traces, the dashboard's data).
WIDE_ANALYSIS = ("tests/test_analysis_cli.py", "tests/test_analysis_wia.py", "tests/test_diagnosis_faults.py")
WIDE_COMM = ("tests/test_ingest_real.py", "tests/test_ingest_equivalence.py", "tests/test_ingest_gpu_fixtures.py")
# In the scratch copy only: hypothesis reports a failing example without shrinking it (shrinking a
# mutant's failure can take minutes; the verdict is the same).
NO_SHRINK = """from hypothesis import Phase, settings
settings.register_profile("mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("mutants")
"""


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    # cp_wait.py
    Mutant("cp_wait.gap_max_to_min", A + "cp_wait.py", 'pl.col("compute_ns").max().over(key) - pl.col("compute_ns")',
           'pl.col("compute_ns").min().over(key) - pl.col("compute_ns")', CP),
    Mutant("cp_wait.explained_min_to_max", A + "cp_wait.py", 'pl.min_horizontal("wait_ns", (pl.col',
           'pl.max_horizontal("wait_ns", (pl.col', CP),
    Mutant("cp_wait.doc_mask_ge_to_lt", A + "cp_wait.py", '== g["most_work_rank"]).mean()) >= 0.5',
           '== g["most_work_rank"]).mean()) < 0.5', CP),
    Mutant("cp_wait.explained_lt_to_gt", A + "cp_wait.py", "elif explained < tunables.cp_explained_min:",
           "elif explained > tunables.cp_explained_min:", CP),
    Mutant("cp_wait.noise_bar_x100", A + "cp_wait.py", 'if totals["wait_ns"] < tunables.effect_min_frac * steps_total:',
           'if totals["wait_ns"] < tunables.effect_min_frac * steps_total * 100:', CP),
    Mutant("cp_wait.ratio_inverted", A + "cp_wait.py", '(pl.col("compute_ns").max() / pl.col("compute_ns").min())',
           '(pl.col("compute_ns").min() / pl.col("compute_ns").max())', CP),
    Mutant("cp_wait.wait_clip_min_to_max", A + "cp_wait.py", "wait = pl.min_horizontal(", "wait = pl.max_horizontal(", CP),
    Mutant("cp_wait.slowest_last_to_first", A + "cp_wait.py", 'pl.col("rank").sort_by("compute_ns").last()',
           'pl.col("rank").sort_by("compute_ns").first()', CP),
    # culprits.py
    Mutant("culprits.confidence_min_to_max", A + "culprits.py", "return float(min(0.99, steps_share",
           "return float(max(0.99, steps_share", DIAG),
    Mutant("culprits.confidence_slope", A + "culprits.py", "z = (margin - bar) / max(bar, 1e-9) * 4.0",
           "z = (margin - bar) / max(bar, 1e-9) * 40.0", DIAG),
    Mutant("culprits.persistent_and_to_or", A + "culprits.py",
           "if margin >= bar and effect >= math.log(tun.compute_effect_min_ratio)",
           "if margin >= bar or effect >= math.log(tun.compute_effect_min_ratio)", DIAG),
    Mutant("culprits.slower_sign", A + "culprits.py", "slower = float((col > effect / 2).mean())",
           "slower = float((col < effect / 2).mean())", DIAG),
    Mutant("culprits.cost_minus_to_plus", A + "culprits.py", "cost = (math.exp(effect) - 1) * float(",
           "cost = (math.exp(effect) + 1) * float(", DIAG),
    Mutant("culprits.residual_sign", A + "culprits.py", "e = mat - np.nanmedian(mat, axis=1, keepdims=True)",
           "e = mat + np.nanmedian(mat, axis=1, keepdims=True)", DIAG),
    # diagnosis.py
    Mutant("diagnosis.cost_share_halved", A + "diagnosis.py", 'max(f.cost_ns, 0.0) / step_ns, "extra compute"',
           'max(f.cost_ns, 0.0) / (2 * step_ns), "extra compute"', DIAG),
    Mutant("diagnosis.hang_share_flip", A + "diagnosis.py", "short.height * 2 >= top.filter",
           "short.height * 2 < top.filter", DIAG),
    Mutant("diagnosis.link_conf_min_to_max", A + "diagnosis.py", "conf = float(min(0.99, 1 - 2.0",
           "conf = float(max(0.99, 1 - 2.0", DIAG),
    Mutant("diagnosis.stage_and_to_or", A + "diagnosis.py",
           "if ratio >= tun.stage_compute_ratio and share >= tun.persist_min:",
           "if ratio >= tun.stage_compute_ratio or share >= tun.persist_min:", DIAG),
    Mutant("diagnosis.hang_confidence_1", A + "diagnosis.py", 'coords={}, confidence=0.0)',
           'coords={}, confidence=1.0)', DIAG),
    # links.py
    Mutant("links.slow_ratio_flip", A + "links.py", "slow = ratio >= tun.slow_link_ratio and",
           "slow = ratio <= tun.slow_link_ratio and", LOC),
    Mutant("links.ready_min_to_max", A + "links.py", 'pl.min_horizontal("send", "recv")',
           'pl.max_horizontal("send", "recv")', LOC),
    Mutant("links.z_bar_max_to_min", A + "links.py", "z_bar = max(tun.link_z_min,", "z_bar = min(tun.link_z_min,", LOC),
    Mutant("links.tie_correction_power", A + "links.py", "tie = float((counts ** 3 - counts).sum())",
           "tie = float((counts ** 2 - counts).sum())", LOC),
    # hangs.py
    Mutant("hangs.joined_ge_to_gt", A + "hangs.py", "joined = tuple(r for r in recorded if last[r] >= seq)",
           "joined = tuple(r for r in recorded if last[r] > seq)", HANGS),
    Mutant("hangs.waiting_ignored", A + "hangs.py",
           "waiting = {r for s in self.stuck for r in s.joined} | set(self.waiting)\n        absent",
           "waiting = {r for s in self.stuck for r in s.joined}\n        absent", HANGS),
    Mutant("hangs.missing_lt_to_le", A + "hangs.py", "missing = tuple(r for r in recorded if last[r] < seq)",
           "missing = tuple(r for r in recorded if last[r] <= seq)", HANGS),
    # collectives.py
    Mutant("collectives.last_arrival_max_to_min", A + "collectives.py",
           'pl.col("start_ns").max().over(key).alias("last_arrival_ns")',
           'pl.col("start_ns").min().over(key).alias("last_arrival_ns")', COLL),
    Mutant("collectives.group_size_gt_2", A + "collectives.py", '.filter(pl.col("group_size") > 1)',
           '.filter(pl.col("group_size") > 2)', COLL),
    Mutant("collectives.max_wait_to_min", A + "collectives.py", 'pl.col("wait_ns").max().alias("max_wait_ns")',
           'pl.col("wait_ns").min().alias("max_wait_ns")', COLL),
    # localize.py, standout.py, compute_speed.py, steps.py
    Mutant("standout.and_to_or", A + "standout.py", "eff >= tun.margin_min * noise and eff >= effect_min_frac",
           "eff >= tun.margin_min * noise or eff >= effect_min_frac", LOC),
    Mutant("localize.persistent_flip", A + "localize.py", "persistent = agree / T >= tun.persist_min or",
           "persistent = agree / T <= tun.persist_min or", LOC),
    Mutant("localize.noise_max_to_min", A + "localize.py", "noise = max(spread(others), floor, sem)",
           "noise = min(spread(others), floor, sem)", LOC),
    Mutant("compute_speed.trim_quantile", A + "compute_speed.py", "(lr <= lr.quantile(0.8))", "(lr <= lr.quantile(0.95))",
           DIAG),
    Mutant("compute_speed.peers_gt_2", A + "compute_speed.py", 'spans.filter((pl.col("n") > 1)',
           'spans.filter((pl.col("n") > 2)', DIAG),
    Mutant("steps.slow_gt_to_lt", A + "steps.py", '(pl.col("step_ns") > bar).alias("slow")',
           '(pl.col("step_ns") < bar).alias("slow")', STEPS),
    # kineto_comm.py
    Mutant("kineto_comm.stride_rank0", KC, "rest = ~peer.ok & arg.ok & (arg.v >= 0)",
           "rest = ~peer.ok & arg.ok & (arg.v > 0)", COMM),
    Mutant("kineto_comm.rank_index_le", KC, "if ranks is not None and arg.v[j] < len(ranks)",
           "if ranks is not None and arg.v[j] <= len(ranks) - 2", COMM),
    Mutant("kineto_comm.greatest_to_least", KC, "np.where(a.ok & b.ok, np.maximum(a.v, b.v)",
           "np.where(a.ok & b.ok, np.minimum(a.v, b.v)", COMM),
    Mutant("kineto_comm.launcher_ext0", KC, "launcher = np.where(k_ext >= 0,", "launcher = np.where(k_ext > 0,", COMM),
    Mutant("kineto_comm.latest_launcher", KC, "np.lexsort((self.ts.v[param],", "np.lexsort((-self.ts.v[param],", COMM),
    Mutant("kineto_comm.pair_of_3", KC, "r if r is not None and len(r) == 2 else", "r if r is not None and len(r) == 3 else",
           COMM),
    Mutant("kineto_comm.end_drops_dur", KC, 'end = add(add(ts, dur, "time", ev.path), b, "time", ev.path)',
           'end = add(ts, b, "time", ev.path)', COMM),
    Mutant("kineto_comm.seq_order", KC, 'self.seq = self.int["seq_arg"].coalesce(self.int["seq_num"])',
           'self.seq = self.int["seq_num"].coalesce(self.int["seq_arg"])', COMM),
    Mutant("kineto_comm.fp8_width", KC, '"float8_e4m3fn": 1,', '"float8_e4m3fn": 2,', COMM),
]


def _scratch() -> Path:
    dst = Path(tempfile.mkdtemp(prefix="tracekit-mutants-")) / "repo"
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.duckdb", "*.duckdb.wal", ".hypothesis", ".pytest_cache",
                                    "_work", "runs")
    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)
    conftest = dst / "tests" / "conftest.py"
    conftest.write_text((conftest.read_text() if conftest.exists() else "") + "\n" + NO_SHRINK)
    return dst


def _pytest(repo: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                             cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        status = "passed" if out.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = "timeout"
    return status, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per mutant's test run")
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-wide", action="store_true", help="do not rerun survivors against the wider selection")
    args = ap.parse_args()
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.path}: {m.old!r} -> {m.new!r}")
        return
    repo = _scratch()
    print(f"scratch copy: {repo}  ({len(mutants)} mutants)", flush=True)
    baseline: dict[tuple[str, ...], str] = {}
    selections = [m.tests for m in mutants] + ([] if args.no_wide else [WIDE_ANALYSIS, WIDE_COMM])
    for tests in dict.fromkeys(selections):
        baseline[tests], secs = _pytest(repo, tests, args.timeout * 2)
        print(f"baseline {' '.join(tests)}: {baseline[tests]} ({secs:.0f} s)", flush=True)
    rows = []
    for m in mutants:
        target = repo / m.path
        original = target.read_text()
        if original.count(m.old) != 1:
            rows.append((m, "invalid", 0.0))  # the code changed: the mutant no longer applies
            continue
        if baseline[m.tests] != "passed":
            rows.append((m, "no baseline", 0.0))
            continue
        wide = WIDE_COMM if m.path == KC else WIDE_ANALYSIS
        target.write_text(original.replace(m.old, m.new))
        try:
            status, secs = _pytest(repo, m.tests, args.timeout)
            if status == "passed" and not args.no_wide and baseline[wide] == "passed":  # the rest that covers it
                status, more = _pytest(repo, wide, args.timeout * 2)
                secs += more
                status = {"failed": "failed wide", "timeout": "timeout wide"}.get(status, status)
        finally:
            target.write_text(original)
        result = {"failed": "killed", "timeout": "killed (timeout)", "failed wide": "killed (wider suite)",
                  "timeout wide": "killed (wider suite, timeout)", "passed": "SURVIVED"}[status]
        rows.append((m, result, secs))
        print(f"{m.name}: {result} ({secs:.0f} s)", flush=True)
    print("\n| mutant | file | change | tests | result | s |\n|---|---|---|---|---|---|")
    for m, result, secs in rows:
        print(f"| {m.name} | {m.path.removeprefix('tracekit/')} | `{m.old.strip()}` -> `{m.new.strip()}` | "
              f"{' '.join(t.removeprefix('tests/') for t in m.tests)} | {result} | {secs:.0f} |")
    ran = [r for r in rows if r[1] not in ("invalid", "no baseline")]
    killed = [r for r in ran if r[1].startswith("killed")]
    print(f"\nkilled {len(killed)} of {len(ran)} mutants: {len(killed) / max(len(ran), 1):.0%}"
          f" ({len(rows) - len(ran)} not run: invalid or no baseline)")
    survivors = [r[0].name for r in ran if r[1] == "SURVIVED"]
    print("survivors: " + (", ".join(survivors) if survivors else "none"))
    shutil.rmtree(repo.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
