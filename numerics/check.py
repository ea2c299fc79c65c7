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

import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import polars as pl
import torch

from numerics.activations import ActivationRecordError, Divergence, assemble, locate, plan_positions, sharding_mismatches
from numerics.compare import Comparison, compare
from numerics.plan import AccumulationPlan
from numerics.reference_step import ReferenceRun
from numerics.run_config import RunConfig, RunConfigError, read_manifest
from numerics.findings import RunStateError, data_findings, missing_buffers, stage_findings
from numerics.verdict import Verdict, classify


class TrainerRunError(RuntimeError):
    """The parallel run could not be made (the trainer failed or could not start)."""


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
    config: RunConfig
    steps: tuple[StepCheck, ...]
    findings: tuple[str, ...] = ()  # structural bugs: the data, the pipeline split, missing buffers
    verdicts: tuple[Verdict, ...] = ()  # one per mismatching (step, buffer), in comparison order

    @property
    def bit_exact(self) -> bool:
        return not self.findings and all(s.comparison.bit_exact for s in self.steps)

    @property
    def status(self) -> str:
        """'match', 'order' (every mismatch within what reordering a sum can do) or 'bug'."""
        if self.bit_exact:
            return "match"
        if self.findings or not self.verdicts or any(v.kind == "bug" for v in self.verdicts):
            return "bug"
        return "order"

    @property
    def first_bug(self) -> Verdict | None:
        return next((v for v in self.verdicts if v.kind == "bug"), None)

    @property
    def first_divergent(self) -> tuple[int, str] | None:
        """(step, buffer name) of the first mismatch; None when everything matches."""
        for s in self.steps:
            d = s.comparison.first_divergent
            if d is not None:
                return s.step, d.name
        return None

    def table(self) -> pl.DataFrame:
        """One row per (step, buffer): mismatches, max ULP (in the buffer's own dtype), errors, the
        norm ratio, the verdict (order/bug) with its location and, for an activation, where it differs."""
        kinds = {(v.step, v.buffer): v for v in self.verdicts}
        frames = []
        for s in self.steps:
            t = s.comparison.table()
            names = t["buffer"].to_list()
            frames.append(t.with_columns(
                pl.lit(s.step).alias("step"),
                pl.Series("norm_ratio", [s.norm_ratio[n] for n in names], dtype=pl.Float64),
                pl.Series("where", [s.where(n).removeprefix(", ") for n in names], dtype=pl.String),
                pl.Series("verdict", [kinds[(s.step, n)].kind if (s.step, n) in kinds else "" for n in names], dtype=pl.String),
                pl.Series("cause", [kinds[(s.step, n)].cause if (s.step, n) in kinds else "" for n in names], dtype=pl.String),
                pl.Series("location", [kinds[(s.step, n)].location if (s.step, n) in kinds else "" for n in names], dtype=pl.String),
            ))
        return pl.concat(frames).select("step", pl.exclude("step"))

    def ulp_histogram(self) -> pl.DataFrame:
        return pl.concat([s.comparison.ulp_histogram().with_columns(pl.lit(s.step).alias("step"))
                          for s in self.steps]).select("step", pl.exclude("step"))

    @property
    def diagnosis(self) -> str:
        """Where the divergence enters, read off the order of the comparison."""
        if self.findings:
            return self.findings[0]
        first = self.first_divergent
        if first is None:
            return "bit-exact: accumulation order fully explained, no bug"
        if self.status == "order":
            sites = sorted({v.cause for v in self.verdicts})
            return f"order only: every mismatching buffer is reproduced within the envelope of {', '.join(sites)}"
        bug = self.first_bug
        step, name = (bug.step, bug.buffer) if bug is not None else first
        sc = self.steps[step]
        at = f" [{bug.location}]" if bug is not None and bug.location else ""
        if name.startswith("act/"):
            loss = next((b for b in sc.comparison.buffers if b.name == "loss"), None)
            text = (f"forward: the first diverging activation is the {name[4:]} output{sc.where(name)}{at}; "
                    f"the loss {'matches' if loss is not None and loss.bit_exact else 'differs'}")
            if sc.sharding:
                text += "\ninput sharding differs from the plan: " + "; ".join(sc.sharding)
            return text
        if name == "loss":
            if any(b.name.startswith("act/") for b in sc.comparison.buffers):
                return ("forward: every recorded activation matches but the loss differs (the per-token losses "
                        "match: their normalization by the tokens of the step, or the loss reduction over ranks)")
            return "forward: the loss differs (data sharding, masking or forward compute)"
        if name.startswith("param/"):
            return f"optimizer: gradients match, updated parameter {name[6:]} differs{at}"
        grads = [b for b in sc.comparison.buffers if b.name.startswith("grad/")]
        bad = [b for b in grads if not b.bit_exact]
        ratios = sorted({_ratio_text(sc.norm_ratio[b.name]) for b in bad})
        # a backward bug spares the gradients computed before it; a reduction bug hits (nearly) all
        if len(bad) == len(grads) or (len(ratios) == 1 and 2 * len(bad) > len(grads)):
            return (f"gradient reduction: the loss matches, {len(bad)}/{len(grads)} gradients differ, "
                    f"norm ratio {', '.join(ratios[:4])} (a scaling or reduction bug){at}")
        return f"backward: the loss matches; the first wrong gradient in backward order is {name[5:]}{at}"

    def summary(self) -> str:
        """One paragraph: the verdict and, on mismatch, where it starts."""
        if self.findings:
            more = f" (+{len(self.findings) - 1} more)" if len(self.findings) > 1 else ""
            return f"BUG: {self.findings[0]}{more}"
        first = self.first_divergent
        if first is None:
            n = sum(len(s.comparison.buffers) for s in self.steps)
            return f"bit-exact: {n} buffers over {len(self.steps)} step(s), 0 mismatching elements"
        bug = self.first_bug
        step, name = (bug.step, bug.buffer) if bug is not None else first
        sc = self.steps[step]
        d = next(b for b in sc.comparison.buffers if b.name == name)
        n_bad = sum(not b.bit_exact for s in self.steps for b in s.comparison.buffers)
        n_all = sum(len(s.comparison.buffers) for s in self.steps)
        head = "BUG" if self.status == "bug" else "ORDER ONLY"
        what = ("first diverging buffer" if bug is None or (step, name) == first
                else "first buffer outside the reordering envelope")
        return (f"{head}: {what} {name!r} (module {d.module}) at step {step}: "
                f"{d.mismatches}/{d.numel} elements differ, max {d.max_ulp} ULP ({d.dtype}), normwise rel. error "
                f"{d.rel_err:.3g}{sc.where(name)}; {n_bad} of {n_all} buffers differ\n{self.diagnosis}")


def _ratio_text(r: float) -> str:
    """A norm ratio with the digits that matter: 0.5, or 1+1.19e-07 for a ratio next to 1."""
    return f"{r:.6g}" if abs(r - 1) > 1e-4 or r == 1 else f"1{r - 1:+.3g}"


def flatten_state(plan: AccumulationPlan, state: dict, step: int, source: str,
                  skip_missing: bool = False) -> dict[str, torch.Tensor]:
    """One step's dump as named buffers: ``act/<point>`` (reassembled by the plan), ``loss``,
    ``grad/<name>``, ``param/<name>`` in comparison order; names the dump lacks are left out."""
    out: dict[str, torch.Tensor] = {}
    if plan.cfg.record_activations:
        try:
            acts = assemble(plan, state["activations"], plan_positions(plan, step), source, skip_missing)
        except (KeyError, ActivationRecordError) as exc:
            raise RunStateError(f"step {step}: activation records unusable: {exc}") from None
        out.update({f"act/{p}": t for p, t in acts.items()})
    # the trainer's loss is an fp32 all-reduce result handed out as a Python float: compare it in fp32
    out["loss"] = torch.tensor(float(state["loss"]), dtype=torch.float32)
    for key, prefix in (("grads", "grad/"), ("params", "param/")):
        for name in plan.backward_order():
            if name in state[key]:
                out[prefix + name] = state[key][name]
    return out


def buffer_dtypes(plan: AccumulationPlan) -> dict[str, torch.dtype]:
    """The dtype each compared value was last rounded to (ULPs are counted in it): activations in
    the compute dtype (token losses fp32), reduced gradients in the reduce dtype (ZeRO-2: the
    accumulation dtype of its shard sum), parameters and the loss fp32."""
    grad = plan.accum_dtype if plan.cfg.zero_stage == 2 else plan.reduce_dtype
    out = {"loss": torch.float32}
    for name in plan.backward_order():
        out[f"grad/{name}"], out[f"param/{name}"] = grad, torch.float32
    return out


def compare_states(parallel: Sequence[dict], reference: Sequence[dict], plan: AccumulationPlan,
                   skip_missing: bool = False) -> tuple[StepCheck, ...]:
    """Step by step; with ``record_activations`` in the plan's config the forward activations too
    (both sides reassembled from the plan's positions; the trainer's recorded positions checked).
    Buffers the parallel run lacks are left out here (``missing_buffers`` names them)."""
    out, dtypes = [], buffer_dtypes(plan)
    for step, (a, b) in enumerate(zip(parallel, reference)):
        fa = flatten_state(plan, a, step, f"parallel step {step}", skip_missing)
        fb = flatten_state(plan, b, step, f"reference step {step}")
        sharding: tuple[str, ...] = ()
        if plan.cfg.record_activations:
            try:
                sharding = sharding_mismatches(plan, a["positions"], plan_positions(plan, step), f"parallel step {step}")
            except (KeyError, ActivationRecordError) as exc:
                raise RunStateError(f"step {step}: activation records unusable: {exc}") from None
        names = [n for n in fb if n in fa and fa[n].shape == fb[n].shape and fa[n].dtype == fb[n].dtype]
        ratio = {}
        for n in names:
            na, nb = float(fa[n].double().norm()), float(fb[n].double().norm())
            ratio[n] = na / nb if nb else (1.0 if na == 0 else float("inf"))
        where = {n: d for n in names if n.startswith("act/") and (d := locate(n[4:], fa[n], fb[n])) is not None}
        out.append(StepCheck(step, compare({n: fa[n] for n in names}, {n: fb[n] for n in names}, names, dtypes),
                              ratio, where, sharding))
    return tuple(out)


def load_states(run_dir: str | Path, steps: int, activations: bool = False) -> list[dict]:
    """The trainer's ``<run>/state/step<k>.pt`` dumps for k < steps (``activations``: they must
    carry activation records)."""
    states = []
    for k in range(steps):
        path = Path(run_dir) / "state" / f"step{k}.pt"
        if not path.exists():
            raise RunStateError(f"{path}: missing (was the run made with --dump-state and {steps} steps?)")
        try:
            state = torch.load(path, weights_only=True)
        except Exception as exc:  # torch raises many kinds for a damaged file
            raise RunStateError(f"{path}: cannot be read: {exc}") from None
        if not isinstance(state, dict) or not {"loss", "grads", "params"} <= set(state):
            raise RunStateError(f"{path}: expected a dict with loss, grads and params")
        if activations and not {"activations", "positions"} <= set(state):
            raise RunStateError(f"{path}: no activation records (was the run made with --record-activations?)")
        states.append(state)
    return states


def reference_states(cfg: Any, plan: AccumulationPlan | None = None) -> list[dict]:
    """The sequential reference's state after each of ``cfg.steps`` steps."""
    run = ReferenceRun(plan or AccumulationPlan.from_config(cfg))
    return [run.step() for _ in range(run.plan.cfg.steps)]


def check_run(run_dir: str | Path, cfg: Any = None, envelope: bool = True) -> CheckReport:
    """Compare a finished ``--dump-state`` run with the sequential reference. The config is the
    run's manifest's (``cfg``, a RunConfig or mapping of fields, overrides it). ``envelope``: on a
    mismatch, classify each mismatching buffer as order or bug (re-runs the reference)."""
    manifest = read_manifest(run_dir)
    if cfg is None:
        cfg = RunConfig.from_dict(manifest["config"], str(Path(run_dir) / "manifest.json"))
    plan = AccumulationPlan.from_config(cfg)
    parallel = load_states(run_dir, plan.cfg.steps, plan.cfg.record_activations)
    reference = reference_states(plan.cfg, plan)
    split = stage_findings(plan, manifest)  # a run with layers on no stage lacks their records
    findings = split + data_findings(plan, parallel) + missing_buffers(parallel, reference, plan, flatten_state, bool(split))
    steps = compare_states(parallel, reference, plan, bool(split))
    report = CheckReport(plan.cfg, steps, findings)
    if not envelope or report.bit_exact or findings:
        return report  # a structural bug needs no envelope: no reordering drops a layer or changes data
    return CheckReport(plan.cfg, steps, findings, classify(plan, steps, parallel, reference, flatten_state))


# -- running the trainer: only through its command line --------------------------------------------
def trainer_args(fields: Mapping[str, Any]) -> list[str]:
    """Command-line flags of the trainer for a mapping of its config fields."""
    args: list[str] = []
    for k, v in fields.items():
        flag = "--" + k.replace("_", "-")
        if k == "faults":
            args += [a for spec in str(v).split(";") if spec for a in ("--fault", spec)]
        elif isinstance(v, bool):
            args.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            args += [flag, str(v)]
    return args


STRICT_ORDER = {"compute_dtype": "fp32", "grad_accum_dtype": "bf16", "reduce_dtype": "bf16"}


def run_trainer(args: Sequence[str], out: Path) -> None:
    """``python -m reference_trainer --out OUT ARGS`` in a subprocess; a refused config is bad
    input (``RunConfigError``), any other failure ``TrainerRunError``; both carry the trainer's last line."""
    proc = subprocess.run([sys.executable, "-m", "reference_trainer", "--out", str(out), *args],
                          capture_output=True, text=True)
    if proc.returncode == 0:
        return
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode == 2:
        raise RunConfigError(f"the trainer refused the config: {last}")
    raise TrainerRunError(f"the parallel run failed (exit {proc.returncode}): {last}")


def run_check(cfg: Any = None, out: str | Path | None = None, activations: bool = True,
              strict_order: bool = False, args: Sequence[str] = ()) -> CheckReport:
    """Run the trainer (its command line, ``cfg``'s fields as flags, then ``args``) with its state
    dumped, then the reference, and compare. ``activations`` records and compares every
    micro-batch's forward activations; ``strict_order`` runs fp32 compute with bf16 buffers, where a
    wrong summation order changes bits (docs/numerics.md)."""
    fields = dict(cfg.as_dict() if hasattr(cfg, "as_dict") else cfg or {})
    fields.pop("record_activations", None)
    fields.pop("dump_state", None)
    flags = trainer_args(fields) + list(args) + ["--dump-state"]
    flags.append("--record-activations" if activations else "--no-record-activations")
    if strict_order:
        flags += trainer_args(STRICT_ORDER)
    with tempfile.TemporaryDirectory(prefix="numerics-check-") as tmp:
        run_dir = Path(out) if out is not None else Path(tmp)
        run_trainer(flags, run_dir)
        return check_run(run_dir)


def assert_parallel_matches_reference(cfg: Any, out: str | Path | None = None,
                                      activations: bool = True) -> CheckReport:
    """pytest-friendly: raise AssertionError with the first diverging buffer and the table of
    mismatching buffers unless the parallel run of ``cfg`` matches the reference bit for bit."""
    report = run_check(cfg, out, activations)
    if not report.bit_exact:
        bad = report.table().filter(pl.col("mismatches") > 0)
        with pl.Config(tbl_rows=20, tbl_cols=-1, tbl_width_chars=200):
            raise AssertionError(f"{report.summary()}\n{bad}")
    return report
