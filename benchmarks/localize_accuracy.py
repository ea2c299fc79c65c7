"""Localization accuracy on real reference-trainer runs: ours vs a flat baseline vs HTA.

    python benchmarks/localize_accuracy.py                                  # small grid (2 spawns)
    python benchmarks/localize_accuracy.py --layout 2,1,1,2 --ranks 0 3 --factors 1.05 1.1 1.5 --repeats 3 --clean 6

Grid: fault kind x position x magnitude, plus no-fault runs, all through the trainer
(``tracekit.demo_run``: profiled gloo runs; fault = the rank's compute takes ``factor`` times as long).
Each run is ingested and given to
- ours: ``tracekit`` localization + root cause; a prediction is the culprit rank of a "straggler" or
  "transient" verdict, anything else predicts "no straggler";
- flat: "shortest mean collective": the rank whose mean collective duration (all groups) is the
  shortest, when it is shorter than the median of the others by more than ``--flat-margin``;
- hta: Holistic Trace Analysis 0.5.0 ``get_potential_stragglers`` (its own venv, see
  ``ingest_vs_hta.ensure_hta``; one candidate asked for), when ``--hta`` is given; it reads GPU kernels, so on CPU gloo traces
  it finds nothing to compare, which is reported as such.
Printed per method and magnitude: top-1 accuracy (the injected rank named), cause accuracy (ours:
``slow_compute``) and the false-alarm rate (a rank named on a no-fault run).
Kinds beyond compute slowdowns (slow link, CP data imbalance, hangs) need the trainer's own fault
injection (branch ``obs``); ``--kinds`` lists what this script can run.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="2,1,1,2", help="tp,cp,pp,dp (default 2,1,1,2: 4 ranks)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[3], help="fault positions (global ranks)")
    ap.add_argument("--factors", type=float, nargs="+", default=[1.05, 1.1, 1.5], help="compute slowdowns")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--clean", type=int, default=2, help="no-fault runs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kinds", default="slow", help="fault kinds (only 'slow' until the trainer's faults land)")
    ap.add_argument("--flat-margin", type=float, default=0.05)
    ap.add_argument("--hta", action="store_true", help="also run HTA's get_potential_stragglers")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write every run's outcome here")
    args = ap.parse_args()
    if args.kinds != "slow":
        raise SystemExit(f"kinds {args.kinds!r}: only 'slow' can be injected here (see the module docstring)")

    import tracekit
    from tracekit.demo_run import DEMO_CONFIG, Scenario, SlowFault, run_scenarios
    from tracekit.ingest import ingest

    tp, cp, pp, dp = (int(x) for x in args.layout.split(","))
    cfg = {**DEMO_CONFIG, "tp": tp, "cp": cp, "pp": pp, "dp": dp, "steps": args.steps}
    out = args.out or Path(tempfile.mkdtemp(prefix="tk-accuracy-"))
    cases = [(r, f, k) for r in args.ranks for f in args.factors for k in range(args.repeats)]
    scenarios = [Scenario(cfg, str(out / f"slow_r{r}_x{f}_{k}"), (SlowFault(r, f),)) for r, f, k in cases]
    scenarios += [Scenario(cfg, str(out / f"clean_{k}"), ()) for k in range(args.clean)]
    t0 = time.time()
    print(f"training {len(scenarios)} runs of {tp * cp * pp * dp} ranks (tp {tp}, cp {cp}, pp {pp}, dp {dp}), "
          f"{args.steps} steps each, into {out}", flush=True)
    run_scenarios(scenarios)
    print(f"trained in {time.time() - t0:.0f} s", flush=True)
    hta_py = None
    if args.hta:
        from ingest_vs_hta import ensure_hta

        hta_py = ensure_hta()
    rows = []
    for sc in scenarios:
        run = Path(sc.out)
        db = run.parent / f"{run.name}.duckdb"
        rep = ingest([run], db)
        if rep.failed:
            raise SystemExit(f"{run}: ingest failed: {[f.error for f in rep.failed]}")
        truth = sc.faults[0].rank if sc.faults else None
        factor = sc.faults[0].factor if sc.faults else None
        with tracekit.open(db) as s:
            d = s.diagnose()
            flat = flat_baseline(s, args.flat_margin)
        loc = d.localization
        ours = loc.culprit_rank if loc.verdict in ("straggler", "transient") else None
        row = {"run": run.name, "truth": truth, "factor": factor, "ours": ours, "verdict": loc.verdict,
               "cause": d.cause.kind, "flat": flat, "headline": d.headline,
               # any finding counts as an alarm on a no-fault run, not only a named rank
               "ours_alarm": loc.verdict not in ("no_straggler", "no_data"), "flat_alarm": flat is not None}
        if hta_py is not None:
            row["hta"], row["hta_error"] = hta_prediction(hta_py, run)
            row["hta_alarm"] = row["hta"] is not None
        rows.append(row)
        print(f"  {run.name:22s} truth={truth} ours={ours} ({loc.verdict}, {d.cause.kind}) flat={flat}"
              + (f" hta={row['hta']}" + (f" [{row['hta_error']}]" if row.get("hta_error") else "")
                 if hta_py else ""), flush=True)
    methods = ["ours", "flat"] + (["hta"] if hta_py is not None else [])
    print(f"\n{'method':6s} {'magnitude':>9s} {'runs':>5s} {'top-1':>7s} {'cause':>7s}")
    for m in methods:
        by = defaultdict(list)
        for r in rows:
            if r["truth"] is not None:
                by[r["factor"]].append(r)
        for factor in sorted(by):
            rs = by[factor]
            top1 = sum(r[m] == r["truth"] for r in rs) / len(rs)
            cause = (f"{sum(r[m] == r['truth'] and r['cause'] == 'slow_compute' for r in rs) / len(rs):.0%}"
                     if m == "ours" else "-")  # the baselines name no cause
            print(f"{m:6s} {factor:>8.2f}x {len(rs):>5d} {top1:>7.0%} {cause:>7s}")
        clean = [r for r in rows if r["truth"] is None]
        if clean:
            fa = sum(r[f"{m}_alarm"] for r in clean) / len(clean)
            print(f"{m:6s} {'no fault':>9s} {len(clean):>5d} false alarms {fa:.0%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
