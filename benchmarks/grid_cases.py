"""The fault grid's cases (benchmarks/diagnosis_grid.py): layouts, kinds and the seeded draws.

Each draw is a fixed random stream, so a draw's cases are the same on every machine and the
numbers in docs/analysis.md can be re-run; kinds added after the grid was published
(``LATER_KINDS``) draw from streams of their own, so that the published cases stay what they were
(tests/test_grid_cases.py pins them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LAYOUTS = [  # (tp, cp, pp, dp): every dimension at 1 and above 1, TP to 8, CP to 4, PP to 8, DP to 8
    (2, 1, 1, 4), (1, 2, 2, 2), (2, 2, 2, 2), (4, 1, 2, 2), (8, 1, 1, 2), (1, 4, 1, 2), (2, 1, 4, 2),
    (1, 1, 2, 8), (2, 2, 4, 1), (1, 1, 8, 2), (2, 4, 1, 1), (1, 2, 1, 8),
]
KINDS = ("slow", "slow3", "two", "transient", "moving", "link_coll", "link_p2p", "cp_imbalance", "stage", "hang",
         "clean", "chips", "host", "untraced", "order")
# added after the grid was published: random streams of their own
LATER_KINDS = ("chips", "host", "untraced", "order")
# what an ``order`` case injects: the grid's kinds, in a job numbered PP-outermost
ORDER_AS = ("slow", "two", "transient", "link_coll", "link_p2p", "clean")
# clean runs whose healthy chips differ (each rank's compute off by a lognormal factor of this sigma
# for the whole run), as real fleets' do: what a lower bar would cost. Reported apart from the
# issue's clean runs (which have identical chips) and drawn from a random stream of their own, so
# that the published cases stay what they were
CHIP_SPREADS = (0.005, 0.01)


@dataclass
class Case:
    kind: str
    layout: tuple[int, int, int, int]
    seed: int
    faults: tuple[str, ...]
    names: str
    noise: float
    spikes: float
    skew_ms: float
    drift_ppm: float
    truth: dict
    # (micro-batches, virtual stages per rank, layers per virtual stage, ranks per host); () the
    # published grid's (2 x pp, 1, 4, 8)
    schedule: tuple[int, ...] = ()
    chips: float = 0.0  # sigma of the ranks' own compute factors (chips that differ); 0: identical chips
    profiler_names: bool = False  # traces named host_pid.ns.pt.trace.json.gz: the hosts known, as in a real job
    untraced: tuple[int, ...] = ()  # ranks whose profiler traces are removed (profiled ranks only, as jobs do)
    order: tuple[str, ...] = ()  # how the job numbers its ranks, innermost first; (): [TP, CP, PP, DP]

    @property
    def label(self) -> str:
        tp, cp, pp, dp = self.layout
        sched = " mb{} v{} L{} h{}".format(*self.schedule) if self.schedule else ""
        sched += f" chips {self.chips:.3f}" if self.chips else ""
        sched += " profiler-names" if self.profiler_names and self.kind != "host" else ""
        sched += f" untraced {self.untraced[0]}-{self.untraced[-1]}" if self.untraced else ""
        sched += f" pp-outermost as {self.truth.get('as')}" if self.order else ""
        return (f"{self.kind:12s} tp{tp} cp{cp} pp{pp} dp{dp} {self.names:5s} noise {self.noise:.2f} "
                f"skew {self.skew_ms:.0f}ms seed {self.seed}{sched} {' '.join(self.faults)}")


def _rank(lay, rng, **fixed) -> int:
    from tracekit.topology import Layout

    lay = Layout(*lay[:2], pp=lay[2], dp=lay[3]) if not isinstance(lay, Layout) else lay
    c = {d: fixed.get(d, rng.randrange(getattr(lay, d))) for d in ("dp", "pp", "cp", "tp")}
    return lay.rank_of(**c)


def make_cases(kinds, seeds: int, quick: bool, draw: int = 0, schedules: bool = False) -> list[Case]:
    """The grid's cases; ``draw`` > 0 gives another grid of the same design (other ranks, factors,
    noise, clocks and simulator seeds): a hold-out check of what was tuned on draw 0. ``schedules``:
    each case also draws its pipeline schedule and hosts (micro-batches pp, 2 pp or 4 pp; 1 or 2
    virtual stages per rank; 2 or 4 layers per virtual stage; 4 or 8 ranks per host), which the
    published grid keeps fixed."""
    from tracekit.topology import Layout

    cases = []
    rng = random.Random(20261126 + 7919 * draw)
    for seed in range(seeds):
        for li, (tp, cp, pp, dp) in enumerate(LAYOUTS):
            lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp)
            world = lay.world_size
            # clean runs three times over: the false-alarm rate needs the most cases
            for kind, variant in [(k, v) for k in kinds if k not in LATER_KINDS for v in range(3 if k == "clean" else 1)]:
                if quick and (li + seed + KINDS.index(kind) + variant) % 4:
                    continue
                s = seed * 1000 + li * 37 + KINDS.index(kind) + 100 * variant + 100_000 * draw
                faults: tuple[str, ...] = ()
                truth: dict = {}
                if kind in ("slow", "slow3"):
                    r = rng.randrange(world)
                    f = 1.03 if kind == "slow3" else rng.choice([1.05, 1.1, 1.3, 1.5, 2.0])
                    faults, truth = (f"slow:rank={r},factor={f}",), {"ranks": [r], "factor": f}
                elif kind == "two":
                    a, b = rng.sample(range(world), 2)
                    f = rng.choice([1.1, 1.3, 1.5])
                    faults, truth = (f"slow:rank={a},factor={f}", f"slow:rank={b},factor={f}"), {"ranks": sorted([a, b])}
                elif kind == "transient":
                    r = rng.randrange(world)
                    st = sorted(rng.sample(range(8), 2))
                    f = rng.choice([1.3, 1.5, 2.0])
                    faults, truth = (f"slow:rank={r},factor={f},steps={st[0]}+{st[1]}",), {"ranks": [r], "steps": st}
                elif kind == "moving":
                    if world < 3:
                        continue
                    rs = rng.sample(range(world), 3)
                    faults, truth = (f"moving:ranks={'+'.join(map(str, rs))},factor=1.5",), {"ranks": rs}
                elif kind == "link_coll":
                    dims = [d for d in ("tp", "cp", "dp") if getattr(lay, d) > 1]
                    if not dims:
                        continue
                    d = rng.choice(dims)
                    a = rng.randrange(world)
                    g = lay.group(a, d)
                    b = rng.choice([x for x in g if x != a])
                    faults, truth = (f"link:a={a},b={b},delay_ms={rng.choice([5, 10, 20])}",), {"ranks": sorted(g), "dim": d}
                elif kind == "link_p2p":
                    if pp < 2:
                        continue
                    st = rng.randrange(pp - 1)
                    a = _rank(lay, rng, pp=st)
                    b = a + lay.stride("pp")
                    faults, truth = (f"link:a={a},b={b},delay_ms={rng.choice([5, 10, 20])}",), {"ranks": [a, b]}
                elif kind == "cp_imbalance":
                    if cp < 2:
                        continue
                    c = rng.randrange(cp)
                    faults, truth = (f"cp_imbalance:ranks={c},weight=0.8",), {}
                elif kind == "stage":
                    if pp < 2:
                        continue
                    # not the first stage of two: it is the lighter one by design (the last holds the
                    # head), and 1.4x its work merely evens the pipeline out
                    st = rng.randrange(1, pp) if pp == 2 else rng.randrange(pp)
                    faults, truth = (f"stage:pp={st},factor=1.4",), {"pp": st}
                elif kind == "hang":
                    r = rng.randrange(world)
                    faults, truth = (f"hang:rank={r},step={rng.randrange(2, 6)}",), {"ranks": [r]}
                names, noise, spikes, skew, drift = _conditions(rng)
                if names == "plain" and s % 3 == 2:  # the simulator's plain flavour 2 names nothing ('undefined')
                    s += 1
                case = Case(kind, (tp, cp, pp, dp), s, faults, names, noise, spikes, skew, drift, truth)
                if schedules:
                    case.schedule = _schedule(rng, pp)
                cases.append(case)
    if "chips" in kinds:
        cases += _chip_cases(seeds, quick, draw, schedules)
    if "host" in kinds:
        cases += _host_cases(seeds, quick, draw, schedules)
    if "untraced" in kinds:
        cases += _untraced_cases(seeds, quick, draw, schedules)
    if "order" in kinds:
        cases += _order_cases(seeds, quick, draw, schedules)
    return cases


def _conditions(rng: random.Random) -> tuple[str, float, float, float, float]:
    """A case's group names, kernel noise, spike probability, clock skew (ms) and drift (ppm)."""
    return (rng.choice(["mesh", "plain", "none"]), rng.choice([0.02, 0.05, 0.1, 0.15]), rng.choice([0.0, 0.002, 0.01]),
            rng.choice([0.0, 50.0, 500.0, 2000.0]), rng.choice([0.0, 20.0]))


def _schedule(rng: random.Random, pp: int) -> tuple[int, int, int, int]:
    """Micro-batches, virtual stages per rank, layers per virtual stage, ranks per host."""
    return rng.choice([1, 2, 4]) * pp, rng.choice([1, 2]) if pp > 1 else 1, rng.choice([2, 4]), rng.choice([4, 8])


def _host_cases(seeds: int, quick: bool, draw: int, schedules: bool) -> list[Case]:
    """A slow host: every rank of one host 1.1-1.5x, per seed and layout with two hosts or more."""
    rng = random.Random(20261126 + 7919 * draw + 130_363)  # not the grid's stream: its cases stay
    out = []
    for seed in range(seeds):
        for li, (tp, cp, pp, dp) in enumerate(LAYOUTS):
            world = tp * cp * pp * dp
            sched = _schedule(rng, pp) if schedules else ()
            per_host = sched[3] if sched else 8
            if world // per_host < 2 or (quick and (li + seed) % 4):
                continue
            h = rng.randrange(world // per_host)
            f = rng.choice([1.1, 1.2, 1.5])
            ranks = list(range(h * per_host, (h + 1) * per_host))
            s = seed * 1000 + li * 37 + 30 + 100_000 * draw
            names, noise, spikes, skew, drift = _conditions(rng)
            case = Case("host", (tp, cp, pp, dp), s, tuple(f"slow:rank={r},factor={f}" for r in ranks), names, noise,
                        spikes, skew, drift, {"ranks": ranks, "factor": f}, schedule=sched)
            if case.names == "plain" and s % 3 == 2:
                case.seed += 1
            out.append(case)
    return out


def _untraced_cases(seeds: int, quick: bool, draw: int, schedules: bool) -> list[Case]:
    """Half of the job profiled (the first or the second half of the ranks: whole hosts, as jobs
    profile some), per seed and layout: a rank 1.1-1.5x among the untraced half, and a clean run.
    The untraced ranks keep their flight-recorder dumps."""
    rng = random.Random(20261126 + 7919 * draw + 155_921)  # not the grid's stream: its cases stay
    out = []
    for seed in range(seeds):
        for li, (tp, cp, pp, dp) in enumerate(LAYOUTS):
            world = tp * cp * pp * dp
            for v in range(2):
                if quick and (li + seed + v) % 4:
                    continue
                half = world // 2
                untraced = tuple(range(half, world)) if rng.random() < 0.5 else tuple(range(half))
                faults, truth = (), {}
                if v == 0:
                    r, f = rng.choice(untraced), rng.choice([1.1, 1.3, 1.5])
                    faults, truth = (f"slow:rank={r},factor={f}",), {"ranks": [r], "factor": f}
                s = seed * 1000 + li * 37 + 40 + 100 * v + 100_000 * draw
                names, noise, spikes, skew, drift = _conditions(rng)
                out.append(_finished(Case("untraced", (tp, cp, pp, dp), s, faults, names, noise, spikes, skew, drift,
                                           truth, untraced=untraced), rng, schedules))
    return out


def _order_cases(seeds: int, quick: bool, draw: int, schedules: bool) -> list[Case]:
    """Jobs numbered PP-outermost, as torchtitan's and Megatron-LM's meshes number them, per seed and
    layout with PP and DP above 1, twice: each with one of ``ORDER_AS``'s faults (judged as that kind,
    and by the order found as well)."""
    from tracekit.topology import PP_OUTERMOST, Layout

    rng = random.Random(20261126 + 7919 * draw + 181_081)  # not the grid's stream: its cases stay
    out = []
    for seed in range(seeds):
        for li, (tp, cp, pp, dp) in enumerate(LAYOUTS):
            if pp < 2 or dp < 2:
                continue
            lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp, order=PP_OUTERMOST)
            world = lay.world_size
            for v in range(2):
                if quick and (li + seed + v) % 4:
                    continue
                kind = rng.choice(ORDER_AS)
                faults: tuple[str, ...] = ()
                truth: dict = {"as": kind}
                if kind == "slow":
                    r, f = rng.randrange(world), rng.choice([1.05, 1.1, 1.3, 1.5])
                    faults, truth = (f"slow:rank={r},factor={f}",), {**truth, "ranks": [r], "factor": f}
                elif kind == "two":
                    a, b = rng.sample(range(world), 2)
                    f = rng.choice([1.1, 1.3, 1.5])
                    faults = (f"slow:rank={a},factor={f}", f"slow:rank={b},factor={f}")
                    truth = {**truth, "ranks": sorted([a, b])}
                elif kind == "transient":
                    r, st, f = rng.randrange(world), sorted(rng.sample(range(8), 2)), rng.choice([1.5, 2.0])
                    faults = (f"slow:rank={r},factor={f},steps={st[0]}+{st[1]}",)
                    truth = {**truth, "ranks": [r], "steps": st}
                elif kind == "link_coll":  # a DP group's link: the one this order moves
                    a = rng.randrange(world)
                    g = lay.group(a, "dp")
                    b = rng.choice([x for x in g if x != a])
                    faults = (f"link:a={a},b={b},delay_ms={rng.choice([10, 20])}",)
                    truth = {**truth, "ranks": sorted(g), "dim": "dp"}
                elif kind == "link_p2p":
                    a = _rank(lay, rng, pp=rng.randrange(pp - 1))
                    b = a + lay.stride("pp")
                    faults = (f"link:a={a},b={b},delay_ms={rng.choice([10, 20])}",)
                    truth = {**truth, "ranks": [a, b]}
                s = seed * 1000 + li * 37 + 60 + 100 * v + 100_000 * draw
                names, noise, spikes, skew, drift = _conditions(rng)
                out.append(_finished(Case("order", (tp, cp, pp, dp), s, faults, names, noise, spikes, skew, drift,
                                           truth, order=PP_OUTERMOST), rng, schedules))
    return out


def _finished(case: Case, rng: random.Random, schedules: bool) -> Case:
    """A later kind's case, its seed moved off the plain flavour that names nothing (as above) and
    its schedule drawn last, so that the stream gives the same cases as before this helper."""
    if case.names == "plain" and case.seed % 3 == 2:
        case.seed += 1
    if schedules:
        case.schedule = _schedule(rng, case.layout[2])
    return case


def _chip_cases(seeds: int, quick: bool, draw: int, schedules: bool) -> list[Case]:
    """Clean runs whose chips differ by each of CHIP_SPREADS, per seed and layout."""
    rng = random.Random(20261126 + 7919 * draw + 104_729)  # not the grid's stream: its cases stay
    out = []
    for seed in range(seeds):
        for li, (tp, cp, pp, dp) in enumerate(LAYOUTS):
            for v, spread in enumerate(CHIP_SPREADS):
                if quick and (li + seed + v) % 4:
                    continue
                s = seed * 1000 + li * 37 + 20 + 100 * v + 100_000 * draw
                names, noise, spikes, skew, drift = _conditions(rng)
                out.append(_finished(Case("chips", (tp, cp, pp, dp), s, (), names, noise, spikes, skew, drift, {},
                                           chips=spread), rng, schedules))
    return out
