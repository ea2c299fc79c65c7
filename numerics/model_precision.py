"""Precision flags for a real model: the gradient buffers of a trainer config, each fed its real
terms (one per micro-batch and DP x CP rank), judged by ``numerics.precision``'s rule.

Terms are the per-micro-batch gradients of step 0 at the initial weights, computed by the sequential
reference with fp32 compute, so they stand for the exact gradients that a bf16 backward rounds once:
per term, TP shards are concatenated (norm weights: their TP partials summed in fp64) and each CP
rank's partial gradient is its own term (CP ranks see different tokens, like DP ranks).
The buffer is then accumulated as ``precision.accumulate`` models it: micro-batches chained in the
buffer dtype on each rank, ranks summed by the reduction-order model.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import polars as pl
import torch
import yaml

from numerics.plan import AccumulationPlan
from numerics.precision import DEFAULT_THRESHOLD, buffer_precision
from numerics.reference_step import ReferenceRun
from numerics.run_config import RunConfig, RunConfigError


def load_config(path: str | Path) -> RunConfig:
    """A RunConfig from a JSON/YAML file of its fields, or from a run's manifest.json."""
    path = Path(path)
    try:
        text = path.read_text()
        try:  # JSON first: YAML 1.1 reads JSON's 1e-05 as the string "1e-05"
            data = json.loads(text)
        except json.JSONDecodeError:
            data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RunConfigError(f"{path}: cannot read a config: {exc}") from None
    manifest = isinstance(data, dict) and isinstance(data.get("config"), dict)
    if manifest:
        data = data["config"]
    if not isinstance(data, dict):
        raise RunConfigError(f"{path}: expected a mapping of the trainer's config fields (or a manifest with 'config')")
    return RunConfig.from_dict(data, str(path), strict=not manifest)


def gradient_terms(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Per canonical parameter, its gradient terms (micro_batches, dp*cp, numel) in fp64, backward order."""
    cfg = cfg.replace(compute_dtype="fp32", steps=1)
    plan = AccumulationPlan.from_config(cfg)
    n_ranks = cfg.dp * cfg.cp
    terms: dict[str, torch.Tensor] = {}

    def collect(dp: int, mb: int, weights) -> None:
        for bp in plan.buckets:
            for p in bp.params:
                for cp in range(cfg.cp):
                    members = [weights[bp.vstage][cp * cfg.tp + t][p.name].grad.double() for t in range(cfg.tp)]
                    if p.tp_dim is None:
                        g = members[0].clone()
                        for x in members[1:]:
                            g += x
                    else:
                        g = torch.cat(members, p.tp_dim)
                    if p.name not in terms:
                        terms[p.name] = torch.zeros(cfg.micro_batches, n_ranks, g.numel(), dtype=torch.float64)
                    terms[p.name][mb, plan.dp_cp_index(dp, cp)] = g.reshape(-1)

    ReferenceRun(plan).step(term_hook=collect)
    return {name: terms[name] for name in plan.backward_order()}


def model_precision(cfg: RunConfig, threshold: float = DEFAULT_THRESHOLD) -> pl.DataFrame:
    """One row per gradient buffer of ``cfg``'s model (see ``precision.BufferPrecision``)."""
    order = AccumulationPlan.from_config(cfg).order.name
    rows = [asdict(buffer_precision(name, t, order=order, threshold=threshold)) for name, t in gradient_terms(cfg).items()]
    return pl.DataFrame(rows)


def to_json(df: pl.DataFrame) -> str:
    return json.dumps(df.to_dicts(), indent=2)
