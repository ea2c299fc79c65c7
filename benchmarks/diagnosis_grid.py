"""The diagnosis benchmark: a fault grid of simulated NCCL jobs (tracekit/simulate), each through
the real ingest and ``store.diagnose``, judged against the manifest's ground truth.

    python benchmarks/diagnosis_grid.py                 # the full grid (>= 150 cases)
    python benchmarks/diagnosis_grid.py --quick         # about 30 cases
    python benchmarks/diagnosis_grid.py --kinds slow --seeds 3 --show-wrong

The grid varies, case by case: layouts with each of TP (to 8), CP (to 4), PP (to 8) and DP (to 8) at
1 and above 1; group names as DeviceMesh records them (mesh_tp ...), plain (tp, or Megatron's
tensor_model_parallel ...) or none ('undefined': the groups give the strides, but which dimension is
which can be a guess, which ingest warns about; such cases need the rank right, and the coordinates
only where the layout was not ambiguous); kernel noise 2-15% and deschedule spikes; host clocks
skewed up to 2 s and drifting; faults: one slow rank (1.03-2x), two slow ranks, transient (2 of 8
steps), moving, slow collective link, slow p2p link, CP data imbalance, stage imbalance, hang, and
clean runs; apart from those, clean runs whose healthy chips differ (``chips``: each rank's compute
off by a lognormal factor of sd 0.5% or 1% for the whole run, as real fleets' chips are), which is
what any lower bar for a 3% rank would cost; and slow hosts (``host``: every rank of one host
1.1-1.5x, in layouts of two hosts or more); half of the job profiled (``untraced``: the traces of
the first or second half of the ranks removed, their flight recorder kept; a 1.1-1.5x rank among
them, or nothing); jobs numbered PP-outermost (``order``: torchtitan's and Megatron-LM's rank order,
layouts with PP and DP above 1, each with a slow rank, two, a transient, a DP or p2p link, or
nothing, judged as that kind and by the order found as well); with ``--native``, torch-native jobs too
(benchmarks/native_accuracy.py), reported apart. Judged (rank and coordinates both right):
- slow: a straggler finding names the rank, and the store's layout is the true one (so its
  coordinates are right); two: both ranks are named as stragglers;
- transient: the rank is named with exactly the slow steps; moving: the verdict is moving;
- link: a slow-link finding names both ends (and, for a collective link, the group's dimension);
- cp_imbalance: a data-imbalance finding within the loaded CP ranks; stage: the stage is named;
- hang: no performance verdict, and ``hangs`` names the stuck rank alone;
- clean and chips: no finding at all (anything else is a false alarm; for chips, each named rank's
  own chip is printed in sds of the spread, since a chip 3 sd out is a slower chip);
- host: one finding, a straggler naming every rank of the host, and nothing else; untraced: one
  straggler finding naming the slow rank alone (nothing on a clean run); in every kind, a finding beside the
  fault's own (a bystander named slow) makes the answer wrong.
Printed: accuracy per kind (with a 95% Wilson lower bound), the false-alarm rate on clean runs, a
calibration table (confidence bucket: findings, share right), time and peak memory. Holistic Trace
Analysis' ``get_potential_stragglers`` always returns k ranks and has no notion of hangs, links or
"no straggler"; with ``--hta`` it is run on the slow-rank cases (own venv, see ingest_vs_hta).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from grid_cases import CHIP_SPREADS, KINDS, Case, make_cases  # noqa: E402

HTA_KINDS = ("slow", "slow3", "two", "clean")


def hta_answer(hta_python: Path, traces: Path) -> dict:
    """Holistic Trace Analysis' ``get_potential_stragglers(num_candidates=1)`` on the traces."""
    from localize_accuracy import HTA_STRAGGLERS

    out = subprocess.run([str(hta_python), "-c", HTA_STRAGGLERS, str(traces)], capture_output=True, text=True,
                         timeout=600)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": (out.stderr or out.stdout)[-300:]}


def run_case(case: Case, work: Path, cache: Path | None, hta_python: Path | None = None,
             tunables: dict | None = None) -> dict:
    """Simulate, ingest (both kept in ``cache`` when given, so a re-run re-judges the analysis
    alone) and diagnose one case."""
    import hashlib

    import tracekit
    from tracekit.analysis.tunables import Tunables
    from tracekit.ingest import ingest
    from tracekit.simulate.config import SimConfig
    from tracekit.simulate.run import simulate

    tp, cp, pp, dp = case.layout
    key = hashlib.sha1(case.label.encode()).hexdigest()[:16]
    keep = cache / key if cache else work / "case"
    store, truth = keep / "s.duckdb", keep / "truth.json"
    want_traces = hta_python is not None and case.kind in HTA_KINDS
    from tracekit.store import StoreError

    fresh = cache and store.exists() and truth.exists() and not (want_traces and not (keep / "run").exists())
    if fresh:
        try:
            tracekit.open(store).close()
        except StoreError:  # written by an older tracekit: simulate and ingest again
            fresh = False
    if not fresh:
        shutil.rmtree(keep, ignore_errors=True)
        out = keep / "run"
        mb, vstages, layers, per_host = case.schedule or (0, 1, 4, 8)
        cfg = SimConfig(tp=tp, cp=cp, pp=pp, dp=dp, steps=8, seed=case.seed, faults=case.faults, names=case.names,
                        noise=case.noise, spikes=case.spikes, skew_ms=case.skew_ms, drift_ppm=case.drift_ppm,
                        layers=layers, microbatches=mb, vstages=vstages, ranks_per_host=per_host,
                        chip_spread=case.chips, **({"order": case.order} if case.order else {}),
                        # a host's ranks are known from the profiler's own file names (the manifest is
                        # set aside): the slow-host cases are named so, the published cases as they were
                        trace_names="profiler" if case.kind == "host" or case.profiler_names else "rank")
        simulate(cfg, out)
        for r in case.untraced:  # profiled ranks only: the others keep their flight recorder
            (out / "traces" / f"rank{r}.json.gz").unlink()
        pending = keep / "truth.pending"  # judge from the traces alone, not the manifest
        (out / "manifest.json").rename(pending)
        store.unlink(missing_ok=True)
        ingest([out], store, workers=1)
        pending.rename(truth)  # last: a case stopped halfway is done again
        if not want_traces:
            shutil.rmtree(out)
    manifest = json.loads(truth.read_text())
    with tracekit.open(store) as s:
        d = s.diagnose(tunables=Tunables(**(tunables or {})))
        runs = s.table("runs").row(0, named=True)
        h = s.hangs()
        note = s.sql("SELECT error FROM ingest_log WHERE status = 'warning' AND error LIKE 'layout %'")
        order = list(s.run_tables().layout.order)
    return {"diagnosis": d.to_dict(), "layout": [runs[x] for x in ("tp", "cp", "pp", "dp")], "order": order,
            "layout_note": note["error"][0] if note.height else None,
            "layout_source": runs["layout_source"], "hang_culprits": list(h.culprits), "truth": manifest["faults"],
            "chips": manifest.get("simulated", {}).get("chips", {}).get("factors"),
            "hta": hta_answer(hta_python, keep / "run" / "traces") if want_traces else None}


def judge(case: Case, res: dict) -> tuple[bool, list[tuple[float, bool]]]:
    """(right, [(confidence, right) per finding]) for the calibration table."""
    d = res["diagnosis"]
    fs = d["findings"]
    verdict = d["localization"]["verdict"]
    # without group names the dimensions' names can be a guess (ingest warns): then the rank must be
    # right, and the coordinates only where the layout was not ambiguous
    if case.kind == "order":  # judged as the kind it injects, in a layout that must be found in its order
        as_kind = replace(case, kind=case.truth["as"], order=())
        if tuple(res.get("order") or ()) != case.order and not (case.names == "none" and res.get("layout_note")):
            res = {**res, "layout": None}
        return judge(as_kind, res)
    layout_ok = tuple(res["layout"] or ()) == case.layout or (case.names == "none" and bool(res.get("layout_note")))
    t = case.truth
    strag = {f["ranks"][0] for f in fs if f["kind"] == "straggler"}
    ok_finding = [False] * len(fs)
    if case.kind == "clean":
        return not fs and verdict != "hang", [(f["confidence"], False) for f in fs]
    if case.kind == "chips":  # out of the calibration table: a chip drawn 3 sd out is a slower chip
        return not fs and verdict != "hang", []
    if case.kind == "host":  # one finding, of the host: every rank of it, nothing else
        ok = [f["kind"] == "straggler" and sorted(f["ranks"]) == t["ranks"] and "host" in f["where"] for f in fs]
        return len(fs) == 1 and ok[0], [(f["confidence"], x) for f, x in zip(fs, ok)]
    if case.kind == "hang":
        return verdict == "hang" and res["hang_culprits"] == t["ranks"], []
    if case.kind == "untraced":  # the slow rank alone, by whatever evidence; a clean run, nothing
        ok = [f["kind"] == "straggler" and f["ranks"] == t.get("ranks") and layout_ok for f in fs]
        right = all(ok) and len(fs) == (1 if t else 0) and verdict != "hang"
        return right, [(f["confidence"], x) for f, x in zip(fs, ok)]
    for i, f in enumerate(fs):
        rs = set(f["ranks"])
        if case.kind in ("slow", "slow3", "two"):
            ok_finding[i] = f["kind"] == "straggler" and rs <= set(t["ranks"]) and layout_ok
        elif case.kind == "transient":
            ok_finding[i] = f["kind"] in ("transient", "straggler") and rs == set(t["ranks"]) and \
                sorted(f["steps"]) == t["steps"] and layout_ok
        elif case.kind == "moving":
            ok_finding[i] = f["kind"] in ("moving", "transient") and rs <= set(t["ranks"])
        elif case.kind in ("link_coll", "link_p2p"):
            # without group names, which dimension a group is can be a guess (ingest warns): then
            # both ends must be right, and the dimension only where the layout was not ambiguous
            ok_finding[i] = f["kind"] == "slow_link" and rs == set(t["ranks"]) and \
                (case.kind == "link_p2p" or t["dim"].upper() in f["where"]
                 or (case.names == "none" and bool(res.get("layout_note"))))
        elif case.kind == "cp_imbalance":
            loaded = set(res["truth"][0]["ranks"])
            ok_finding[i] = f["cause"] == "data_imbalance" and rs <= loaded and bool(rs)
        elif case.kind == "stage":
            ok_finding[i] = f["kind"] == "stage_imbalance" and f"stage {t['pp']}" in f["where"]
    if case.kind in ("slow", "slow3", "two"):
        right = strag == set(t["ranks"]) and all(ok_finding)
    elif case.kind == "transient":
        right = any(ok_finding) and all(ok_finding)
    elif case.kind == "moving":
        right = verdict == "moving" or (len({r for f, ok in zip(fs, ok_finding) if ok for r in f["ranks"]}) >= 2
                                        and all(ok_finding))
    else:
        right = any(ok_finding) and all(ok_finding)  # a straggler named beside it is a wrong answer too
    return right, [(f["confidence"], ok) for f, ok in zip(fs, ok_finding)]


def print_calibration(pairs: list[tuple[float, bool]], noun: str) -> None:
    """A calibration table: per confidence bucket, how many ``noun`` and the share right."""
    print(f"| confidence | {noun} | right | share right |")
    print("|---|---|---|---|")
    for lo, hi in ((0, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 0.97), (0.97, 1.01)):
        b = [ok for c, ok in pairs if lo <= c < hi]
        if b:
            print(f"| [{lo:.2f}, {min(hi, 1):.2f}) | {len(b)} | {sum(b)} | {sum(b) / len(b):.1%} |")


def print_accuracy(noun: str, order, per: dict[str, list[bool]], total: bool = False) -> None:
    """Right per ``noun`` (kind, mix) in ``order``, with a 95% Wilson lower bound; ``total``: a row for all."""
    print(f"| {noun} | cases | right | share | 95% lower bound |")
    print("|---|---|---|---|---|")
    rows = [(k, per[k]) for k in order if per.get(k)]
    if total:
        rows.append(("all", [x for _, v in rows for x in v]))
    for k, v in rows:
        print(f"| {k} | {len(v)} | {sum(v)} | {sum(v) / len(v):.1%} | {wilson_low(sum(v), len(v)):.1%} |")


NOISE_KINDS = ("slow", "slow3")  # where the kernel noise decides: a small slowdown under a large scatter


def print_by_noise(per: dict[tuple[str, float], list[bool]]) -> None:
    """Right per slow-rank kind and kernel noise: where the misses of a small slowdown sit."""
    noises = sorted({n for _, n in per})
    kinds = [k for k in NOISE_KINDS if any(kk == k for kk, _ in per)]
    if not kinds:
        return
    print("\n| kind | " + " | ".join(f"noise {n:.0%}" for n in noises) + " |")
    print("|---|" + "---|" * len(noises))
    for k in kinds:
        cells = [f"{sum(v)}/{len(v)}" if (v := per.get((k, n))) else "-" for n in noises]
        print(f"| {k} | " + " | ".join(cells) + " |")


def print_chips(cases: list[Case], results: list[dict]) -> None:
    """Clean runs whose chips differ: runs naming a rank per spread, and where each named rank's
    own chip sat against the median chip (also in sds of the spread: a chip 3 sd out is a slower
    chip, not noise)."""
    rows = [(c, r) for c, r in zip(cases, results) if c.kind == "chips"]
    if not rows:
        return
    print("\nclean runs whose healthy chips differ (each rank's compute x a lognormal factor of sd tau for the "
          "whole run; not the issue's clean runs):")
    print("| tau | runs | runs naming a rank | each named rank's chip against the median chip (confidence) |")
    print("|---|---|---|---|")
    for spread in CHIP_SPREADS:
        these = [(c, r) for c, r in rows if c.chips == spread]
        named = []
        for c, r in these:
            fs = (r.get("diagnosis") or {}).get("findings", [])
            mid = statistics.median(r["chips"]) if r.get("chips") else float("nan")
            for f in fs:
                for rk in f["ranks"][:4]:
                    off = r["chips"][rk] / mid - 1 if r.get("chips") else float("nan")
                    named.append(f"{off:+.1%} ({math.log(1 + off) / spread:+.1f} sd, {f['confidence']:.2f})")
        alarms = sum(not r["right"] for _, r in these)
        print(f"| {spread:.1%} | {len(these)} | {alarms} ({alarms / max(len(these), 1):.1%}) | "
              f"{', '.join(named) or '-'} |")


def wilson_low(k: int, n: int, z: float = 1.96) -> float:
    if n == 0:
        return float("nan")
    p = k / n
    return (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--draw", type=int, default=0,
                    help="another draw of the same grid (0: the published one): a hold-out check")
    ap.add_argument("--schedules", action="store_true",
                    help="each case draws its micro-batches, virtual stages, layers and ranks per host too")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--show-wrong", action="store_true")
    ap.add_argument("--json", type=Path, help="write every case's result here")
    ap.add_argument("--hta", action="store_true",
                    help="also run Holistic Trace Analysis 0.5.0 on the slow and clean cases (its own venv)")
    ap.add_argument("--native", nargs="*", metavar="LAYOUT",
                    help="also run torch-native jobs (reference_trainer/native_job.py: FSDP2 x DTensor x pipelining, "
                         "gloo, plain profiler) on these dp x pp x tp layouts (none given: all), reported apart")
    ap.add_argument("--cache", type=Path, help="keep each case's store here; a re-run re-judges the analysis only")
    ap.add_argument("--profiler-names", action="store_true",
                    help="name every case's traces as the profiler does (host_pid.ns.pt.trace.json.gz), so that "
                         "each rank's host is known, as in a real job's directory (the published grid names them "
                         "rank<R>; the host kind always uses these names)")
    ap.add_argument("--tunable", action="append", default=[], metavar="NAME=VALUE",
                    help="judge with this analysis setting instead (tracekit.analysis.tunables), e.g. "
                         "culprit_margin_min=2.0: with --cache, what a setting does to every kind, replayed")
    args = ap.parse_args()
    from tracekit.analysis.tunables import Tunables

    tunables = {}
    for item in args.tunable:
        name, _, value = item.partition("=")
        if name not in Tunables.__dataclass_fields__:
            ap.error(f"--tunable {item}: no such setting in tracekit.analysis.tunables.Tunables")
        kind = type(getattr(Tunables(), name))
        try:
            tunables[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
        except ValueError:
            ap.error(f"--tunable {item}: {name} takes a {kind.__name__}")
    cases = make_cases(args.kinds, args.seeds, args.quick, args.draw, args.schedules)
    for case in cases:
        case.profiler_names = args.profiler_names
    hta_python = None
    if args.hta:
        from ingest_vs_hta import ensure_hta

        hta_python = ensure_hta()
    hta: dict[str, list[bool | None]] = defaultdict(list)
    per_kind: dict[str, list[bool]] = defaultdict(list)
    per_noise: dict[tuple[str, float], list[bool]] = defaultdict(list)  # slow-rank kinds by kernel noise
    calib: list[tuple[float, bool]] = []
    calib_none: list[tuple[float, bool]] = []  # "no straggler" answers: (confidence, right)
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tk-grid-") as tmp:
        for i, case in enumerate(cases):
            try:
                res = run_case(case, Path(tmp), args.cache, hta_python, tunables)
                right, cal = judge(case, res)
                if res.get("hta") is not None:
                    h = res["hta"]
                    hta[case.kind].append(None if not h.get("ok") else
                                          (not h["ranks"]) if case.kind == "clean" else
                                          (bool(h["ranks"]) and h["ranks"][0] in case.truth["ranks"]))
            except Exception as e:  # noqa: BLE001 - a crash is a wrong answer, reported
                res, right, cal = {"error": f"{type(e).__name__}: {e}"}, False, []
            per_kind[case.kind].append(right)
            if case.kind in NOISE_KINDS:
                per_noise[(case.kind, case.noise)].append(right)
            calib += cal
            d = res.get("diagnosis")
            if d and not d["findings"] and d["localization"]["verdict"] == "no_straggler":
                calib_none.append((d["localization"]["confidence"], right))
            results.append({"case": case.label, "right": right, **res})
            print(f"[{i + 1}/{len(cases)}] {'ok   ' if right else 'WRONG'} {case.label}", file=sys.stderr, flush=True)
            if not right and args.show_wrong:
                print("    " + (res.get("error") or res["diagnosis"]["headline"])[:400], file=sys.stderr)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n{len(cases)} cases in {wall:.0f} s ({wall / max(len(cases), 1):.2f} s each: simulate, ingest, diagnose); "
          f"peak RSS {peak:.0f} MB\n")
    print_accuracy("kind", KINDS, per_kind)
    print_by_noise(per_noise)
    clean = per_kind.get("clean", [])
    if clean:
        print(f"\nfalse alarms on clean runs: {len(clean) - sum(clean)} of {len(clean)} "
              f"({(len(clean) - sum(clean)) / len(clean):.1%})")
    print_chips(cases, results)
    if hta:
        print("\nHolistic Trace Analysis 0.5.0, get_potential_stragglers(num_candidates=1) (clean: right = no rank):")
        print("| kind | cases | ran | right of those that ran | errors |")
        print("|---|---|---|---|---|")
        for kind, v in hta.items():
            ran = [x for x in v if x is not None]
            print(f"| {kind} | {len(v)} | {len(ran)} | {sum(ran)}/{len(ran)} | {len(v) - len(ran)} |")
    print()
    print_calibration(calib, "findings")
    if calib_none:
        print("\n\"no straggler\" answers (right on clean runs; wrong where a fault was missed):")
        print_calibration(calib_none, "answers")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.native is not None:
        import native_accuracy

        print("\ntorch-native jobs (no annotations of ours; one row per run, then the accuracy):")
        native_accuracy.main((["--layouts", *args.native] if args.native else []) + ["--seeds", "0", "1"])


if __name__ == "__main__":
    main()
