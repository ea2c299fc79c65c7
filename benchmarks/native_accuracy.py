"""Localization on torch-native jobs (reference_trainer/native_job.py): verdict vs truth per run.

    python benchmarks/native_accuracy.py                   # the grid below (about 1 min per run here)
    python benchmarks/native_accuracy.py --quick           # 4 runs: 2x2x2 at 1.5 and 1.3, 2x1x2, clean
    python benchmarks/native_accuracy.py --layouts 2x2x2 1x2x2 --factors 1.3 --seeds 0 1 --clean 2

Grid: each layout dp x pp x tp with every size 1 or 2 (world > 1), slow factors 1.3 and 1.5, the
seeds given, the slow rank rotating over the world (seed k: rank (3k + 1) mod world), plus clean
runs. Each run: the job (gloo, plain torch.profiler, torch's flight recorder), ingest, then
- ``verdict``: `tracekit stragglers` (diagnosis.diagnose): verdict, named rank and coordinates;
- ``compute``: the compute check alone (compute_speed.compute_outlier over the CPU-op compute);
- ``labels``: how the unlabelled collectives were labelled (assign_groups) and what is missing
  (data_needs.missing_data).
A slow run is right when the named rank is the slow one, with its true coordinates; a clean run
when there is no finding at all.
Printed: one row per run, then accuracy per kind (slow at each factor, clean).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reference_trainer import native_job  # noqa: E402
from tracekit import open as open_store  # noqa: E402
from tracekit.analysis.compute_speed import compute_outlier, compute_speed  # noqa: E402
from tracekit.analysis.data_needs import missing_data  # noqa: E402
from tracekit.ingest.pipeline import ingest  # noqa: E402

ALL_LAYOUTS = [f"{d}x{p}x{t}" for d, p, t in itertools.product((1, 2), repeat=3) if d * p * t > 1]
QUICK = [("2x2x2", 1.5, 0), ("2x2x2", 1.3, 1), ("2x1x2", 1.5, 0), ("2x2x2", None, 0)]


def one_run(root: Path, layout: str, factor: float | None, seed: int, steps: int) -> dict:
    dp, pp, tp = (int(x) for x in layout.split("x"))
    world = dp * pp * tp
    slow = (3 * seed + 1) % world if factor else None
    name = f"{layout}_{'clean' if factor is None else f'f{factor}_r{slow}'}_s{seed}"
    argv = ["--dp", str(dp), "--pp", str(pp), "--tp", str(tp), "--steps", str(steps), "--seed", str(seed),
            "--out", str(root / name)]
    if factor:
        argv += ["--slow-rank", str(slow), "--slow-factor", str(factor)]
    t0 = time.time()
    native_job.run(native_job.parse_args(argv))
    ingest([root / name], root / f"{name}.duckdb")
    store = open_store(root / f"{name}.duckdb")
    tables = store.run_tables()
    diag = store.diagnose()
    loc = diag.localization
    comp = compute_outlier(compute_speed(tables))
    missing = [m.what for m in missing_data(tables)]
    # the rank and its true coordinates (the layout comes from the traces' own pg_config)
    true_coords = {"dp": slow // (tp * pp), "pp": (slow // tp) % pp, "cp": 0, "tp": slow % tp} if factor else None
    right = (loc.culprit_rank == slow and {**loc.coords, "cp": loc.coords.get("cp", 0)} == true_coords) if factor \
        else (loc.culprit_rank is None and not loc.culprit_ranks and not diag.findings)
    return {"run": name, "kind": "clean" if factor is None else f"slow {factor}", "truth": slow,
            "verdict": loc.verdict, "named": loc.culprit_rank, "coords": loc.coords, "right": right,
            "compute": f"{comp.verdict}:{comp.rank}" if comp.verdict == "culprit" else comp.verdict,
            "compute_right": (comp.verdict == "culprit" and comp.rank == slow) if factor else comp.verdict != "culprit",
            "ratio": round(comp.ratios.get(slow, float("nan")), 2) if factor else None,
            "labels": tables.labelling.method if tables.labelling else "-", "missing": ",".join(missing) or "-",
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="*", default=ALL_LAYOUTS, help="dp x pp x tp, e.g. 2x2x2")
    ap.add_argument("--factors", nargs="*", type=float, default=[1.3, 1.5])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--clean", type=int, default=1, help="clean runs per layout")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    a = ap.parse_args(argv)
    cases = QUICK if a.quick else (
        [(lay, f, s) for lay in a.layouts for f in a.factors for s in a.seeds]
        + [(lay, None, s) for lay in a.layouts for s in range(a.clean)])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows = []
        cols = ("run", "truth", "verdict", "named", "coords", "right", "compute", "ratio", "labels", "missing",
                "seconds")
        print(" | ".join(cols))
        for lay, f, s in cases:
            r = one_run(root, lay, f, s, a.steps)
            rows.append(r)
            print(" | ".join(str(r[c]) for c in cols), flush=True)
    by = defaultdict(list)
    for r in rows:
        by[r["kind"]].append(r)
    print("\nkind | runs | verdict right | compute check right")
    for kind, rs in sorted(by.items()):
        print(f"{kind} | {len(rs)} | {sum(r['right'] for r in rs)}/{len(rs)} | "
              f"{sum(r['compute_right'] for r in rs)}/{len(rs)}")


if __name__ == "__main__":
    main()
