"""Localization accuracy on real reference-trainer runs: ours vs a flat baseline vs HTA.

    python benchmarks/localize_accuracy.py                      # the default grid (4 and 8 ranks)
    python benchmarks/localize_accuracy.py --quick              # a smoke run (about 10 runs)
    python benchmarks/localize_accuracy.py --kinds slow --factors 1.05 1.1 --repeats 8 --clean 24
    python benchmarks/localize_accuracy.py --out runs/acc ...; ... --out runs/acc --rejudge   # re-score kept runs

Every run goes through the trainer (profiled gloo runs; each rank has an emulated device,
reference_trainer/device.py, so that ranks sharing this machine's 2 cores compute like ranks with a
GPU each, 2% jitter per span), is ingested from its run directory and diagnosed. Grid, per repeat:
- ``slow``: one rank computes ``factor`` times longer; the rank rotates over every position of
  each layout (4 ranks: tp2 x dp2, pp2 x dp2, cp2 x dp2; 8 ranks: tp2 x pp2 x dp2);
- ``link``: every op between two ranks is delayed by ``delay`` ms (a DP pair, a PP pair);
- ``cp_imbalance``: one CP rank gets the long documents (cp2 x dp2);
- ``moving``: the slow rank changes every step (factor 2, tp2 x dp2);
- no-fault runs, cycling over the layouts.
Judged per run, against the manifest's ground truth:
- ours (tracekit): top-1 is right when the named culprit is the slow rank (slow), lies within the
  pair or the cause names the pair (link), is a loaded CP rank or the verdict is moving
  (cp_imbalance), or the verdict is moving (moving). The cause is right when it is slow_compute /
  slow_link naming the pair / data_imbalance / slow_compute or data_imbalance respectively. An
  alarm is any verdict other than no_straggler or any cause other than none;
- flat: "shortest mean collective" (the rank whose mean collective duration over all groups is the
  shortest, when it beats the others' median by ``--flat-margin``);
- hta: Holistic Trace Analysis 0.5.0 ``get_potential_stragglers`` (``--hta``; its own venv, see
  ``ingest_vs_hta.ensure_hta``). It reads NCCL GPU kernels, so on gloo traces it has nothing to
  compare: that is reported, as the error it gives.
Printed: per method, kind and magnitude: runs, top-1 and cause accuracy with a 95% Wilson lower
bound; the false-alarm rate on no-fault runs; the emulated devices' overrun share (segments whose
CPU work outlasted the device time, i.e. where the machine rather than the model set the time).
"""

from __future__ import annotations

import argparse
import json
import math
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

LAYOUTS = {
    "tp2dp2": {"tp": 2, "cp": 1, "pp": 1, "dp": 2},
    "pp2dp2": {"tp": 1, "cp": 1, "pp": 2, "dp": 2},
    "cp2dp2": {"tp": 1, "cp": 2, "pp": 1, "dp": 2},
    "tp2pp2dp2": {"tp": 2, "cp": 1, "pp": 2, "dp": 2},
}


def world(layout: str) -> int:
    lay = LAYOUTS[layout]
    return lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"]


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


def grid(args) -> list[tuple[str, str, str, str]]:
    """(name, kind, fault spec, layout) for every run."""
    layouts = [n for n in LAYOUTS if world(n) in args.world]
    runs = []
    for k in range(args.repeats):
        if "slow" in args.kinds:
            for f in args.factors:
                for lay in layouts:
                    r = (k * 3 + round(f * 100)) % world(lay)  # rotate over positions
                    runs.append((f"slow_{lay}_r{r}_x{f}_{k}", "slow", f"slow:rank={r},factor={f}", lay))
        if "link" in args.kinds:
            for d in args.delays:
                if "tp2dp2" in layouts:
                    a, b = ((1, 3), (0, 2))[k % 2]
                    runs.append((f"link_dp_{a}-{b}_{d}ms_{k}", "link", f"link:a={a},b={b},delay_ms={d}", "tp2dp2"))
                if "pp2dp2" in layouts:
                    a, b = ((0, 1), (2, 3))[k % 2]
                    runs.append((f"link_pp_{a}-{b}_{d}ms_{k}", "link", f"link:a={a},b={b},delay_ms={d}", "pp2dp2"))
                if "tp2pp2dp2" in layouts:
                    runs.append((f"link_dp8_2-6_{d}ms_{k}", "link", f"link:a=2,b=6,delay_ms={d}", "tp2pp2dp2"))
        if "cp_imbalance" in args.kinds and "cp2dp2" in layouts:
            runs.append((f"cpimb_{k}", "cp_imbalance", f"cp_imbalance:ranks={k % 2}", "cp2dp2"))
        if "moving" in args.kinds and "tp2dp2" in layouts:
            runs.append((f"moving_{k}", "moving", "moving:ranks=0+3+1,factor=2", "tp2dp2"))
    for k in range(args.clean):
        lay = layouts[k % len(layouts)]
        runs.append((f"clean_{lay}_{k}", "none", "", lay))
    return runs


def judge(kind: str, truth: list[int], d) -> tuple[bool, bool, bool]:
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


def wilson_low(hits: int, n: int, z: float = 1.96) -> float:
    if n == 0:
        return float("nan")
    p = hits / n
    return (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)


def overrun_share(run: Path) -> float:
    seg = over = 0
    for f in (run / "device").glob("rank*.json"):
        d = json.loads(f.read_text())
        seg, over = seg + d["segments"], over + d["overruns"]
    return over / seg if seg else float("nan")


def summarize(rows: list[dict], methods: list[str]) -> str:
    out = [f"{'method':6s} {'kind':13s} {'magnitude':>9s} {'runs':>5s} {'top-1':>7s} {'(95% low)':>9s} "
           f"{'cause':>7s} {'(95% low)':>9s}"]
    for m in methods:
        by = defaultdict(list)
        for r in rows:
            if r["kind"] != "none":
                by[(r["kind"], r["magnitude"])].append(r)
        for kind, mag in sorted(by, key=lambda km: (km[0], float(km[1] or 0))):
            rs = by[(kind, mag)]
            top1 = sum(r[f"{m}_top1"] for r in rs)
            line = f"{m:6s} {kind:13s} {str(mag):>9s} {len(rs):>5d} {top1 / len(rs):>7.0%} {wilson_low(top1, len(rs)):>9.0%}"
            if m == "ours":
                c = sum(r["ours_cause"] for r in rs)
                line += f" {c / len(rs):>7.0%} {wilson_low(c, len(rs)):>9.0%}"
            out.append(line)
        clean = [r for r in rows if r["kind"] == "none"]
        if clean:
            fa = sum(r[f"{m}_alarm"] for r in clean)
            out.append(f"{m:6s} {'no fault':13s} {'':>9s} {len(clean):>5d} false alarms {fa}/{len(clean)} "
                       f"= {fa / len(clean):.1%}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["slow", "link", "cp_imbalance", "moving"],
                    choices=["slow", "link", "cp_imbalance", "moving"])
    ap.add_argument("--factors", type=float, nargs="+", default=[1.05, 1.1, 1.5], help="compute slowdowns")
    ap.add_argument("--delays", type=float, nargs="+", default=[20.0], help="link delays, ms")
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8], choices=[4, 8], help="world sizes")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--clean", type=int, default=24, help="no-fault runs")
    ap.add_argument("--steps", type=int, default=8, help="profiled steps per run")
    ap.add_argument("--quick", action="store_true", help="one repeat, 5%% and 10%%, 4 clean runs, 4 ranks")
    ap.add_argument("--flat-margin", type=float, default=0.05)
    ap.add_argument("--hta", action="store_true", help="also run HTA's get_potential_stragglers")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write every run's outcome here")
    ap.add_argument("--rejudge", action="store_true",
                    help="train nothing: judge the runs already under --out (same grid arguments) with the current analysis")
    args = ap.parse_args()
    if args.rejudge and args.out is None:
        ap.error("--rejudge needs --out, the directory of an earlier run")
    if args.quick:
        args.repeats, args.factors, args.clean, args.world = 1, [1.05, 1.1], 4, [4]

    import tracekit
    from tracekit.demo_run import DEMO_CONFIG, FaultSpec, Scenario, run_scenarios
    from tracekit.ingest import ingest

    out = args.out or Path(tempfile.mkdtemp(prefix="tk-accuracy-"))
    runs = grid(args)
    hta_py = None
    if args.hta:
        from ingest_vs_hta import ensure_hta

        hta_py = ensure_hta()
    print(f"{len(runs)} runs ({args.steps} profiled steps each) into {out}", flush=True)
    rows: list[dict] = []
    t_start = time.time()
    for w in sorted({world(lay) for _, _, _, lay in runs}):
        batch = [r for r in runs if world(r[3]) == w]
        for i in range(0, len(batch), 8):  # one spawned world trains 8 runs, then they are judged
            chunk = batch[i:i + 8]
            scenarios = [Scenario({**DEMO_CONFIG, **LAYOUTS[lay], "steps": args.steps, "profile_memory": False}, str(out / name),
                                  (FaultSpec(spec),) if spec else ()) for name, _, spec, lay in chunk]
            if args.rejudge:
                missing = [sc.out for sc in scenarios if not (Path(sc.out) / "manifest.json").is_file()]
                if missing:
                    raise SystemExit(f"--rejudge: no run at {', '.join(missing)}")
            else:
                run_scenarios(scenarios)
            for (name, kind, spec, lay), sc in zip(chunk, scenarios):
                rows.append(judge_run(name, kind, lay, Path(sc.out), args, hta_py, tracekit, ingest))
                r = rows[-1]
                print(f"[{len(rows)}/{len(runs)} {time.time() - t_start:5.0f}s] {name:28s} truth={r['truth']} "
                      f"ours={r['verdict']}:{r['ours']} ({r['basis']}; {r['cause']}) "
                      f"{'ok' if r['ours_top1'] or (kind == 'none' and not r['ours_alarm']) else 'MISS'} "
                      f"flat={r['flat']} overrun={r['overrun']:.1%}"
                      + (f" hta={r['hta']}" if hta_py else ""), flush=True)
    methods = ["ours", "flat"] + (["hta"] if hta_py is not None else [])
    print()
    print(summarize(rows, methods))
    print(f"emulated-device overruns: median {sorted(r['overrun'] for r in rows)[len(rows) // 2]:.1%} of segments; "
          f"{len(rows)} runs in {time.time() - t_start:.0f} s")
    if hta_py is not None:
        errors = sorted({r["hta_error"] for r in rows if r.get("hta_error")})
        if errors:
            print("hta:", "; ".join(errors)[:400])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


def judge_run(name, kind, lay, run: Path, args, hta_py, tracekit, ingest) -> dict:
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
    top1, cause_ok, alarm = judge(kind, truth, d)
    row = {"run": name, "kind": kind, "layout": lay, "truth": truth, "magnitude": mag,
           "verdict": d.localization.verdict, "basis": d.localization.basis, "ours": d.localization.culprit_rank,
           "cause": d.cause.kind, "ours_top1": top1, "ours_cause": cause_ok, "ours_alarm": alarm,
           "headline": d.headline, "flat": flat, "flat_top1": flat in truth, "flat_alarm": flat is not None,
           "overrun": overrun_share(run)}
    if hta_py is not None:
        row["hta"], row["hta_error"] = hta_prediction(hta_py, run)
        row["hta_top1"], row["hta_alarm"] = row["hta"] in truth, row["hta"] is not None
    return row


if __name__ == "__main__":
    main()
