"""Localization accuracy on real reference-trainer runs: ours vs a flat baseline vs HTA.

    python benchmarks/localize_accuracy.py                        # the default grid (about 40 runs)
    python benchmarks/localize_accuracy.py --kinds slow --factors 1.05 1.1 --repeats 5 --clean 10

Grid: fault kind x position x magnitude, plus no-fault runs, all through the trainer (profiled gloo
runs of 4 ranks, ``--emulated-device`` so that ranks sharing this machine's cores behave like ranks
with a device each; reference_trainer/faults.py):
- ``slow``: a rank computes ``factor`` times longer (tp 2 x dp 2; and pp 2 x dp 2);
- ``link``: ops between two ranks are delayed by ``delay`` ms (a DP pair; a PP pair);
- ``cp_imbalance``: CP rank 1 gets the long documents (tp 1 x cp 2 x dp 2);
- ``moving``: the slow rank changes every step (factor 2).
Each run is ingested and given to
- ours: ``tracekit`` localization + root cause. A slow/cp_imbalance run is right (top-1) when the
  named culprit is one of the fault's ranks; a link run when the named rank or group lies within the
  pair or the cause names the pair; a moving run when the verdict says the straggler moves (no single culprit). The cause is
  right when it is slow_compute / slow_link naming the pair / data_imbalance / a moving straggler.
- flat: "shortest mean collective": the rank whose mean collective duration (all groups) is the
  shortest, when it is shorter than the median of the others by more than ``--flat-margin``;
- hta: Holistic Trace Analysis 0.5.0 ``get_potential_stragglers`` (its own venv, see
  ``ingest_vs_hta.ensure_hta``; one candidate asked for), when ``--hta`` is given; it reads GPU
  kernels, so on CPU gloo traces it finds nothing to compare, which is reported as such.
Printed per method, kind and magnitude: top-1 accuracy, cause accuracy (ours only) and the
false-alarm rate (anything named on a no-fault run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

HTA_STRAGGLERS = """
import json, sys
from hta.trace_analysis import TraceAnalysis
try:
    a = TraceAnalysis(trace_dir=sys.argv[1])
    out = a.get_potential_stragglers(num_candidates=1)
    print(json.dumps({"ok": True, "ranks": [int(r) for r in list(out)]}))
except Exception as e:  # report, do not crash the benchmark
    print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}))
"""


def flat_baseline(store, margin: float) -> int | None:
    """The rank with the shortest mean collective duration, if it stands out by ``margin``."""
    import polars as pl

    c = store.table("collectives").with_columns((pl.col("end_ns") - pl.col("start_ns")).alias("d"))
    per = c.group_by("rank").agg(pl.col("d").mean()).sort("d")
    if per.height < 2:
        return None
    best, rest = per.row(0), per["d"][1:]
    return int(best[0]) if best[1] < (1 - margin) * float(rest.median()) else None


def hta_prediction(py: Path, run_dir: Path) -> tuple[int | None, str | None]:
    res = subprocess.run([str(py), "-c", HTA_STRAGGLERS, str(run_dir / "traces")], capture_output=True, text=True,
                         timeout=600)
    try:
        blob = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return None, (res.stderr.strip().splitlines() or ["no output"])[-1][:200]
    if not blob["ok"]:
        return None, blob["error"]
    return (blob["ranks"][0] if len(blob["ranks"]) == 1 else None), None


def _grid(args) -> list[tuple[str, str, str, dict]]:
    """(name, kind, fault spec, layout) for every run of the grid."""
    tpdp, ppdp, cpdp = ({"tp": 2, "cp": 1, "pp": 1, "dp": 2}, {"tp": 1, "cp": 1, "pp": 2, "dp": 2},
                        {"tp": 1, "cp": 2, "pp": 1, "dp": 2})
    runs = []
    for k in range(args.repeats):
        if "slow" in args.kinds:
            for f in args.factors:
                for r in args.ranks:
                    runs.append((f"slow_r{r}_x{f}_{k}", "slow", f"slow:rank={r},factor={f}", tpdp))
                runs.append((f"slowpp_r2_x{f}_{k}", "slow", f"slow:rank=2,factor={f}", ppdp))
        if "link" in args.kinds:
            for d in args.delays:
                runs.append((f"link_dp_1-3_{d}ms_{k}", "link", f"link:a=1,b=3,delay_ms={d}", tpdp))
                runs.append((f"link_pp_0-1_{d}ms_{k}", "link", f"link:a=0,b=1,delay_ms={d}", ppdp))
        if "cp_imbalance" in args.kinds:
            runs.append((f"cpimb_{k}", "cp_imbalance", "cp_imbalance:ranks=1", cpdp))
        if "moving" in args.kinds:
            runs.append((f"moving_{k}", "moving", "moving:ranks=0+3+1,factor=2", tpdp))
    for k in range(args.clean):
        runs.append((f"clean_{k}", "none", "", (tpdp, ppdp, cpdp)[k % 3]))
    return runs


def _judge(kind: str, truth: list[int], d) -> tuple[bool, bool, bool]:
    """(top-1 right, cause right, alarm raised) for one of our diagnoses."""
    loc, cause = d.localization, d.cause
    alarm = loc.verdict not in ("no_straggler", "no_data") or cause.kind not in ("none", "insufficient_data")
    named = set(loc.culprit_ranks) if loc.verdict in ("straggler", "transient", "group") else set()
    if kind == "slow":
        return loc.culprit_rank in truth, loc.culprit_rank in truth and cause.kind == "slow_compute", alarm
    if kind == "link":  # a slow link with punctual arrivals is found by its transfers, not by lateness
        top1 = (bool(named) and named <= set(truth)) or (cause.kind == "slow_link" and set(cause.ranks) == set(truth))
        return top1, cause.kind == "slow_link" and set(cause.ranks) == set(truth), alarm
    if kind == "cp_imbalance":
        return loc.culprit_rank in truth or loc.verdict == "moving", cause.kind == "data_imbalance", alarm
    if kind == "moving":
        return loc.verdict == "moving", loc.verdict == "moving" and cause.kind in ("slow_compute", "data_imbalance"), alarm
    return False, cause.kind == "none", alarm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["slow", "link", "cp_imbalance", "moving"],
                    choices=["slow", "link", "cp_imbalance", "moving"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[0, 3], help="slow-rank positions (tp 2 x dp 2)")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.05, 1.1, 1.5], help="compute slowdowns")
    ap.add_argument("--delays", type=float, nargs="+", default=[20.0], help="link delays, ms")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--clean", type=int, default=6, help="no-fault runs")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--emulated-device", type=float, default=4.0)
    ap.add_argument("--flat-margin", type=float, default=0.05)
    ap.add_argument("--hta", action="store_true", help="also run HTA's get_potential_stragglers")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write every run's outcome here")
    args = ap.parse_args()

    import tracekit
    from tracekit.demo_run import DEMO_CONFIG, FaultSpec, Scenario, run_scenarios
    from tracekit.ingest import ingest

    out = args.out or Path(tempfile.mkdtemp(prefix="tk-accuracy-"))
    grid = _grid(args)
    scenarios = [Scenario({**DEMO_CONFIG, **lay, "steps": args.steps, "emulated_device": args.emulated_device},
                          str(out / name), (FaultSpec(spec),) if spec else ()) for name, _, spec, lay in grid]
    t0 = time.time()
    print(f"training {len(scenarios)} runs of 4 ranks, {args.steps} profiled steps each, into {out}", flush=True)
    run_scenarios(scenarios)
    print(f"trained in {time.time() - t0:.0f} s", flush=True)
    hta_py = None
    if args.hta:
        from ingest_vs_hta import ensure_hta

        hta_py = ensure_hta()
    rows = []
    for (name, kind, spec, _), sc in zip(grid, scenarios):
        run = Path(sc.out)
        db = run.parent / f"{run.name}.duckdb"
        rep = ingest([run], db)
        if rep.failed:
            raise SystemExit(f"{run}: ingest failed: {[f.error for f in rep.failed]}")
        faults = json.loads((run / "manifest.json").read_text())["faults"]
        truth = faults[0]["ranks"] if faults else []
        magnitude = faults[0]["magnitude"] if faults else {}
        mag = magnitude.get("compute_factor", magnitude.get("delay_ms", magnitude.get("weight")))
        with tracekit.open(db) as s:
            d = s.diagnose()
            flat = flat_baseline(s, args.flat_margin)
        top1, cause_ok, alarm = _judge(kind, truth, d)
        row = {"run": name, "kind": kind, "truth": truth, "magnitude": mag, "verdict": d.localization.verdict,
               "basis": d.localization.basis, "ours": d.localization.culprit_rank, "cause": d.cause.kind,
               "ours_top1": top1, "ours_cause": cause_ok, "ours_alarm": alarm, "headline": d.headline,
               "flat": flat, "flat_top1": flat in truth, "flat_alarm": flat is not None}
        if hta_py is not None:
            row["hta"], row["hta_error"] = hta_prediction(hta_py, run)
            row["hta_top1"], row["hta_alarm"] = row["hta"] in truth, row["hta"] is not None
        rows.append(row)
        print(f"  {name:24s} truth={truth} ours={d.localization.verdict}:{d.localization.culprit_rank} "
              f"({d.localization.basis}; {d.cause.kind}) flat={flat}"
              + (f" hta={row['hta']}" if hta_py else ""), flush=True)
    methods = ["ours", "flat"] + (["hta"] if hta_py is not None else [])
    print(f"\n{'method':6s} {'kind':13s} {'magnitude':>9s} {'runs':>5s} {'top-1':>7s} {'cause':>7s}")
    for m in methods:
        by = defaultdict(list)
        for r in rows:
            if r["kind"] != "none":
                by[(r["kind"], r["magnitude"])].append(r)
        for (kind, mag) in sorted(by, key=lambda km: (km[0], float(km[1] or 0))):
            rs = by[(kind, mag)]
            top1 = sum(r[f"{m}_top1"] for r in rs) / len(rs)
            cause = f"{sum(r['ours_cause'] for r in rs) / len(rs):.0%}" if m == "ours" else "-"
            print(f"{m:6s} {kind:13s} {str(mag):>9s} {len(rs):>5d} {top1:>7.0%} {cause:>7s}")
        clean = [r for r in rows if r["kind"] == "none"]
        if clean:
            fa = sum(r[f"{m}_alarm"] for r in clean) / len(clean)
            print(f"{m:6s} {'no fault':13s} {'':>9s} {len(clean):>5d} false alarms {fa:.0%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
