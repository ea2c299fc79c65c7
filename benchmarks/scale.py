"""Llama-3 scale: simulate, ingest and `tracekit stragglers` from 64 to 16,384 ranks x 20 steps.

Per world size it prints wall time and peak RSS of each stage, each measured in a fresh process:
- simulate: Kineto traces and flight-recorder dumps for the smallest size (what ingest reads), the
  store's tables straight as a Parquet dataset for the larger ones (16,384 Kineto files would be
  hundreds of GB of JSON);
- ingest, local and on Ray (local mode), where traces were written;
- stragglers from the Parquet dataset to the verdict (the scoped diagnosis, tracekit/analysis/scope.py);
and the accuracy over the fault kinds at each size (one case per kind, judged as
benchmarks/diagnosis_grid.py judges: rank and coordinates right, nothing else named).

    PYTHONPATH=$PWD python benchmarks/scale.py [--sizes 64 1024 4096 16384] [--kinds slow two ...]
        [--steps 20] [--keep DIR] [--json]
    PYTHONPATH=$PWD python benchmarks/scale.py --layouts 1x1x8x128 8x4x1x32 --no-ray   # other layouts (tp x cp x pp x dp)

Kinds a layout cannot hold (a CP imbalance without CP, a p2p link or a stage without PP, a
collective link in a world of one rank a group) are left out of its row.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

LAYOUTS = {64: (8, 2, 2, 2), 1024: (8, 2, 16, 4), 4096: (8, 2, 16, 16), 16384: (8, 2, 16, 64)}  # tp, cp, pp, dp
KINDS = ("clean", "slow", "two", "transient", "moving", "link_coll", "link_p2p", "cp_imbalance", "stage", "hang")
KINETO_UP_TO = 64  # larger worlds: the tables straight

# one process per measurement, so that its peak RSS is its own
MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"s": time.perf_counter() - t, "rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "rc": p.returncode, "out": p.stdout, "err": p.stderr[-2000:]}))
"""


def measure(cmd: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tracekit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from tracekit.cli import main; sys.argv[0] = 'tracekit'; main()", *args]


def fault(kind: str, layout: tuple[int, int, int, int], rng: random.Random) -> tuple[tuple[str, ...], dict]:
    """The fault specs of one case and its truth (diagnosis_grid.judge's form)."""
    from tracekit.topology import Layout

    tp, cp, pp, dp = layout
    lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp)
    world = lay.world_size
    r = rng.randrange(world)
    if kind == "clean":
        return (), {}
    if kind == "slow":
        f = rng.choice([1.05, 1.1, 1.3])
        return (f"slow:rank={r},factor={f}",), {"ranks": [r]}
    if kind == "two":
        a, b = rng.sample(range(world), 2)
        return (f"slow:rank={a},factor=1.2", f"slow:rank={b},factor=1.2"), {"ranks": sorted([a, b])}
    if kind == "transient":
        st = sorted(rng.sample(range(20), 2))
        return (f"slow:rank={r},factor=1.5,steps={st[0]}+{st[1]}",), {"ranks": [r], "steps": st}
    if kind == "moving":
        rs = rng.sample(range(world), 3)
        return (f"moving:ranks={'+'.join(map(str, rs))},factor=1.5",), {"ranks": rs}
    if kind == "link_coll":
        d = rng.choice([x for x in ("tp", "cp", "dp") if getattr(lay, x) > 1])
        g = lay.group(r, d)
        b = rng.choice([x for x in g if x != r])
        return (f"link:a={r},b={b},delay_ms=20",), {"ranks": sorted(g), "dim": d}
    if kind == "link_p2p":
        a = lay.rank_of(**{**lay.coords(r).as_dict(), "pp": rng.randrange(pp - 1)})
        return (f"link:a={a},b={a + lay.stride('pp')},delay_ms=20",), {"ranks": [a, a + lay.stride("pp")]}
    if kind == "cp_imbalance":
        return (f"cp_imbalance:ranks={rng.randrange(cp)},weight=0.8",), {}
    if kind == "stage":
        st = rng.randrange(1, pp)
        return (f"stage:pp={st},factor=1.4",), {"pp": st}
    if kind == "hang":
        return (f"hang:rank={r},step={rng.randrange(2, 18)}",), {"ranks": [r]}
    raise ValueError(kind)


NOISE, SPIKES = 0.05, 0.0005  # kernel noise (lognormal sigma) and deschedule spikes per span (--noise, --spikes)


def simulate_args(layout, steps: int, seed: int, faults, out: Path, fmt: str,
                  noise: float = NOISE, spikes: float = SPIKES) -> list[str]:
    tp, cp, pp, dp = layout
    args = ["simulate", "--tp", str(tp), "--cp", str(cp), "--pp", str(pp), "--dp", str(dp), "--steps", str(steps),
            "--seed", str(seed), "--noise", str(noise), "--spikes", str(spikes), "--skew-ms", "2000", "--drift-ppm", "20",
            "--attn-ms", "4.8", "--mlp-ms", "7.2", "--format", fmt, "--out", str(out)]
    for f in faults:
        args += ["--fault", f]
    return args


def fits(kind: str, layout: tuple[int, int, int, int]) -> bool:
    """Whether a layout can hold a fault kind at all."""
    tp, cp, pp, dp = layout
    needs = {"cp_imbalance": cp > 1, "link_p2p": pp > 1, "stage": pp > 1,
             "link_coll": max(tp, cp, dp) > 1, "two": tp * cp * pp * dp > 1}
    return needs.get(kind, True)


def run_size(layout: tuple[int, int, int, int], kinds: list[str], steps: int, work: Path, ray: bool,
             noise: float = NOISE, spikes: float = SPIKES, seed: int = 0) -> dict:
    from diagnosis_grid import Case, judge

    size = layout[0] * layout[1] * layout[2] * layout[3]
    fmt = "kineto" if size <= KINETO_UP_TO else "parquet"
    rng = random.Random((size if layout == LAYOUTS.get(size) else "x".join(map(str, layout))) if not seed
                        else f"{'x'.join(map(str, layout))}/{seed}")
    row: dict = {"size": size, "layout": layout, "format": fmt, "cases": []}
    for i, kind in enumerate(k for k in kinds if fits(k, layout)):
        faults, truth = fault(kind, layout, rng)
        case_dir = work / f"{'x'.join(map(str, layout))}-{kind}"
        shutil.rmtree(case_dir, ignore_errors=True)
        run = case_dir / "run"
        sim = measure(tracekit_cmd(*simulate_args(layout, steps, 7 * i + size + 1000 * seed, faults, run, fmt,
                                                  noise, spikes)))
        if sim["rc"]:
            raise SystemExit(f"simulate failed ({size} {kind}): {sim['err']}")
        target = run
        ingest = ingest_ray = None
        if fmt == "kineto":
            store = case_dir / "store"
            ingest = measure(tracekit_cmd("ingest", str(run), "--out", str(store)))
            if ray:
                ingest_ray = measure(tracekit_cmd("ingest", str(run), "--engine", "ray", "--out",
                                                  str(case_dir / "store-ray")))
            target = store
        strag = measure(tracekit_cmd("stragglers", str(target), "--json"))
        try:
            res = json.loads(strag["out"])
        except json.JSONDecodeError:
            res = None
        ok = False
        if res is not None:
            manifest = _manifest(run)
            case = Case(kind, layout, 0, faults, "mesh", noise, spikes, 2000.0, 20.0, truth)
            hang = res["stragglers"]["cause"].get("ranks", [])
            ok, _ = judge(case, {"diagnosis": res["stragglers"], "layout": list(layout), "layout_note": None,
                                 "hang_culprits": list(hang), "truth": manifest.get("faults", [])})
        row["cases"].append({"kind": kind, "faults": faults, "right": ok, "simulate": _brief(sim),
                             "ingest": _brief(ingest), "ingest_ray": _brief(ingest_ray), "stragglers": _brief(strag),
                             "headline": (res or {}).get("stragglers", {}).get("headline", strag["err"])[:300]})
        shutil.rmtree(case_dir, ignore_errors=True)
    return row


def _manifest(run: Path) -> dict:
    """The ground truth: the run directory's manifest, or the dataset's runs.manifest."""
    if (run / "manifest.json").exists():
        return json.loads((run / "manifest.json").read_text())
    import tracekit

    with tracekit.open(run) as s:
        return json.loads(s.sql("SELECT manifest FROM runs")["manifest"][0])


def _brief(m: dict | None) -> dict | None:
    return None if m is None else {"s": round(m["s"], 2), "rss_mb": round(m["rss_mb"]), "rc": m["rc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=sorted(LAYOUTS))
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--layouts", nargs="+", default=[], metavar="TPxCPxPPxDP",
                    help="Layouts to run instead of --sizes' (e.g. 1x1x8x128).")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--noise", type=float, default=NOISE, help="Kernel noise, lognormal sigma (default 0.05).")
    ap.add_argument("--spikes", type=float, default=SPIKES, help="Deschedule spikes per span (default 0.0005).")
    ap.add_argument("--seed", type=int, default=0, help="Another draw of faults and noise (default 0: the published one).")
    ap.add_argument("--keep", type=Path, help="Work directory (default: a temporary one).")
    ap.add_argument("--no-ray", action="store_true", help="Skip the Ray ingest.")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="tk-scale-"))
    ray = not a.no_ray
    if ray:
        try:
            import ray as _  # noqa: F401
        except ImportError:
            ray = False
    layouts = [tuple(int(x) for x in spec.split("x")) for spec in a.layouts] or [LAYOUTS[s] for s in a.sizes]
    if any(len(lay) != 4 or min(lay) < 1 for lay in layouts):
        ap.error("--layouts: each is TPxCPxPPxDP, four sizes of at least 1 (e.g. 1x1x8x128)")
    rows = []
    for layout in layouts:
        t = time.perf_counter()
        rows.append(run_size(layout, a.kinds, a.steps, work, ray, a.noise, a.spikes, a.seed))
        print(f"# {'x'.join(map(str, layout))} ({rows[-1]['size']} ranks) done in {time.perf_counter() - t:.0f} s",
              file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("| ranks | layout (tp cp pp dp) | simulate | ingest local | ingest Ray | stragglers (median) | "
          "stragglers (max) | right |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cs = r["cases"]
        med = lambda key: sorted(c[key]["s"] for c in cs if c[key])[len([c for c in cs if c[key]]) // 2] \
            if any(c[key] for c in cs) else None  # noqa: E731
        peak = lambda key: max((c[key]["rss_mb"] for c in cs if c[key]), default=None)  # noqa: E731
        fmt = lambda key: "n/a" if med(key) is None else f"{med(key):.1f} s, {peak(key)} MB"  # noqa: E731
        worst = max(cs, key=lambda c: c["stragglers"]["s"])["stragglers"]
        print(f"| {r['size']:,} | {' '.join(map(str, r['layout']))} | {fmt('simulate')} ({r['format']}) | "
              f"{fmt('ingest')} | {fmt('ingest_ray')} | {fmt('stragglers')} | {worst['s']:.1f} s, {worst['rss_mb']} MB | "
              f"{sum(c['right'] for c in cs)}/{len(cs)} |")
    print()
    print("| ranks | layout | kind | right | stragglers | headline |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for c in r["cases"]:
            print(f"| {r['size']:,} | {' '.join(map(str, r['layout']))} | {c['kind']} | {'yes' if c['right'] else 'NO'} | {c['stragglers']['s']:.1f} s | "
                  f"{c['headline'][:160]} |")


if __name__ == "__main__":
    main()
