"""Fault specs in the reference trainer's spelling (reference_trainer/faults.py), plus ``stage``,
their ground truth (the manifest's ``faults`` records) and what they do to the simulated job.

| kind | spec | effect here |
|---|---|---|
| ``slow`` | ``slow:rank=5,factor=1.5[,steps=2+3]`` | every compute kernel of the rank takes ``factor`` x |
| ``moving`` | ``moving:ranks=1+5+3,factor=2[,steps=..]`` | at step s rank ``ranks[s % len]`` is slow |
| ``link`` | ``link:a=2,b=3,delay_ms=40[,steps=..]`` | a and b share a TP/CP/DP group: every transfer of that group's collectives takes ``delay_ms`` longer; adjacent pipeline stages (same dp, cp, tp): every p2p transfer between them does |
| ``cp_imbalance`` | ``cp_imbalance:ranks=1[,weight=0.5][,steps=..]`` | CP ranks ``ranks`` (CP coordinates) get the long documents: their attention kernels are stretched by ``1 + weight * (pairs / mean pairs - 1)`` |
| ``hang`` | ``hang:rank=3,step=1[,dim=dp][,op=all_reduce]`` | the rank never arrives at its first matching collective of that step |
| ``stage`` | ``stage:pp=3,factor=1.3[,steps=..]`` | every replica's stage 3 computes ``factor`` x (stage imbalance) |

Lists use ``+`` (``ranks=1+5``); steps are ``a-b`` (inclusive) or ``a+b+c``; no steps = every step.
Written here rather than imported from the trainer: tracekit must not need torch to simulate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracekit.simulate.config import SimConfig, SimError

KINDS = ("slow", "moving", "link", "hang", "cp_imbalance", "stage")
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_REQUIRED = {"slow": ("rank", "factor"), "moving": ("ranks", "factor"), "link": ("a", "b", "delay_ms"),
             "hang": ("rank", "step"), "cp_imbalance": ("ranks",), "stage": ("pp", "factor")}
_ALLOWED = {"slow": {"steps"}, "moving": {"steps"}, "link": {"steps"}, "hang": {"op", "dim"},
            "cp_imbalance": {"weight", "steps"}, "stage": {"steps"}}
_INT = {"rank", "a", "b", "step", "pp"}
_FLOAT = {"factor", "delay_ms", "weight"}
_LIST = {"ranks", "steps"}


@dataclass(frozen=True)
class Fault:
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    spec: str = ""

    def steps(self, n_steps: int) -> list[int]:
        if self.kind == "hang":
            return [self.params["step"]]
        s = self.params.get("steps")
        return list(range(n_steps)) if s is None else sorted({x for x in s if 0 <= x < n_steps})

    def active(self, step: int) -> bool:
        s = self.params.get("steps")
        return s is None or step in s


def _ints(text: str, spec: str) -> list[int]:
    try:
        if "-" in text:
            a, b = text.split("-", 1)
            return list(range(int(a), int(b) + 1))
        return [int(x) for x in text.split("+")]
    except ValueError:
        raise SimError(f"fault {spec!r}: {text!r} is not an integer list (a-b or a+b+c)") from None


def parse_fault(spec: str) -> Fault:
    kind, _, rest = spec.strip().partition(":")
    if kind not in KINDS:
        raise SimError(f"fault {spec!r}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    params: dict[str, Any] = {}
    for tok in filter(None, rest.split(",")):
        key, eq, val = tok.partition("=")
        key = key.strip()
        if not eq:
            raise SimError(f"fault {spec!r}: {tok!r} is not key=value")
        if key not in _REQUIRED[kind] and key not in _ALLOWED[kind]:
            raise SimError(f"fault {spec!r}: unknown field {key!r} for {kind}; "
                           f"allowed {sorted(set(_REQUIRED[kind]) | _ALLOWED[kind])}")
        try:
            params[key] = (int(val) if key in _INT else float(val) if key in _FLOAT else
                           _ints(val, spec) if key in _LIST else val.strip())
        except ValueError:
            raise SimError(f"fault {spec!r}: {key}={val!r} is not a number") from None
    missing = [k for k in _REQUIRED[kind] if k not in params]
    if missing:
        raise SimError(f"fault {spec!r}: missing {', '.join(missing)}")
    if params.get("factor", 1.0) < 1.0:
        raise SimError(f"fault {spec!r}: factor must be >= 1")
    if params.get("delay_ms", 0.0) < 0 or params.get("weight", 0.0) < 0:
        raise SimError(f"fault {spec!r}: delay_ms and weight must be >= 0")
    return Fault(kind, params, spec.strip())


def link_kind(f: Fault, cfg: SimConfig) -> tuple[str, str]:
    """('collective', dim) when a and b share a TP/CP/DP group; ('p2p', 'pp') for adjacent stages."""
    lay = cfg.layout
    ca, cb = lay.coords(f.params["a"]).as_dict(), lay.coords(f.params["b"]).as_dict()
    differ = [d for d in ("tp", "cp", "pp", "dp") if ca[d] != cb[d]]
    if len(differ) == 1 and differ[0] != "pp":
        return "collective", differ[0]
    if differ == ["pp"]:
        gap = abs(ca["pp"] - cb["pp"])
        if gap == 1 or (cfg.vstages > 1 and gap == cfg.pp - 1):
            return "p2p", "pp"
    raise SimError(f"fault {f.spec!r}: ranks {f.params['a']} and {f.params['b']} share no TP/CP/DP group "
                   "and are not adjacent pipeline stages")


def check(faults: list[Fault], cfg: SimConfig) -> None:
    world = cfg.world_size
    for f in faults:
        p = f.params
        ranks = [p[k] for k in ("rank", "a", "b") if k in p] + (p["ranks"] if f.kind == "moving" else [])
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise SimError(f"fault {f.spec!r}: rank {bad[0]} outside the world of {world} ranks (0..{world - 1})")
        if f.kind == "link":
            if p["a"] == p["b"]:
                raise SimError(f"fault {f.spec!r}: a link needs two different ranks")
            link_kind(f, cfg)
        if f.kind == "stage" and not 0 <= p["pp"] < cfg.pp:
            raise SimError(f"fault {f.spec!r}: stage {p['pp']} outside 0..{cfg.pp - 1}")
        if f.kind == "hang":
            if not 0 <= p["step"] < cfg.steps:
                raise SimError(f"fault {f.spec!r}: step {p['step']} outside 0..{cfg.steps - 1}")
            dims = [d for d in ("tp", "cp", "dp") if getattr(cfg, d) > 1]
            if "dim" in p and p["dim"] not in dims:
                raise SimError(f"fault {f.spec!r}: dim must be one with collectives in this layout: {dims}")
            if not dims:
                raise SimError(f"fault {f.spec!r}: the layout has no collectives (tp = cp = dp = 1) to hang in")
            if "op" in p and p["op"] not in COLLECTIVE_OPS:
                raise SimError(f"fault {f.spec!r}: op must be one of {', '.join(COLLECTIVE_OPS)}")
        if f.kind == "cp_imbalance":
            if cfg.cp < 2:
                raise SimError(f"fault {f.spec!r}: needs cp >= 2, the layout has cp={cfg.cp}")
            if any(not 0 <= r < cfg.cp for r in p["ranks"]):
                raise SimError(f"fault {f.spec!r}: CP ranks {p['ranks']} outside 0..{cfg.cp - 1}")
            if len(set(p["ranks"])) >= cfg.cp:
                raise SimError(f"fault {f.spec!r}: every CP rank loaded is no imbalance")
    if sum(f.kind == "hang" for f in faults) > 1:
        raise SimError("at most one hang fault per run")


def parse_all(specs: tuple[str, ...] | list[str], cfg: SimConfig) -> list[Fault]:
    faults = [parse_fault(s) for s in specs]
    check(faults, cfg)
    return faults


def cp_pair_ratios(f: Fault, cfg: SimConfig) -> dict[int, list[float]]:
    """Per step, each CP rank's attention pairs / the CP group's mean: the loaded ranks hold
    60-100% of the most they could (cp / loaded), varying with the step's documents."""
    rng = np.random.default_rng([cfg.seed, 9173])
    loaded = sorted(set(f.params["ranks"]))
    top = cfg.cp / len(loaded)
    out = {}
    for s in range(cfg.steps):
        heavy = 1.0 + (top - 1.0) * rng.uniform(0.6, 1.0)
        light = (cfg.cp - len(loaded) * heavy) / (cfg.cp - len(loaded))
        out[s] = [round(heavy if r in loaded else light, 4) for r in range(cfg.cp)]
    return out


def stretch(ratio: float, weight: float) -> float:
    return max(1.0, 1.0 + weight * (ratio - 1.0))


def ground_truth(f: Fault, cfg: SimConfig) -> dict[str, Any]:
    """The manifest record of one fault, as the trainer writes it: kind, spec, steps, ranks, magnitude."""
    p, steps, lay = f.params, f.steps(cfg.steps), cfg.layout
    out: dict[str, Any] = {"kind": f.kind, "spec": f.spec, "steps": steps}
    if f.kind == "slow":
        out.update(ranks=[p["rank"]], magnitude={"compute_factor": p["factor"]})
    elif f.kind == "moving":
        out.update(ranks=sorted(set(p["ranks"])), magnitude={"compute_factor": p["factor"]},
                   rank_by_step={str(s): p["ranks"][s % len(p["ranks"])] for s in steps})
    elif f.kind == "link":
        kind, dim = link_kind(f, cfg)
        out.update(ranks=[p["a"], p["b"]], magnitude={"delay_ms": p["delay_ms"]}, link=kind, dim=dim)
    elif f.kind == "hang":
        out.update(ranks=[p["rank"]], magnitude={"stall": "forever"}, op=p.get("op"), dim=p.get("dim"))
    elif f.kind == "stage":
        ranks = [r for r in range(cfg.world_size) if lay.coords(r).pp == p["pp"]]
        out.update(ranks=ranks, pp=p["pp"], magnitude={"compute_factor": p["factor"]})
    elif f.kind == "cp_imbalance":
        weight = p.get("weight", 0.5)
        ratios = cp_pair_ratios(f, cfg)
        factors = {str(s): [round(stretch(v, weight), 4) for v in ratios[s]] for s in steps}
        slow = sorted({r for r in range(cfg.world_size)
                       if any(v[lay.coords(r).cp] > 1.05 for v in factors.values())})
        out.update(ranks=slow, cp_ranks=sorted(set(p["ranks"])), sharding="sequence",
                   magnitude={"weight": weight, "pair_ratio_by_step": {str(s): ratios[s] for s in steps},
                              "attention_factor_by_step": factors})
    return out


def chip_factors(cfg: SimConfig) -> np.ndarray:
    """Each rank's compute factor for the whole run, over the rank grid (DP, PP, CP, TP): healthy
    chips differ (clocks, thermals, placement). A random stream of its own, so that
    ``chip_spread`` 0 leaves every other draw of the run as it was."""
    shape = (cfg.dp, cfg.pp, cfg.cp, cfg.tp)
    if cfg.chip_spread <= 0:
        return np.ones(shape)
    return np.random.default_rng([cfg.seed, 2]).lognormal(0.0, cfg.chip_spread, shape)


class Effects:
    """What the faults do, as arrays over the rank grid (DP, PP, CP, TP) per step."""

    def __init__(self, faults: list[Fault], cfg: SimConfig) -> None:
        self.cfg, self.faults = cfg, faults
        shape = (cfg.dp, cfg.pp, cfg.cp, cfg.tp)
        self.compute = np.ones((cfg.steps,) + shape)
        self.compute *= chip_factors(cfg)
        self.attention = np.ones((cfg.steps,) + shape)
        lay = cfg.layout
        for f in faults:
            p = f.params
            for s in f.steps(cfg.steps):
                if f.kind in ("slow", "moving"):
                    r = p["rank"] if f.kind == "slow" else p["ranks"][s % len(p["ranks"])]
                    c = lay.coords(r)
                    self.compute[s, c.dp, c.pp, c.cp, c.tp] *= p["factor"]
                elif f.kind == "stage":
                    self.compute[s, :, p["pp"]] *= p["factor"]
            if f.kind == "cp_imbalance":
                ratios = cp_pair_ratios(f, cfg)
                for s in f.steps(cfg.steps):
                    for cp_rank, v in enumerate(ratios[s]):
                        self.attention[s, :, :, cp_rank] *= stretch(v, p.get("weight", 0.5))
        self.links = [(f, *link_kind(f, cfg)) for f in faults if f.kind == "link"]
        self.hang = next((f for f in faults if f.kind == "hang"), None)

    def collective_delay_ms(self, step: int, dim: str, pp: int, shape: tuple[int, ...]) -> np.ndarray:
        """Extra transfer time of each (dp, cp, tp) lane's ``dim`` collective on stage ``pp``."""
        out = np.zeros(shape)
        for f, kind, d in self.links:
            if kind != "collective" or d != dim or not f.active(step):
                continue
            c = self.cfg.layout.coords(f.params["a"])
            if c.pp != pp:
                continue
            idx = {"dp": c.dp, "cp": c.cp, "tp": c.tp}
            idx[dim] = slice(None)
            out[idx["dp"], idx["cp"], idx["tp"]] += f.params["delay_ms"]
        return out

    def p2p_delay_ms(self, step: int, pp_a: int, pp_b: int, shape: tuple[int, ...]) -> np.ndarray:
        """Extra transfer time of each (dp, cp, tp) lane between stages pp_a and pp_b."""
        out = np.zeros(shape)
        for f, kind, _ in self.links:
            if kind != "p2p" or not f.active(step):
                continue
            ca, cb = (self.cfg.layout.coords(f.params[k]) for k in ("a", "b"))
            if {ca.pp, cb.pp} == {pp_a, pp_b}:
                out[ca.dp, ca.cp, ca.tp] += f.params["delay_ms"]
        return out
