"""Llama-architecture model dimensions: presets, which parallel layouts are valid, pipeline stage
contents and exact per-rank parameter counts (used by tracekit.memory.estimate).

Llama architecture: untied embedding and output head, GQA (k KV heads of a heads), SwiGLU with FFN
width f, RMSNorm, no biases. Under TP (Megatron style, with sequence parallelism) the attention
and MLP projections and the vocabulary are split over t ranks; RMSNorm weights are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tracekit.topology import Layout


class EstimateError(ValueError):
    """An impossible model or parallel configuration."""


@dataclass(frozen=True)
class ModelDims:
    """Llama architecture: untied embedding/head, GQA, SwiGLU, RMSNorm, no biases, no dropout."""

    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    name: str = "custom"

    def __post_init__(self) -> None:
        for f in ("hidden", "ffn_hidden", "heads", "kv_heads", "layers", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise EstimateError(f"model {self.name}: {f} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise EstimateError(
                f"model {self.name}: hidden {self.hidden} not divisible by heads {self.heads}"
            )
        if self.heads % self.kv_heads:
            raise EstimateError(
                f"model {self.name}: heads {self.heads} not divisible by kv_heads {self.kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection: h * k / a."""
        return self.head_dim * self.kv_heads


PRESETS: dict[str, ModelDims] = {
    "llama3-8b": ModelDims(4096, 14336, 32, 8, 32, 128256, "llama3-8b"),
    "llama3-70b": ModelDims(8192, 28672, 64, 8, 80, 128256, "llama3-70b"),
    "llama3-405b": ModelDims(16384, 53248, 128, 8, 126, 128256, "llama3-405b"),
}


def preset(name: str) -> ModelDims:
    key = name.lower().replace("llama-3.1-", "llama3-").replace("llama3.1-", "llama3-")
    if key not in PRESETS:
        raise EstimateError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


# -- validity: the one place that decides whether a configuration can exist ---------------------


def config_problems(model: ModelDims, layout: Layout, seq: int, mbs: int,
                    stage_rule: bool = True) -> list[str]:
    """Why (model, layout, seq, mbs) cannot run; empty when it can.

    Rules: tp divides heads and kv heads (no KV-head replication) and the FFN width (column/row
    split); pp divides the layer count (even stages) or the layer count + 2 (Llama 3's layout, see
    ``stage_layers``; ``stage_rule=False`` when the caller gives each stage's layers itself); seq
    divides into 2*cp chunks (the load-balanced causal CP split) and each CP rank's tokens divide
    over tp (sequence parallelism); seq and mbs are positive. The vocabulary need not divide by tp:
    each TP rank holds ceil(v / t) rows (padded vocab).
    """
    t, c, p = layout.tp, layout.cp, layout.pp
    out = []
    if seq < 1 or mbs < 1:
        out.append(f"seq ({seq}) and mbs ({mbs}) must be >= 1")
    if model.heads % t:
        out.append(f"tp {t} does not divide heads {model.heads}")
    if model.kv_heads % t:
        out.append(f"tp {t} does not divide kv_heads {model.kv_heads}")
    if model.ffn_hidden % t:
        out.append(f"tp {t} does not divide ffn_hidden {model.ffn_hidden}")
    L = model.layers
    if stage_rule and L % p and ((L + 2) % p or (L + 2) // p < 2):
        out.append(f"pp {p} divides neither layers {L} nor layers + 2")
    if seq >= 1 and seq % (2 * c):
        out.append(f"seq {seq} does not split into 2*cp = {2 * c} chunks")
    elif seq >= 1 and (seq // c) % t:
        out.append(f"per-CP-rank tokens {seq // c} do not divide over tp {t} (sequence parallel)")
    return out


def check_config(model: ModelDims, layout: Layout, seq: int, mbs: int, stage_rule: bool = True) -> None:
    problems = config_problems(model, layout, seq, mbs, stage_rule)
    if problems:
        raise EstimateError(f"invalid config {layout} seq={seq} mbs={mbs} for {model.name}: "
                            + "; ".join(problems))


# -- exact parameter counts ---------------------------------------------------------------------


@dataclass(frozen=True)
class StageContents:
    """What one rank's pipeline stage (all of its virtual stages together) holds."""

    layers: int
    embedding: bool
    head: bool  # output projection and the final RMSNorm


def stage_layers(model: ModelDims, pp: int) -> list[int]:
    """Layers per pipeline stage: L/p each, or Llama 3's layout when p divides L + 2 but not L
    (first and last stage hold one layer fewer, since they also hold the embedding and the head)."""
    L = model.layers
    if pp < 1:
        raise EstimateError(f"pp must be >= 1, got {pp}")
    if L % pp == 0:
        return [L // pp] * pp
    if (L + 2) % pp == 0 and (L + 2) // pp >= 2:
        n = (L + 2) // pp
        return [n - 1] + [n] * (pp - 2) + [n - 1]
    raise EstimateError(f"pp {pp} divides neither layers {L} nor layers + 2")


def stage_contents(model: ModelDims, pp: int, stage: int) -> StageContents:
    """What stage ``stage`` of ``pp`` holds: its layers (``stage_layers``); the first stage also
    holds the embedding, the last the head and final norm."""
    if not 0 <= stage < pp:
        raise EstimateError(f"stage {stage} outside 0..{pp - 1}")
    return StageContents(stage_layers(model, pp)[stage], stage == 0, stage == pp - 1)


@dataclass(frozen=True)
class ParamCount:
    """Parameters held by one TP rank of one stage, by module kind (elements, not bytes)."""

    embedding: int
    attention: int  # q, k, v, o projections of all held layers
    mlp: int  # gate, up, down projections
    norms: int  # RMSNorm weights (replicated over TP), including the final norm
    head: int  # output projection

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head


def param_count(model: ModelDims, tp: int, contents: StageContents) -> ParamCount:
    """Exact number of parameters on one TP rank holding ``contents``.

    Q and O are h x h/t, K and V h x (h*k/a)/t, gate/up/down h x f/t, the embedding and head
    ceil(v/t) x h (vocab-parallel, padded); RMSNorm weights (2 per layer, 1 final) are whole on every
    TP rank.
    """
    for name, n in (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn_hidden", model.ffn_hidden)):
        if n % tp:
            raise EstimateError(f"tp {tp} does not divide {name} {n}")
    h, n = model.hidden, contents.layers
    vocab_rows = math.ceil(model.vocab / tp)
    return ParamCount(
        embedding=vocab_rows * h if contents.embedding else 0,
        attention=n * (2 * h * (h // tp) + 2 * h * (model.kv_dim // tp)),
        mlp=n * 3 * h * (model.ffn_hidden // tp),
        norms=n * 2 * h + (h if contents.head else 0),
        head=vocab_rows * h if contents.head else 0,
    )


def total_params(model: ModelDims) -> int:
    """Parameters of the whole unsharded model."""
    return param_count(model, 1, StageContents(model.layers, True, True)).total
