"""What-if accuracy on paired reference-trainer runs: does healing the fault in the replay predict the
run without the fault?

    python benchmarks/whatif_accuracy.py --steps 6 --warmup 1 --clean-repeats 3   # the grid below (23 runs)
    python benchmarks/whatif_accuracy.py --out runs/wia --clean-repeats 3 --warmup 1 --rejudge   # re-score kept runs

Every run is a profiled gloo run of the reference trainer with an emulated device (reference_trainer/
device.py: compute takes the time a device would need, with 2% jitter per span), the same seed and
config within a layout. Per pair: the faulty run is replayed as recorded (the replay must reproduce
its measured step) and with the fault healed (``--heal rank=R`` for slow and moving ranks, ``--heal
link=A,B`` for a slow link); the prediction is compared with the clean run of the same layout
(``--clean-repeats`` clean runs per layout, trained interleaved with its faulty runs so that both see
the machine's load of the same minutes). The CP-imbalance pair is compared with the same data under
``--cp-sharding document`` (per-document CP sharding, WLB-LLM), also as a gain (the sequence-sharded
step minus the prediction, against minus the measured document-sharded step).

Two statistics, both over the steady steps (the first ``--warmup`` profiled steps dropped):
- steady: every op at its median over the steps, composed along the recorded dependencies (the
  replay of the run as recorded reproduces every measured step, so this is the run's own typical
  step); the what-if is applied to the faulty run's steady step; the clean reference is the median
  of its repeats' steady steps. The machine's disturbances land on different ops in different
  steps, and an op's median drops them.
- min: the least disturbed step (contention only adds time); per-step what-ifs, their least
  disturbed step, against the least disturbed step of the clean repeats.
The noise floor is how far the clean repeats themselves spread (max / min - 1 over the repeats' own
statistic): a prediction cannot be judged finer than that.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

LAYOUTS = {
    "tp2dp2": {"tp": 2, "cp": 1, "pp": 1, "dp": 2},
    "pp2dp2": {"tp": 1, "cp": 1, "pp": 2, "dp": 2},
    "cp2dp2": {"tp": 1, "cp": 2, "pp": 1, "dp": 2},
}
# name, layout, fault spec, what-if (heal spec, or "balance cp"), the run it is compared with
PAIRS = [
    ("slow_r1_x1.5", "tp2dp2", "slow:rank=1,factor=1.5", "rank=1", "clean_tp2dp2"),
    ("slow_r3_x2", "tp2dp2", "slow:rank=3,factor=2", "rank=3", "clean_tp2dp2"),
    ("slow_r0_x1.25", "tp2dp2", "slow:rank=0,factor=1.25", "rank=0", "clean_tp2dp2"),
    ("moving_r1+2_x2", "tp2dp2", "moving:ranks=1+2,factor=2", "rank=1+2", "clean_tp2dp2"),
    ("link_0-2_30ms", "tp2dp2", "link:a=0,b=2,delay_ms=30", "link=0,2", "clean_tp2dp2"),
    ("link_0-1_20ms", "tp2dp2", "link:a=0,b=1,delay_ms=20", "link=0,1", "clean_tp2dp2"),
    ("pp_slow_r0_x1.5", "pp2dp2", "slow:rank=0,factor=1.5", "rank=0", "clean_pp2dp2"),
    ("pp_slow_r3_x2", "pp2dp2", "slow:rank=3,factor=2", "rank=3", "clean_pp2dp2"),
    ("pp_link_0-1_30ms", "pp2dp2", "link:a=0,b=1,delay_ms=30", "link=0,1", "clean_pp2dp2"),
    ("cp_slow_r2_x1.5", "cp2dp2", "slow:rank=2,factor=1.5", "rank=2", "clean_cp2dp2"),
    ("cp_imbalance_r1", "cp2dp2", "cp_imbalance:ranks=1,weight=1.0", "document", "cp_imbalance_document"),
]
EXTRA = [  # the runs pairs are compared with (each trained --clean-repeats times, same seed)
    ("clean_tp2dp2", "tp2dp2", "", {}),
    ("clean_pp2dp2", "pp2dp2", "", {}),
    ("clean_cp2dp2", "cp2dp2", "", {}),
    ("cp_imbalance_document", "cp2dp2", "cp_imbalance:ranks=1,weight=1.0", {"cp_sharding": "document"}),
]


def repeats(name: str, n: int) -> list[str]:
    return [name] + [f"{name}_r{k}" for k in range(1, n)]


def analyse(run: Path, whatif: str | None, warmup: int):
    import tracekit
    from tracekit.analysis.whatif import analyze
    from tracekit.ingest import ingest

    store = run.parent / f"{run.name}.tracekit.duckdb"
    if not store.exists() or store.stat().st_mtime < (run / "manifest.json").stat().st_mtime:  # kept, or retrained
        store.unlink(missing_ok=True)
        ingest([run], store, workers=1)
    s = tracekit.open(store)
    try:
        tables = s.run_tables(None)
    finally:
        s.close()
    if whatif == "document":  # per-document CP sharding (WLB-LLM), and balancing CP for comparison
        return analyze(tables, balance=("cp",), wlb=True, decompose=False, warmup=warmup)
    return analyze(tables, heal=(whatif,) if whatif else (), decompose=False, warmup=warmup)


def run_order(n_repeats: int) -> list[tuple[str, str, str, dict]]:
    """Each layout's runs in one block, its reference runs spread among its faulty runs."""
    out = []
    for lay in LAYOUTS:
        faulty = [(n, lay, spec, {}) for n, l, spec, _, _ in PAIRS if l == lay]
        refs = [(r, lay, spec, extra) for n, l, spec, extra in EXTRA if l == lay for r in repeats(n, n_repeats)]
        every = max(1, len(faulty) // max(1, len(refs) - 1)) if refs else len(faulty)
        while refs or faulty:
            if refs:
                out.append(refs.pop(0))
            out += faulty[:every]
            faulty = faulty[every:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--rejudge", action="store_true", help="analyse the runs already in --out")
    ap.add_argument("--steps", type=int, default=6, help="profiled steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="profiled steps left out of both statistics")
    ap.add_argument("--clean-repeats", type=int, default=3, help="runs of each reference (clean) configuration")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="N processes spinning on the CPU while training (a more loaded machine, reproducibly)")
    args = ap.parse_args()
    from tracekit.demo_run import DEMO_CONFIG, FaultSpec, Scenario, run_scenarios

    out = args.out or Path(tempfile.mkdtemp(prefix="tk-whatif-"))
    runs = run_order(args.clean_repeats)
    t0 = time.time()
    if not args.rejudge:
        print(f"{len(runs)} runs into {out}: " + ", ".join(r[0] for r in runs), flush=True)
        scenarios = [Scenario({**DEMO_CONFIG, **LAYOUTS[lay], **extra, "steps": args.steps, "profile_memory": False},
                              str(out / name), (FaultSpec(spec),) if spec else ()) for name, lay, spec, extra in runs]
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.background_load)]
        try:
            for i in range(0, len(scenarios), 8):  # one spawned world trains up to 8 runs, one after another
                run_scenarios(scenarios[i:i + 8])
                print(f"trained {min(i + 8, len(scenarios))}/{len(scenarios)} ({time.time() - t0:.0f} s, load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
        finally:
            for sp in spinners:
                sp.kill()
                sp.wait()
    ref = {r: analyse(out / r, None, args.warmup) for name, *_ in EXTRA for r in repeats(name, args.clean_repeats)}
    faulty = {name: analyse(out / name, whatif, args.warmup) for name, _, _, whatif, _ in PAIRS}
    rows = rows_for(faulty, ref, args.clean_repeats, args.warmup)
    print()
    print(f"step times, ms, over the steady steps (profiled steps {args.warmup + 1}-{args.steps}); replay err: the "
          "worst step's; steady: each op at its median over the steps; min: the least disturbed step")
    print(table(rows))
    print(summary(rows))
    print("noise floor, the clean repeats' spread (max / min - 1 of their own steady | min | median step): " + "; ".join(
        f"{n} {floor(ref, n, args.clean_repeats, args.warmup)}" for n, *_ in EXTRA))
    degrees = next(w.data.per_step for w in faulty.values() if w.data is not None)
    print("WLB imbalance degrees of the CP-imbalance run, per step (before -> after):")
    with pl.Config(tbl_cols=-1, tbl_width_chars=160):
        print(degrees)
    print(f"{len(faulty) + len(ref)} runs analysed in {time.time() - t0:.0f} s")


def steady_steps(w, warmup: int) -> pl.DataFrame:
    return w.per_step.sort("step").slice(warmup)


def clean_stats(ref: dict, twin: str, n_repeats: int, warmup: int) -> tuple[float, float, float]:
    """(median of the repeats' steady steps, least disturbed measured step, median measured step)."""
    reps = [ref[r] for r in repeats(twin, n_repeats)]
    meas = np.concatenate([steady_steps(w, warmup)["measured_ns"].to_numpy() for w in reps])
    return float(np.median([w.steady_ns for w in reps])), float(meas.min()), float(np.median(meas))


def floor(ref: dict, twin: str, n_repeats: int, warmup: int) -> str:
    reps = [ref[r] for r in repeats(twin, n_repeats)]
    per = [np.array([w.steady_ns for w in reps])] + [
        np.array([f(steady_steps(w, warmup)["measured_ns"].to_numpy()) for w in reps]) for f in (np.min, np.median)]
    return " | ".join(f"{v.max() / v.min() - 1:.1%}" for v in per)


def rows_for(faulty: dict, ref: dict, n_repeats: int, warmup: int) -> list[dict]:
    rows = []
    for name, lay, spec, whatif, twin in PAIRS:
        w = faulty[name]
        c_steady, c_min, c_med = clean_stats(ref, twin, n_repeats, warmup)
        st = steady_steps(w, warmup)
        for sc in w.scenarios[1:][::-1]:  # the what-if asked for first, then balance cp (document pair)
            col = f"{sc.name.replace(' ', '_')}_ns"
            rows.append({"run": name, "whatif": whatif if sc is w.scenarios[-1] else sc.name,
                         "measured": float(np.median(st["measured_ns"])), "replay_err": replay_err(w),
                         "faulty_steady": w.steady_ns, "faulty_min": float(st["nodelay_ns"].min()),
                         "pred_steady": sc.steady_ns, "clean_steady": c_steady,
                         "pred_min": float(st[col].min()), "clean_min": c_min, "clean_median": c_med, "twin": twin})
    for name, w in ref.items():
        st = steady_steps(w, warmup)
        rows.append({"run": name, "whatif": "-", "measured": float(np.median(st["measured_ns"])),
                     "replay_err": replay_err(w), "faulty_steady": w.steady_ns, "faulty_min": float(st["measured_ns"].min()),
                     "twin": "-"})
    return rows


def replay_err(w) -> float:
    """The worst step's replay-as-recorded error."""
    return float((w.per_step["replay_ns"] / w.per_step["measured_ns"] - 1).abs().max())


def table(rows: list[dict]) -> str:
    head = (f"{'run':24s} {'what-if':22s} {'measured':>8s} {'replay':>7s} | {'steady':>7s} {'clean':>7s} {'err':>6s} "
            f"| {'min':>7s} {'clean':>7s} {'err':>6s} | {'vs clean median':>15s}  compared with")
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['run']:24s} {r['whatif']:22s} {r['measured'] / 1e6:8.1f} {r['replay_err']:7.2%} | "
        if "pred_steady" in r:
            line += (f"{r['pred_steady'] / 1e6:7.1f} {r['clean_steady'] / 1e6:7.1f} "
                     f"{r['pred_steady'] / r['clean_steady'] - 1:+6.1%} | "
                     f"{r['pred_min'] / 1e6:7.1f} {r['clean_min'] / 1e6:7.1f} {r['pred_min'] / r['clean_min'] - 1:+6.1%} | "
                     f"{r['pred_steady'] / r['clean_median'] - 1:+15.1%}  {r['twin']}")
        else:
            line += f"{r['faulty_steady'] / 1e6:7.1f} {'':7s} {'':6s} | {r['faulty_min'] / 1e6:7.1f}"
        lines.append(line)
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    pairs = [r for r in rows if "pred_steady" in r and r["whatif"] != "balance cp"]  # balance cp: a contrast
    rep = [r["replay_err"] for r in rows]
    out = [f"replay as recorded: {sum(e <= 0.03 for e in rep)}/{len(rep)} within 3% (max |err| {max(rep):.2%})"]
    for stat, ref in (("steady", "clean_steady"), ("min", "clean_min"), ("steady vs clean median", "clean_median")):
        pred = "pred_min" if stat == "min" else "pred_steady"
        errs = sorted(abs(r[pred] / r[ref] - 1) for r in pairs)
        out.append(f"[{stat}] healthy-step prediction: {sum(e <= 0.05 for e in errs)}/{len(errs)} within 5% "
                   f"(median |err| {errs[len(errs) // 2]:.1%}, max {errs[-1]:.1%})")
    for r in [r for r in rows if r["whatif"] in ("document", "balance cp")]:
        for stat in ("steady", "min"):
            base, pred, doc = r[f"faulty_{stat}"], r[f"pred_{stat}"], r[f"clean_{stat}"]
            g_pred, g_meas = base - pred, base - doc
            out.append(f"[{stat}] CP imbalance: predicted gain ({r['whatif']}) {g_pred / 1e6:.1f} ms, measured gain of "
                       f"--cp-sharding document {g_meas / 1e6:.1f} ms ({g_pred / g_meas - 1:+.1%})")
    return "\n".join(out)


if __name__ == "__main__":
    main()
