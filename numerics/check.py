"""The bit-exact check: run the parallel trainer with ``--dump-state``, run the sequential reference
on the same config, and compare loss, every reduced gradient and every updated parameter, bit for bit.

Names in the comparison: ``act/<point>`` (with ``record_activations``: every micro-batch's forward
activation at that point, reassembled by ``numerics.activations``), ``loss``, ``grad/<canonical name>``,
``param/<canonical name>``, ordered step by step: activations in forward order, loss, gradients in
backward order (head first), parameters. The first diverging buffer in that order is where a bug
shows first: a forward bug changes the first activation computed after it (without activation
records: the loss); a backward bug leaves the forward exact and shows in the first gradient computed
after it; a reduction or optimizer bug leaves the forward exact and hits every gradient (or only the
parameters).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import polars as pl
import torch

from numerics.activations import ActivationRecordError, Divergence, assemble, locate, plan_positions, sharding_mismatches
from numerics.compare import Comparison, compare
from numerics.plan import AccumulationPlan
from numerics.reference_step import ReferenceRun
from reference_trainer.config import TrainConfig


class RunStateError(ValueError):
    """A run directory whose dumped state is missing or malformed."""


@dataclass(frozen=True)
class StepCheck:
    step: int
    comparison: Comparison
    norm_ratio: dict[str, float]  # ||parallel|| / ||reference|| per buffer (2.0 everywhere: a scale bug)
    divergence: dict[str, Divergence] = field(default_factory=dict)  # act/<point> -> where it differs
    sharding: tuple[str, ...] = ()  # CP ranks that held other positions than the plan's

    def where(self, name: str) -> str:
        """', micro-batch .. tokens .. differ' for a differing activation, '' otherwise."""
        d = self.divergence.get(name)
        return "" if d is None else f", {d.describe()}"


@dataclass(frozen=True)
class CheckReport:
    config: TrainConfig
    steps: tuple[StepCheck, ...]

    @property
    def bit_exact(self) -> bool:
        return all(s.comparison.bit_exact for s in self.steps)

    @property
    def first_divergent(self) -> tuple[int, str] | None:
        """(step, buffer name) of the first mismatch; None when everything matches."""
        for s in self.steps:
            d = s.comparison.first_divergent
            if d is not None:
                return s.step, d.name
        return None

    def table(self) -> pl.DataFrame:
        """One row per (step, buffer): mismatches, max ULP, errors, the norm ratio and, for a
        differing activation, where it differs first."""
        frames = [s.comparison.table().with_columns(
            pl.lit(s.step).alias("step"),
            pl.Series("norm_ratio", [s.norm_ratio[n] for n in s.comparison.table()["buffer"]]),
            pl.Series("where", [s.where(n).removeprefix(", ") for n in s.comparison.table()["buffer"]], dtype=pl.String),
        ) for s in self.steps]
        return pl.concat(frames).select("step", pl.exclude("step"))

    def ulp_histogram(self) -> pl.DataFrame:
        return pl.concat([s.comparison.ulp_histogram().with_columns(pl.lit(s.step).alias("step"))
                          for s in self.steps]).select("step", pl.exclude("step"))

    @property
    def diagnosis(self) -> str:
        """Where the divergence enters, read off the order of the comparison."""
        first = self.first_divergent
        if first is None:
            return "bit-exact: accumulation order fully explained, no bug"
        step, name = first
        sc = self.steps[step]
        if name.startswith("act/"):
            loss = next(b for b in sc.comparison.buffers if b.name == "loss")
            text = (f"forward: the first diverging activation is the {name[4:]} output{sc.where(name)}; "
                    f"the loss {'matches' if loss.bit_exact else 'differs'}")
            if sc.sharding:
                text += "\ninput sharding differs from the plan: " + "; ".join(sc.sharding)
            return text
        if name == "loss":
            if any(b.name.startswith("act/") for b in sc.comparison.buffers):
                return "forward: every recorded activation matches but the loss differs (loss reduction over ranks)"
            return "forward: the loss differs (data sharding, masking or forward compute)"
        if name.startswith("param/"):
            return f"optimizer: gradients match, updated parameter {name[6:]} differs"
        grads = [b for b in sc.comparison.buffers if b.name.startswith("grad/")]
        bad = [b for b in grads if not b.bit_exact]
        ratios = sorted({round(sc.norm_ratio[b.name], 6) for b in bad})
        # a backward bug spares the gradients computed before it; a reduction bug hits (nearly) all
        if len(bad) == len(grads) or (len(ratios) == 1 and 2 * len(bad) > len(grads)):
            return (f"gradient reduction: the loss matches, {len(bad)}/{len(grads)} gradients differ, "
                    f"norm ratio {ratios} (a scaling or reduction bug)")
        return f"backward: the loss matches; the first wrong gradient in backward order is {name[5:]}"

    def summary(self) -> str:
        """One paragraph: the verdict and, on mismatch, where it starts."""
        first = self.first_divergent
        if first is None:
            n = sum(len(s.comparison.buffers) for s in self.steps)
            return f"bit-exact: {n} buffers over {len(self.steps)} step(s), 0 mismatching elements"
        step, name = first
        sc = self.steps[step]
        d = next(b for b in sc.comparison.buffers if b.name == name)
        bad = self.table().filter(pl.col("mismatches") > 0)
        return (f"MISMATCH: first diverging buffer {name!r} (module {d.module}) at step {step}: "
                f"{d.mismatches}/{d.numel} elements differ, max {d.max_ulp} ULP, normwise rel. error "
                f"{d.rel_err:.3g}{sc.where(name)}; {bad.height} of {self.table().height} buffers differ\n{self.diagnosis}")


def _flatten(state: dict, order: Sequence[str], acts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {f"act/{p}": t for p, t in acts.items()}
    # the trainer's loss is an fp32 all-reduce result handed out as a Python float: compare it in fp32
    out["loss"] = torch.tensor(float(state["loss"]), dtype=torch.float32)
    for key, prefix in (("grads", "grad/"), ("params", "param/")):
        for name in order:
            out[prefix + name] = state[key][name]
    return out


def compare_states(parallel: Sequence[dict], reference: Sequence[dict], plan: AccumulationPlan) -> tuple[StepCheck, ...]:
    """Step by step; with ``record_activations`` in the plan's config the forward activations too
    (both sides reassembled from the plan's positions; the trainer's recorded positions checked)."""
    order = plan.backward_order()
    out = []
    for step, (a, b) in enumerate(zip(parallel, reference)):
        acts_a: dict[str, torch.Tensor] = {}
        acts_b: dict[str, torch.Tensor] = {}
        sharding: tuple[str, ...] = ()
        if plan.cfg.record_activations:
            pos = plan_positions(plan, step)
            try:
                acts_a = assemble(plan, a["activations"], pos, f"parallel step {step}")
                acts_b = assemble(plan, b["activations"], pos, f"reference step {step}")
                sharding = sharding_mismatches(plan, a["positions"], pos, f"parallel step {step}")
            except (KeyError, ActivationRecordError) as exc:
                raise RunStateError(f"step {step}: activation records unusable: {exc}") from None
        fa, fb = _flatten(a, order, acts_a), _flatten(b, order, acts_b)
        names = list(fa)
        ratio = {}
        for n in names:
            na, nb = float(fa[n].double().norm()), float(fb[n].double().norm())
            ratio[n] = na / nb if nb else (1.0 if na == 0 else float("inf"))
        where = {f"act/{p}": d for p in acts_a if (d := locate(p, acts_a[p], acts_b[p])) is not None}
        out.append(StepCheck(step, compare(fa, fb, names), ratio, where, sharding))
    return tuple(out)


def load_states(run_dir: str | Path, steps: int, activations: bool = False) -> list[dict]:
    """The trainer's ``<run>/state/step<k>.pt`` dumps for k < steps (``activations``: they must
    carry activation records)."""
    states = []
    for k in range(steps):
        path = Path(run_dir) / "state" / f"step{k}.pt"
        if not path.exists():
            raise RunStateError(f"{path}: missing (was the run made with --dump-state and {steps} steps?)")
        state = torch.load(path, weights_only=True)
        if not isinstance(state, dict) or not {"loss", "grads", "params"} <= set(state):
            raise RunStateError(f"{path}: expected a dict with loss, grads and params")
        if activations and not {"activations", "positions"} <= set(state):
            raise RunStateError(f"{path}: no activation records (was the run made with --record-activations?)")
        states.append(state)
    return states


def reference_states(cfg: TrainConfig) -> list[dict]:
    """The sequential reference's state after each of ``cfg.steps`` steps."""
    run = ReferenceRun(AccumulationPlan.from_config(cfg))
    return [run.step() for _ in range(cfg.steps)]


def check_run(cfg: TrainConfig, run_dir: str | Path) -> CheckReport:
    """Compare a finished ``--dump-state`` run of ``cfg`` with the sequential reference."""
    plan = AccumulationPlan.from_config(cfg)
    parallel = load_states(run_dir, cfg.steps, cfg.record_activations)
    return CheckReport(cfg, compare_states(parallel, reference_states(cfg), plan))


def run_check(cfg: TrainConfig, out: str | Path | None = None, activations: bool = True) -> CheckReport:
    """Run ``cfg`` on a spawned world (state dumped), then the reference, and compare.
    ``activations`` records and compares every micro-batch's forward activations, so a forward bug
    is named by the first diverging layer (costs memory: every activation of the step is kept)."""
    from reference_trainer.launch import launch, resolve_backend

    cfg = cfg.replace(dump_state=True, record_activations=activations)
    cfg = cfg.replace(backend=resolve_backend(cfg))  # "auto" may mean NCCL, whose native sums have no model
    AccumulationPlan.from_config(cfg)  # refuse an unmodelled config before spawning anything
    with tempfile.TemporaryDirectory(prefix="numerics-check-") as tmp:
        run_dir = Path(out) if out is not None else Path(tmp)
        launch(cfg, run_dir)
        return check_run(cfg, run_dir)


def assert_parallel_matches_reference(cfg: TrainConfig, out: str | Path | None = None,
                                      activations: bool = True) -> CheckReport:
    """pytest-friendly: raise AssertionError with the first diverging buffer and the table of
    mismatching buffers unless the parallel run of ``cfg`` matches the reference bit for bit."""
    report = run_check(cfg, out, activations)
    if not report.bit_exact:
        bad = report.table().filter(pl.col("mismatches") > 0)
        with pl.Config(tbl_rows=20, tbl_cols=-1, tbl_width_chars=200):
            raise AssertionError(f"{report.summary()}\n{bad}")
    return report
