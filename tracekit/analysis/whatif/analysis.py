"""What-if analysis of one run: replay as recorded, the ideal step, the slowdown and where it comes
from, and the counterfactuals asked for (``--heal``, ``--balance``).

The slowdown is the measured step time over the ideal one. Every what-if replays without the recorded
idle gaps (a gap can be a dependency the graph does not hold: kept, it would stall a changed
schedule where the real one would not wait) and its saving is counted against the replay without
them (``nodelay_ns``), as the analyzer does. Its decomposition follows the what-if
analyzer (ByteDance-Seed/StragglerAnalysis, "Understanding Stragglers in Large Model Training Using
What-if Analysis"): for each DP rank, stage and op type, the ideal step with only that part at its
recorded times, over the ideal step (1.0: that part costs nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from tracekit.analysis.tables import RunTables
from tracekit.analysis.whatif import counterfactual as cf
from tracekit.analysis.whatif import optable_graph, trainer_graph
from tracekit.analysis.whatif.graph import StepGraph, WhatIfError
from tracekit.analysis.whatif.replay import Params, recorded, replay
from tracekit.analysis.whatif.wlb import DataWhatIf, cp_document_params, data_whatif


@dataclass(frozen=True)
class Scenario:
    name: str  # "heal rank=5", "heal link=2,3", "balance cp", "ideal"
    step_ns: float  # predicted mean step time
    saving_ns: float  # per step, against the replay without idle gaps (what-ifs drop them, as the analyzer does)
    share: float  # of the measured mean step time
    steady_ns: float = float("nan")  # the what-if applied to the steady step (every op at its median over the steady steps)


@dataclass
class WhatIf:
    run_id: str
    model: str  # op-table | program-order
    steps: int
    measured_ns: float  # mean measured step time
    replay_ns: float  # mean step time replayed as recorded
    nodelay_ns: float  # replayed with every idle gap dropped
    ideal_ns: float
    steady_ns: float  # every op at its median over the steady steps (after ``warmup``), replayed: the typical step
    violations: int  # recorded starts before a dependency ended (0 when the graph fits the record)
    scenarios: list[Scenario]
    per_step: pl.DataFrame  # step, measured_ns, replay_ns, nodelay_ns, ideal_ns, one <scenario>_ns column each
    by_dp: pl.DataFrame = field(default_factory=pl.DataFrame)  # key, slowdown
    by_stage: pl.DataFrame = field(default_factory=pl.DataFrame)
    by_optype: pl.DataFrame = field(default_factory=pl.DataFrame)
    data: DataWhatIf | None = None  # WLB-LLM data what-ifs (trainer runs, ``wlb=True``)
    missing_ranks: tuple[int, ...] = ()  # ranks of the layout with nothing to replay (no trace)

    @property
    def slowdown(self) -> float:
        return self.measured_ns / self.ideal_ns

    @property
    def blocking_slowdown(self) -> float:
        """The analyzer's straggler slowdown: the replay without idle gaps over the ideal."""
        return self.nodelay_ns / self.ideal_ns

    @property
    def replay_error(self) -> float:
        return self.replay_ns / self.measured_ns - 1.0

    def to_dict(self) -> dict:
        dec = {name: {str(k): v for k, v in frame.iter_rows()} if frame.height else {}
               for name, frame in (("dp_rank", self.by_dp), ("stage", self.by_stage), ("optype", self.by_optype))}
        return {"run_id": self.run_id, "model": self.model, "steps": self.steps, "measured_ns": self.measured_ns,
                "replay_ns": self.replay_ns, "replay_error": self.replay_error, "nodelay_ns": self.nodelay_ns,
                "ideal_ns": self.ideal_ns, "steady_ns": self.steady_ns, "slowdown": self.slowdown,
                "blocking_slowdown": self.blocking_slowdown,
                "violations": self.violations, "missing_ranks": list(self.missing_ranks), "decomposition": dec,
                "scenarios": [s.__dict__ for s in self.scenarios],
                "wlb": None if self.data is None else {"attention_weight": self.data.attention_weight,
                                                       "per_step": self.data.per_step.to_dicts()},
                "per_step": self.per_step.to_dicts()}


def build(tables: RunTables) -> tuple[str, list[StepGraph]]:
    """The graphs of a run, by what recorded it: op tables, or programs of blocking calls."""
    source = tables.runs["source"][0]
    if source == "wia":
        return "op-table", optable_graph.build(tables)
    return "program-order", trainer_graph.build(tables)


def _mean(gs: list[StepGraph], ps: list[Params]) -> tuple[float, np.ndarray]:
    steps = np.concatenate([replay(g, p).step_ns for g, p in zip(gs, ps)])
    return float(steps.mean()), steps


def _steady_step(gs: list[StepGraph], ps: list[Params], keep: np.ndarray) -> float:
    """The median over the steady steps of a replay of steady durations (``cf.steady``, then a what-if)."""
    return float(np.median(_mean(gs, ps)[1][keep]))


def _steady_steps(gs: list[StepGraph], warmup: int) -> tuple[set[int], np.ndarray]:
    """The steps after the first ``warmup`` replayed ones, and a mask over the concatenated steps."""
    order = [s for g in gs for s in g.steps]
    if warmup < 0 or warmup >= len(order):
        raise WhatIfError(f"--warmup {warmup}: the run has {len(order)} replayed steps; at least one must remain")
    keep = set(sorted(order)[warmup:])
    return keep, np.array([s in keep for s in order])


def parse_heal(spec: str) -> tuple[str, tuple[int, ...]]:
    """``rank=5``, ``rank=1+5`` or ``link=2,3`` -> (kind, ranks)."""
    kind, _, val = spec.partition("=")
    try:
        ranks = tuple(int(v) for v in val.replace("+", ",").split(",") if v.strip())
    except ValueError:
        raise WhatIfError(f"--heal {spec!r}: ranks must be integers") from None
    if kind not in ("rank", "link") or not ranks or (kind == "link" and len(ranks) != 2):
        raise WhatIfError(f"--heal {spec!r}: expected rank=R[+R...] or link=A,B")
    return kind, ranks


def analyze(tables: RunTables, heal: tuple[str, ...] = (), balance: tuple[str, ...] = (),
            decompose: bool = True, wlb: bool = False, warmup: int = 0) -> WhatIf:
    """Replay the run's steps as recorded, without idle gaps, ideal, and with each what-if asked
    for; every what-if also on the steady step (each op at its median over the steps after the first
    ``warmup``), which a disturbance of single steps on a shared machine does not move."""
    model, gs = build(tables)
    rec = [recorded(g) for g in gs]
    keep, keep_mask = _steady_steps(gs, warmup)
    steady_ps = cf.steady(gs, rec, keep)
    steps = [s for g in gs for s in g.steps]
    measured = np.concatenate([g.measured for g in gs])
    replay_ns, replay_steps = _mean(gs, rec)
    nodelay = [Params(p.dur, np.zeros_like(p.delay)) for p in rec]
    nodelay_ns, nodelay_steps = _mean(gs, nodelay)
    ideal_ps = cf.ideal(gs, rec, "mean" if model == "op-table" else "median")
    ideal_ns, ideal_steps = _mean(gs, ideal_ps)
    per_step = {"step": steps, "measured_ns": measured, "replay_ns": replay_steps, "nodelay_ns": nodelay_steps,
                "ideal_ns": ideal_steps}
    scenarios = [Scenario("ideal", ideal_ns, nodelay_ns - ideal_ns, (nodelay_ns - ideal_ns) / measured.mean(), ideal_ns)]

    def add(name: str, whatif) -> None:  # a what-if on the recorded steps and on the steady step
        sc = _scenario(name, gs, whatif(nodelay), nodelay_ns, measured, per_step)
        scenarios.append(Scenario(sc.name, sc.step_ns, sc.saving_ns, sc.share, _steady_step(gs, whatif(steady_ps), keep_mask)))

    for spec in heal:
        kind, ranks = parse_heal(spec)
        add(f"heal {spec}", (lambda ps, r=ranks: cf.heal_rank(gs, ps, set(r))) if kind == "rank"
            else (lambda ps, r=ranks: cf.heal_link(gs, ps, *r)))
    for dim in balance:
        if dim not in ("cp", "pp"):
            raise WhatIfError(f"--balance {dim!r}: expected cp or pp")
        if model == "op-table" and dim == "cp":
            raise WhatIfError("op tables fold CP ranks into their worker: CP work cannot be balanced")
        add(f"balance {dim}", lambda ps, d=dim: cf.balance(gs, ps, d))
    data = None
    if wlb:
        if model != "program-order":
            raise WhatIfError("data what-ifs need a trainer run (its documents); this is an op table")
        data = data_whatif(tables, gs, rec)
        if tables.layout.cp > 1:
            add("per-document CP sharding", lambda ps: cp_document_params(gs, ps, data))
    seen = {int(r) for g in gs for r in g.nodes["rank"].unique().to_list()}
    missing = tuple(r for r in range(tables.layout.world_size) if r not in seen)
    out = WhatIf(tables.run_id, model, len(steps), float(measured.mean()), replay_ns, nodelay_ns, ideal_ns,
                 _steady_step(gs, steady_ps, keep_mask), sum(p.violations for p in rec), scenarios,
                 pl.DataFrame(per_step).sort("step"), data=data,
                 missing_ranks=missing)
    if decompose:
        out.by_dp, out.by_stage, out.by_optype = (_decompose(gs, ideal_ps, rec, col, ideal_ns)
                                                  for col in ("dp", "pp", "label"))
    return out


def _scenario(name: str, gs, ps, base_ns: float, measured: np.ndarray, per_step: dict) -> Scenario:
    mean, steps = _mean(gs, ps)
    per_step[f"{name.replace(' ', '_')}_ns"] = steps
    return Scenario(name, mean, base_ns - mean, (base_ns - mean) / float(measured.mean()))


def _decompose(gs: list[StepGraph], ideal_ps: list[Params], rec: list[Params], column: str, ideal_ns: float) -> pl.DataFrame:
    keys = sorted({v for g in gs for v in g.nodes[column].drop_nulls().unique().to_list()})
    rows = [(k, _mean(gs, cf.restore(gs, ideal_ps, rec, column, k))[0] / ideal_ns) for k in keys]
    dtype = pl.Utf8 if column == "label" else pl.Int64
    return pl.DataFrame(rows, schema={"key": dtype, "slowdown": pl.Float64}, orient="row").sort("slowdown", descending=True)


def saving(tables: RunTables, ranks, steps=None) -> tuple[float, float]:
    """What healing ``ranks`` (their compute at their peers' median) saves: (ns per step, share of
    the measured step), averaged over ``steps`` (default: every replayed step). For the stragglers
    headline ("rank 13 costs 9.1% of each step, 152 ms"). Raises WhatIfError where the run cannot
    be replayed (GPU kernel traces, no steps)."""
    _, gs = build(tables)
    rec = [recorded(g) for g in gs]
    rec = [Params(p.dur, np.zeros_like(p.delay)) for p in rec]  # idle gaps are no one's fault (see analyze)
    base = np.concatenate([replay(g, p).step_ns for g, p in zip(gs, rec)])
    healed = np.concatenate([replay(g, p).step_ns for g, p in zip(gs, cf.heal_rank(gs, rec, {int(r) for r in ranks}))])
    measured = np.concatenate([g.measured for g in gs])
    keep = np.ones(len(base), dtype=bool)
    if steps is not None:
        keep = np.isin(np.array([s for g in gs for s in g.steps]), list(steps))
        if not keep.any():
            raise WhatIfError(f"none of steps {sorted(steps)} was replayed")
    diff = float((base - healed)[keep].mean())
    return diff, diff / float(measured[keep].mean())
