"""Two faults at once, which the fault grid (diagnosis_grid.py) injects one at a time: is each named,
and nothing else? Simulated NCCL jobs over the grid's layouts, names, noise, spikes and clocks,
through the real ingest and ``store.diagnose``.

    python benchmarks/diagnosis_mixes.py                 # 9 mixes x 12 layouts x 2 seeds (about 170 cases)
    python benchmarks/diagnosis_mixes.py --draw 1 --mixes slow+cp_imbalance --show-wrong

Mixes (a slow device is 1.1-1.5x in every step):
- slow+link: a slow device and a slow link (collective or p2p, 20 ms) not touching it;
- two+link: two slow devices and such a link;
- slow+link_near: a slow device and a slow link between two other members of its own group;
- slow+transient: a slow device and another rank 2x slow in 2 of 8 steps;
- slow+stage: a slow device and a pipeline stage (not its own) with 1.4x the work;
- slow+cp_imbalance: a slow device and a CP position (not its own) with the long documents;
- slow_on_cp_imbalance: the long documents on the slow device's own CP position;
- moving+link, transient+link: a moving or transient straggler and a slow collective link apart from it;
- two_links: two slow collective links in two groups (20 ms each), no slow device;
- slow+hang: a slow device and another rank that hangs: no performance verdict, the stuck rank alone.
Right: every injected fault has its finding (a straggler per slow device with nothing else named a
straggler; the link with both ends and its group; the transient with its steps; the stage; a data
imbalance; the moving straggler as moving or transient), and no finding of any other kind. Printed:
accuracy per mix (95% Wilson lower bound) and the calibration of findings.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from diagnosis_grid import Case, print_accuracy, print_calibration, run_case  # noqa: E402
from grid_cases import LAYOUTS  # noqa: E402

MIXES = ("slow+link", "two+link", "slow+link_near", "slow+transient", "slow+stage", "slow+cp_imbalance",
         "slow_on_cp_imbalance", "moving+link", "transient+link", "two_links", "slow+hang")


def _links(lay, busy: set[int]) -> list[tuple[int, int, list[int]]]:
    """(a, b, the group that shows it) for every slow link whose group holds none of ``busy``."""
    out = []
    for d in ("tp", "cp", "dp"):
        if getattr(lay, d) > 1:
            for a in range(lay.world_size):
                g = list(lay.group(a, d))
                if not busy & set(g):
                    out += [(a, b, g) for b in g if b != a]
    if lay.pp > 1:
        for a in range(lay.world_size):
            if lay.coords(a).pp < lay.pp - 1 and not busy & {a, a + lay.stride("pp")}:
                out.append((a, a + lay.stride("pp"), [a, a + lay.stride("pp")]))
    return out


def make_case(mix: str, layout: tuple[int, int, int, int], seed: int, rng: random.Random) -> Case | None:
    """One case of ``mix``; None where the layout cannot hold it. Its truth: what must be found."""
    from tracekit.topology import Layout

    tp, cp, pp, dp = layout
    lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp)
    world = lay.world_size
    a = rng.randrange(world)
    f = rng.choice([1.1, 1.3, 1.5])
    faults, truth = [f"slow:rank={a},factor={f}"], {"stragglers": [a]}
    if mix in ("slow+link", "two+link", "moving+link", "transient+link"):
        if mix == "two+link":
            b = rng.choice([r for r in range(world) if r != a])
            faults.append(f"slow:rank={b},factor={f}")
            truth["stragglers"] = sorted([a, b])
        elif mix == "moving+link":
            if world < 4:
                return None
            moving = rng.sample(range(world), 3)
            faults, truth = [f"moving:ranks={'+'.join(map(str, moving))},factor=1.5"], {"moving": moving}
        elif mix == "transient+link":
            st = sorted(rng.sample(range(8), 2))
            faults, truth = [f"slow:rank={a},factor=2.0,steps={st[0]}+{st[1]}"], {"transient": [a], "steps": st}
        busy = set(truth.get("stragglers", truth.get("moving", truth.get("transient", []))))
        links = [x for x in _links(lay, busy) if mix in ("slow+link", "two+link") or len(x[2]) > 2
                 or lay.coords(x[0]).pp == lay.coords(x[1]).pp]
        if not links:
            return None
        x, y, g = rng.choice(links)
        faults.append(f"link:a={x},b={y},delay_ms=20")
        truth["link"] = sorted(g)
    elif mix == "slow+link_near":
        dims = [d for d in ("tp", "cp", "dp") if getattr(lay, d) > 2]
        if not dims:
            return None
        g = list(lay.group(a, rng.choice(dims)))
        x, y = rng.sample([r for r in g if r != a], 2)
        faults.append(f"link:a={x},b={y},delay_ms=20")
        truth["link"] = sorted(g)
    elif mix == "slow+transient":
        b = rng.choice([r for r in range(world) if r != a])
        st = sorted(rng.sample(range(8), 2))
        faults.append(f"slow:rank={b},factor=2.0,steps={st[0]}+{st[1]}")
        truth.update(transient=[b], steps=st)
    elif mix == "slow+stage":
        stage = rng.randrange(1, pp) if pp == 2 else rng.randrange(pp) if pp > 1 else None
        if stage is None or lay.coords(a).pp == stage:
            return None
        faults.append(f"stage:pp={stage},factor=1.4")
        truth["stage"] = stage
    elif mix in ("slow+cp_imbalance", "slow_on_cp_imbalance"):
        c = (rng.randrange(cp) if mix == "slow+cp_imbalance" else lay.coords(a).cp) if cp > 1 else None
        if c is None or (mix == "slow+cp_imbalance" and lay.coords(a).cp == c):
            return None
        faults.append(f"cp_imbalance:ranks={c},weight=0.8")
        truth["data"] = [r for r in range(world) if lay.coords(r).cp == c]
    elif mix == "two_links":
        groups = sorted({tuple(lay.group(r, d)) for d in ("tp", "cp", "dp") if getattr(lay, d) > 1 for r in range(world)})
        pairs = [(g, h) for g in groups for h in groups if g < h and not set(g) & set(h)]
        if not pairs:
            return None
        g, h = rng.choice(pairs)
        faults = [f"link:a={x},b={y},delay_ms=20" for x, y in (rng.sample(g, 2), rng.sample(h, 2))]
        truth = {"stragglers": [], "links": [sorted(g), sorted(h)]}
    elif mix == "slow+hang":
        h = rng.choice([r for r in range(world) if r != a])
        faults.append(f"hang:rank={h},step={rng.randrange(2, 6)}")
        truth = {"hang": [h]}
    names = rng.choice(["mesh", "plain", "none"])
    if names == "plain" and seed % 3 == 2:  # the simulator's plain flavour 2 names nothing ('undefined')
        seed += 1
    return Case(mix, layout, seed, tuple(faults), names, rng.choice([0.02, 0.05, 0.1, 0.15]),
                rng.choice([0.0, 0.002, 0.01]), rng.choice([0.0, 50.0, 500.0, 2000.0]), rng.choice([0.0, 20.0]), truth)


def make_cases(mixes, seeds: int, draw: int) -> list[Case]:
    """Each case draws from its own generator (draw, seed, layout, mix): a mix added later, or one
    left out, changes no other case."""
    cases = []
    for seed in range(seeds):
        for li, layout in enumerate(LAYOUTS):
            for mi, mix in enumerate(MIXES):
                if mix not in mixes:
                    continue
                rng = random.Random(f"{draw}/{seed}/{layout}/{mix}")
                case = make_case(mix, layout, 7_000_000 + 100_000 * draw + 1000 * seed + 37 * li + mi, rng)
                if case is not None:
                    cases.append(case)
    return cases


def judge(case: Case, res: dict) -> tuple[bool, list[str], list[tuple[float, bool]]]:
    """(right, what is wrong, [(confidence, right) per finding])."""
    d, t = res["diagnosis"], case.truth
    fs = d["findings"]
    if "hang" in t:
        ok = d["localization"]["verdict"] == "hang" and res["hang_culprits"] == t["hang"]
        return ok, [] if ok else [f"hang culprits {res['hang_culprits']}"], []
    good = []
    for f in fs:
        rs = set(f["ranks"])
        if f["kind"] == "straggler":
            good.append(rs <= set(t.get("stragglers", t.get("moving", []))))
        elif f["kind"] == "slow_link":
            good.append(sorted(rs) == t.get("link") or sorted(rs) in t.get("links", []))
        elif f["kind"] == "transient":
            good.append(("transient" in t and sorted(rs) == t["transient"] and list(f["steps"]) == t["steps"])
                        or ("moving" in t and rs <= set(t["moving"])))
        elif f["kind"] == "moving":
            good.append("moving" in t and rs <= set(t["moving"]))
        elif f["kind"] == "stage_imbalance":
            good.append("stage" in t and f"stage {t['stage']}" in f["where"])
        elif f["kind"] == "data_imbalance":
            good.append("data" in t and bool(rs) and rs <= set(t["data"]))
        else:
            good.append(False)
    why = [f"{f['kind']} {f['ranks']} (confidence {f['confidence']:.2f})" for f, ok in zip(fs, good) if not ok]
    named = {f["ranks"][0] for f in fs if f["kind"] == "straggler"}
    if "stragglers" in t and named != set(t["stragglers"]):
        why.append(f"stragglers {sorted(named)} for {t['stragglers']}")
    for link in t.get("links", []):
        if not any(ok and f["kind"] == "slow_link" and sorted(f["ranks"]) == link for f, ok in zip(fs, good)):
            why.append(f"link {link} missed")
    for need, kinds in (("link", ("slow_link",)), ("transient", ("transient",)), ("stage", ("stage_imbalance",)),
                        ("data", ("data_imbalance",))):
        if need in t and not any(ok and f["kind"] in kinds for f, ok in zip(fs, good)):
            why.append(f"{need} missed")
    if "moving" in t and d["localization"]["verdict"] != "moving" and \
            not any(ok and f["kind"] in ("moving", "transient") for f, ok in zip(fs, good)):
        why.append("moving missed")
    return not why, why, [(f["confidence"], ok) for f, ok in zip(fs, good)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", nargs="*", default=list(MIXES), choices=MIXES)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--draw", type=int, default=0, help="another draw of the same design: a hold-out check")
    ap.add_argument("--show-wrong", action="store_true")
    ap.add_argument("--cache", type=Path, help="keep each case's store here; a re-run re-judges the analysis only")
    args = ap.parse_args()
    cases = make_cases(args.mixes, args.seeds, args.draw)
    per_mix: dict[str, list[bool]] = defaultdict(list)
    calib: list[tuple[float, bool]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tk-mixes-") as tmp:
        for i, case in enumerate(cases):
            try:
                res = run_case(case, Path(tmp), args.cache)
                right, why, cal = judge(case, res)
            except Exception as e:  # noqa: BLE001 - a crash is a wrong answer, reported
                res, right, why, cal = {}, False, [f"{type(e).__name__}: {e}"], []
            per_mix[case.kind].append(right)
            calib += cal
            print(f"[{i + 1}/{len(cases)}] {'ok   ' if right else 'WRONG'} {case.label}", file=sys.stderr, flush=True)
            if not right and args.show_wrong:
                print("    " + "; ".join(why)[:400], file=sys.stderr)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n{len(cases)} cases in {wall:.0f} s; peak RSS {peak:.0f} MB\n")
    print_accuracy("mix", MIXES, per_mix, total=True)
    print()
    print_calibration(calib, "findings")


if __name__ == "__main__":
    main()
