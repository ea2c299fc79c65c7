"""Which gradient buffers need FP32, measured on the run's own training steps.

For the run's config (model dims, dp, cp, micro-batches, compute dtype, reduction order from its
manifest), the sequential reference trains ``steps`` steps with fp64 gradient accumulation and
reduction (the exact trajectory) and hands over every micro-batch's gradient as backward produced it
(compute dtype: the terms a real buffer is fed). Per buffer and step, two errors are measured apart:

- accumulation: each DP x CP rank chains its micro-batch terms in bf16 or fp32, against the same
  chain in fp64 (normwise over the ranks' buffers);
- reduce: the ranks' exact buffers rounded to bf16 or fp32 and summed by the run's reduction-order
  model in that dtype, against their fp64 sum.

Both are compared with the bf16 storage floor F (rounding the exact reduced gradient once to bf16,
which any bf16 buffer pays). A site needs FP32 for a buffer when its bf16 error exceeds
``threshold`` x F (median over the steps); the verdict is taken on ``seeds`` data/init seeds and is
"borderline" where the seeds disagree, so no buffer flips silently. A loss-divergence check trains the
same steps with each (accumulation, reduce) dtype pair and reports the largest loss difference from
the fp64 trajectory. Llama 3 (sec. 6.2) accumulates and reduces gradients in FP32; the summary says
whether this run's measurements agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

import torch

from numerics.plan import AccumulationPlan
from numerics.reduction_order import chained_sum
from numerics.reference_step import ReferenceRun
from numerics.run_config import RunConfig

PAIRS = (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16"), ("fp32", "fp32"))
_DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class BufferVerdict:
    buffer: str
    numel: int
    terms: int  # micro-batches x dp x cp
    accum_bf16: float  # median normwise error over steps and seeds
    accum_fp32: float
    reduce_bf16: float
    reduce_fp32: float
    floor: float
    accum_growth: float  # bf16 accumulation error, last step / first step (median over seeds)
    accumulation: str  # "needs FP32", "bf16 ok" or "borderline (n/k seeds)": n of k seeds need FP32
    reduce: str


@dataclass(frozen=True)
class PrecisionReport:
    config: RunConfig
    steps: int
    seeds: tuple[int, ...]
    threshold: float
    buffers: tuple[BufferVerdict, ...]
    loss_divergence: dict[str, float]  # "accum/reduce" -> max |loss - fp64 loss| over steps and seeds

    def summary(self) -> str:
        n = len(self.buffers)

        def count(site: str) -> str:
            need = sum(getattr(b, site) == "needs FP32" for b in self.buffers)
            border = sum(getattr(b, site).startswith("borderline") for b in self.buffers)
            return f"{need}/{n} need FP32" + (f", {border} borderline" if border else "")

        c = self.config
        acc_need = any(b.accumulation != "bf16 ok" for b in self.buffers)
        red_need = any(b.reduce != "bf16 ok" for b in self.buffers)
        advice = f"accumulate in {'FP32' if acc_need else 'BF16'}, reduce in {'FP32' if red_need else 'BF16'}"
        llama = ("agrees with Llama 3 (FP32 accumulation and reduce)" if acc_need and red_need else
                 "Llama 3 uses FP32 for both; here BF16 suffices for "
                 + " and ".join(s for s, need in (("accumulation", acc_need), ("reduce", red_need)) if not need))
        loss = ", ".join(f"{k} {v:.2g}" for k, v in self.loss_divergence.items())
        return (f"{advice}: accumulation {count('accumulation')}, reduce {count('reduce')} "
                f"(dp {c.dp} x cp {c.cp} x {c.micro_batches} micro-batches, {self.steps} steps, seeds "
                f"{list(self.seeds)}); {llama}. Max loss difference from fp64 (accum/reduce): {loss}")


def _normwise(x: torch.Tensor, exact: torch.Tensor) -> float:
    norm = float(exact.norm())
    err = float((x.double() - exact).norm())
    return err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))


def _terms_of_step(run: ReferenceRun) -> tuple[dict, dict[str, torch.Tensor]]:
    """One step; per canonical parameter its terms (micro_batches, dp*cp, numel) as fed to the buffers."""
    plan, c = run.plan, run.plan.cfg
    terms: dict[str, torch.Tensor] = {}

    def collect(dp: int, mb: int, weights) -> None:
        for bp in plan.buckets:
            for p in bp.params:
                for cp in range(c.cp):
                    parts = [weights[bp.vstage][cp * c.tp + t][p.name].grad for t in range(c.tp)]
                    g = chained_sum([x.double() for x in parts]) if p.tp_dim is None else torch.cat(parts, p.tp_dim)
                    if p.name not in terms:
                        terms[p.name] = torch.zeros(c.micro_batches, c.dp * c.cp, g.numel(), dtype=g.dtype)
                    terms[p.name][mb, plan.dp_cp_index(dp, cp)] = g.reshape(-1)

    state = run.step(term_hook=collect)
    return state, terms


def _errors(plan: AccumulationPlan, t: torch.Tensor) -> dict[str, float]:
    ranks = t.shape[1]
    exact_rank = [chained_sum([t[i, r].double() for i in range(t.shape[0])]) for r in range(ranks)]
    exact = chained_sum(exact_rank)
    stacked = torch.stack(exact_rank)
    out = {"floor": _normwise(exact.to(torch.bfloat16), exact)}
    for name, dt in _DT.items():
        acc = torch.stack([chained_sum([t[i, r].to(dt) for i in range(t.shape[0])]) for r in range(ranks)])
        out[f"accum_{name}"] = _normwise(acc, stacked)
        red = plan.order_of("dp").all_reduce([x.to(dt) for x in exact_rank]) if ranks > 1 else exact_rank[0].to(dt)
        out[f"reduce_{name}"] = _normwise(red, exact)
    return out


def _verdict(ratios: list[float], threshold: float) -> str:
    need = sum(r > threshold for r in ratios)
    if need == len(ratios):
        return "needs FP32"
    return "bf16 ok" if need == 0 else f"borderline ({need}/{len(ratios)} seeds)"


def precision_experiment(cfg, steps: int = 3, seeds: int = 3, threshold: float = 2.0) -> PrecisionReport:
    """Measure accumulation and reduce errors of every buffer over ``steps`` steps for ``seeds`` seeds."""
    base = RunConfig.coerce(cfg).replace(steps=steps, record_activations=False)
    seed_list = tuple(base.seed + k for k in range(seeds))
    per_seed: list[dict[str, list[dict[str, float]]]] = []
    loss_div = {f"{a}/{r}": 0.0 for a, r in PAIRS}
    for seed in seed_list:
        c = base.replace(seed=seed, grad_accum_dtype="fp64", reduce_dtype="fp64")
        exact_run = ReferenceRun(AccumulationPlan(c))
        errs: dict[str, list[dict[str, float]]] = {}
        exact_losses = []
        for _ in range(steps):
            state, terms = _terms_of_step(exact_run)
            exact_losses.append(state["loss"])
            for name, t in terms.items():
                errs.setdefault(name, []).append(_errors(exact_run.plan, t))
        per_seed.append(errs)
        for a, r in PAIRS:
            run = ReferenceRun(AccumulationPlan(base.replace(seed=seed, grad_accum_dtype=a, reduce_dtype=r)))
            losses = [run.step()["loss"] for _ in range(steps)]
            loss_div[f"{a}/{r}"] = max(loss_div[f"{a}/{r}"], *(abs(x - y) for x, y in zip(losses, exact_losses)))
    plan = AccumulationPlan.from_config(base)
    rows = []
    for name in plan.backward_order():
        if name not in per_seed[0]:
            continue
        seeds_errs = [s[name] for s in per_seed]

        def med(key: str) -> float:
            return median(e[key] for errs in seeds_errs for e in errs)

        def ratio(errs: list[dict[str, float]], key: str) -> float:
            floor = median(e["floor"] for e in errs)
            err = median(e[key] for e in errs)
            return err / floor if floor > 0 else (0.0 if err == 0 else float("inf"))

        growth = median(e[-1]["accum_bf16"] / e[0]["accum_bf16"] if e[0]["accum_bf16"] > 0 else 1.0 for e in seeds_errs)
        numel = 1
        for p in plan.params:
            if p.name == name:
                for s in p.shape:
                    numel *= s
        rows.append(BufferVerdict(
            name, numel, base.micro_batches * base.dp * base.cp, med("accum_bf16"), med("accum_fp32"),
            med("reduce_bf16"), med("reduce_fp32"), med("floor"), growth,
            _verdict([ratio(e, "accum_bf16") for e in seeds_errs], threshold),
            _verdict([ratio(e, "reduce_bf16") for e in seeds_errs], threshold)))
    return PrecisionReport(base, steps, seed_list, threshold, tuple(rows), loss_div)
