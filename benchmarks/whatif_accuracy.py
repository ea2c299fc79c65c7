"""What-if accuracy on paired reference-trainer runs: does healing the fault in the replay predict the
run without the fault?

    python benchmarks/whatif_accuracy.py --steps 5 --clean-repeats 2   # the grid below (19 runs)
    python benchmarks/whatif_accuracy.py --out runs/wia --clean-repeats 2 --rejudge   # re-score kept runs

Every run is a profiled gloo run of the reference trainer with an emulated device (reference_trainer/
device.py: compute takes the time a device would need, with 2% jitter per span), the same seed and
config within a layout. Per pair: the faulty run is replayed as recorded (the replay must reproduce
its measured step) and with the fault healed (``--heal rank=R`` for slow and moving ranks, ``--heal
link=A,B`` for a slow link); the prediction is compared with the measured step of the clean run of
the same layout (``--clean-repeats`` clean runs per layout, shared by its pairs; their median step).
The CP-imbalance pair is compared with the same data under ``--cp-sharding document`` (per-document
CP sharding, WLB-LLM): predicted with the per-document sharding what-if (and ``--balance cp``), and
as a gain (the measured sequence-sharded step minus the prediction, against minus the measured
document-sharded step).
Printed: one row per run with measured, replayed, predicted and clean step times (ms) and the errors.
"""

from __future__ import annotations

import argparse
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


def analyse(run: Path, whatif: str | None):
    import tracekit
    from tracekit.analysis.whatif import analyze
    from tracekit.ingest import ingest

    store = run.parent / f"{run.name}.tracekit.duckdb"
    ingest([run], store, workers=1)
    s = tracekit.open(store)
    try:
        tables = s.run_tables(None)
    finally:
        s.close()
    if whatif == "document":  # per-document CP sharding (WLB-LLM), and balancing CP for comparison
        return analyze(tables, balance=("cp",), wlb=True, decompose=False)
    return analyze(tables, heal=(whatif,) if whatif else (), decompose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--rejudge", action="store_true", help="analyse the runs already in --out")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per run")
    ap.add_argument("--clean-repeats", type=int, default=1, help="runs of each reference (clean) configuration")
    ap.add_argument("--stat", choices=sorted(STATS), default="min", help="a run's step time in the table")
    args = ap.parse_args()
    from tracekit.demo_run import DEMO_CONFIG, FaultSpec, Scenario, run_scenarios

    out = args.out or Path(tempfile.mkdtemp(prefix="tk-whatif-"))
    runs = [(n, lay, spec, {}) for n, lay, spec, _, _ in PAIRS] + [
        (r, lay, spec, extra) for n, lay, spec, extra in EXTRA for r in repeats(n, args.clean_repeats)]
    t0 = time.time()
    if not args.rejudge:
        print(f"{len(runs)} runs into {out}", flush=True)
        scenarios = [Scenario({**DEMO_CONFIG, **LAYOUTS[lay], **extra, "steps": args.steps, "profile_memory": False},
                              str(out / name), (FaultSpec(spec),) if spec else ()) for name, lay, spec, extra in runs]
        for i in range(0, len(scenarios), 8):  # one spawned world trains up to 8 runs
            run_scenarios(scenarios[i:i + 8])
            print(f"trained {min(i + 8, len(scenarios))}/{len(scenarios)} ({time.time() - t0:.0f} s)", flush=True)
    ref = {r: analyse(out / r, None) for name, *_ in EXTRA for r in repeats(name, args.clean_repeats)}
    faulty = {name: analyse(out / name, whatif) for name, _, _, whatif, _ in PAIRS}
    tables = {stat: rows_for(stat, faulty, ref, args.clean_repeats) for stat in STATS}
    spread = {n: np.concatenate([ref[r].per_step["measured_ns"].to_numpy() for r in repeats(n, args.clean_repeats)])
              for n, *_ in EXTRA}
    print()
    print(f"step times: {args.stat} over the profiled steps (clean: over every step of its repeats), ms; "
          "replay err: the worst step's")
    print(table(tables[args.stat]))
    for stat, rows in tables.items():
        print(f"[{stat}] " + summary(rows).replace("; CP", "\n[" + stat + "] CP"))
    print("noise floor, the reference runs' steps (min / median / max ms): " + "; ".join(
        f"{n} {v.min() / 1e6:.0f} / {np.median(v) / 1e6:.0f} / {v.max() / 1e6:.0f}" for n, v in spread.items()))
    degrees = next(w.data.per_step for w in faulty.values() if w.data is not None)
    print("WLB imbalance degrees of the CP-imbalance run, per step (before -> after):")
    with pl.Config(tbl_cols=-1, tbl_width_chars=160):
        print(degrees)
    print(f"{len(faulty) + len(ref)} runs analysed in {time.time() - t0:.0f} s")


# Contention from the shared machine only ever adds time, so the least disturbed step (min) is the
# usual estimate of a run's undisturbed step; the median is shown too.
STATS = {"median": np.median, "min": np.min}


def rows_for(stat: str, faulty: dict, ref: dict, n_repeats: int) -> list[tuple]:
    f = STATS[stat]
    rows = []
    for name, lay, spec, whatif, twin in PAIRS:
        w = faulty[name]
        clean = float(f(np.concatenate([ref[r].per_step["measured_ns"].to_numpy() for r in repeats(twin, n_repeats)])))
        for sc in w.scenarios[1:][::-1]:  # the what-if asked for first, then balance cp (document pair)
            col = f"{sc.name.replace(' ', '_')}_ns"
            rows.append((name, whatif if sc is w.scenarios[-1] else sc.name, float(f(w.per_step["measured_ns"].to_numpy())),
                         replay_err(w), float(f(w.per_step[col].to_numpy())), clean, float(f(w.per_step["ideal_ns"].to_numpy())), twin))
    for name, w in ref.items():
        rows.append((name, "-", float(f(w.per_step["measured_ns"].to_numpy())), replay_err(w), float("nan"), float("nan"),
                     float(f(w.per_step["ideal_ns"].to_numpy())), "-"))
    return rows


def replay_err(w) -> float:
    """The worst step's replay-as-recorded error."""
    return float((w.per_step["replay_ns"] / w.per_step["measured_ns"] - 1).abs().max())


def table(rows) -> str:
    head = (f"{'run':22s} {'what-if':24s} {'measured':>9s} {'replay err':>10s} {'predicted':>9s} "
            f"{'clean':>9s} {'err':>6s} {'ideal':>9s}  compared with")
    lines = [head, "-" * len(head)]
    for name, whatif, meas, e_rep, pred, clean, ideal, twin in rows:
        e_pred = pred / clean - 1 if clean == clean else float("nan")
        lines.append(f"{name:22s} {whatif:24s} {meas / 1e6:9.1f} {e_rep:10.2%} "
                     + (f"{pred / 1e6:9.1f} {clean / 1e6:9.1f} {e_pred:+6.1%} " if e_pred == e_pred
                        else f"{'':9s} {'':9s} {'':6s} ")
                     + f"{ideal / 1e6:9.1f}  {twin}")
    return "\n".join(lines)


def summary(rows) -> str:
    errs = [abs(r[4] / r[5] - 1) for r in rows if r[5] == r[5] and r[1] != "balance cp"]  # balance cp: a contrast
    rep = [r[3] for r in rows]
    out = [f"healthy-step prediction: {sum(e <= 0.05 for e in errs)}/{len(errs)} within 5% "
           f"(median |err| {sorted(errs)[len(errs) // 2]:.1%}, max {max(errs):.1%}); replay as recorded: "
           f"{sum(e <= 0.03 for e in rep)}/{len(rep)} within 3% (max |err| {max(rep):.2%})"]
    for _, whatif, meas, _, pred, doc, _, _ in [r for r in rows if r[1] in ("document", "balance cp")]:
        g_pred, g_meas = meas - pred, meas - doc
        out.append(f"CP imbalance: predicted gain ({whatif}) {g_pred / 1e6:.1f} ms, measured gain of "
                   f"--cp-sharding document {g_meas / 1e6:.1f} ms ({g_pred / g_meas - 1:+.1%})")
    return "; ".join(out)


if __name__ == "__main__":
    main()
