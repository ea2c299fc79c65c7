"""Per-GPU memory of a Llama-architecture model under 4D parallelism (Fujii, Watanabe, Yokota 2024).

Two views of the same model:

- ``paper_estimate``: the paper's formula verbatim (first pipeline stage, 1F1B, bf16 weights, fp32
  gradients, fp32 master weights and Adam moments sharded over dp x cp, FlashAttention, TP with
  sequence parallelism). Real-valued, as in the paper.
- ``estimate_rank``: the same terms built from exact integer parameter counts of one rank's stage
  (``param_count``), with the bytes per parameter, the ZeRO stage, the stage contents and the number
  of micro-batches in flight made explicit, so it can be applied to a concrete trainer config and
  compared with measured peaks and real tensors.

Symbols: h hidden, f FFN hidden, a heads, k KV heads, L layers, v vocabulary; t, c, p, d the TP, CP,
PP, DP sizes; s sequence length, b micro-batch size. Bytes are reported as bytes and GiB (1024^3).
The verdict follows the paper's 454-run rule of thumb: an estimate <= 80% of device memory never ran
out of memory, between 80% and 100% it may, above 100% it will.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from tracekit.memory.llama_dims import (  # re-exported: the estimator's public API in one import
    PRESETS,
    EstimateError,
    ModelDims,
    ParamCount,
    StageContents,
    check_config,
    config_problems,
    param_count,
    preset,
    stage_contents,
    stage_layers,
    total_params,
)
from tracekit.topology import Layout

__all__ = [
    "GIB", "PRESETS", "SAFE_FRACTION", "EstimateError", "MemoryEstimate", "ModelDims", "ParamCount",
    "StageContents", "StateBuffer", "StateBytes", "check_config", "config_problems",
    "estimate_rank", "paper_estimate", "param_count", "preset", "stage_contents", "stage_layers",
    "sweep", "total_params", "verdict",
]


GIB = 1024**3
SAFE_FRACTION = 0.8  # the paper's "never OOM below 80%" threshold


# -- bytes ---------------------------------------------------------------------------------------


COMPONENTS = ("weights", "gradients", "optimizer")
EXTENTS = ("params", "padded", "shard")


@dataclass(frozen=True)
class StateBuffer:
    """One per-parameter buffer of the model state: what it counts toward, its bytes per element
    and its extent over one flat buffer (bucket) of N parameters sharded over d*c ranks:
    ``params`` N elements (unsharded tensors), ``padded`` ceil(N/(d*c))*d*c (a whole flat buffer
    padded for sharding), ``shard`` ceil(N/(d*c)) (this rank's ZeRO shard)."""

    component: str
    bytes_per_element: int
    extent: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise EstimateError(f"state buffer component must be one of {COMPONENTS}, got {self.component!r}")
        if self.extent not in EXTENTS:
            raise EstimateError(f"state buffer extent must be one of {EXTENTS}, got {self.extent!r}")
        if self.bytes_per_element < 0:
            raise EstimateError(f"bytes per element must be >= 0, got {self.bytes_per_element}")

    def elements(self, n: int, shards: int) -> int:
        shard = -(-n // shards)
        return {"params": n, "padded": shard * shards, "shard": shard}[self.extent]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state and the ZeRO stage that shards them over dp x cp.

    The paper's 18 bytes: 2 bf16 weight + 4 fp32 gradient + 4 fp32 master + 8 Adam (m, v), with
    ZeRO stage 1 (master and moments sharded). Stage 2 also shards gradients, 3 also weights.
    A shorthand for the common cases; any other arrangement is a tuple of ``StateBuffer``.
    """

    weight: int = 2
    gradient: int = 4
    master: int = 4
    optimizer: int = 8
    zero_stage: int = 1

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise EstimateError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for f in ("weight", "gradient", "master", "optimizer"):
            if getattr(self, f) < 0:
                raise EstimateError(f"{f} bytes per parameter must be >= 0")

    def buffers(self) -> tuple[StateBuffer, ...]:
        z = self.zero_stage
        return (
            StateBuffer("weights", self.weight, "shard" if z >= 3 else "params", "weight"),
            StateBuffer("gradients", self.gradient, "shard" if z >= 2 else "params", "gradient"),
            StateBuffer("optimizer", self.master, "shard" if z >= 1 else "params", "master"),
            StateBuffer("optimizer", self.optimizer, "shard" if z >= 1 else "params", "moments"),
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by component. ``optimizer`` includes the fp32 master weights."""

    model: str
    formula: str  # "paper" | "exact"
    tp: int
    cp: int
    pp: int
    dp: int
    seq: int
    mbs: int
    stage: int
    params: float  # parameters held by this rank (before ZeRO sharding)
    weights: float
    gradients: float
    optimizer: float
    activations: float
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def gib(self) -> dict[str, float]:
        return {k: getattr(self, k) / GIB
                for k in ("weights", "gradients", "optimizer", "activations", "total")}

    def verdict(self, device_gib: float) -> str:
        return verdict(self.total, device_gib * GIB)

    def as_dict(self, device_gib: float | None = None) -> dict:
        d = asdict(self)
        d["model_states"] = self.model_states
        d["total"] = self.total
        d["gib"] = self.gib()
        if device_gib is not None:
            d["device_gib"] = device_gib
            d["fraction_of_device"] = self.total / (device_gib * GIB)
            d["verdict"] = self.verdict(device_gib)
        return d


def verdict(total_bytes: float, device_bytes: float) -> str:
    """fits (<= 80% of the device), may-not-fit (80-100%: buffers, fragmentation), will-not-fit."""
    if device_bytes <= 0:
        raise EstimateError(f"device size must be positive, got {device_bytes} bytes")
    frac = total_bytes / device_bytes
    return "fits" if frac <= SAFE_FRACTION else "may-not-fit" if frac <= 1.0 else "will-not-fit"


def _activation_terms(model: ModelDims, t: int, c: int, s: int, b: int) -> tuple[float, float, float]:
    """(per layer per micro-batch, embedding input per micro-batch, head) in bytes, bf16 activations.

    Per layer s*b*h*(12 + 4k/a + 8f/h)/(t*c): norm inputs and outputs, Q, K, V, attention output
    (FlashAttention keeps no s^2 scores) and the SwiGLU intermediates; all split by TP (sequence
    parallel) and CP. The embedding input is 8*s*b*h/(t*c); the head 4*s*b*h*(1 + v/h)/(t*c).
    """
    h, a, k, f, v = model.hidden, model.heads, model.kv_heads, model.ffn_hidden, model.vocab
    unit = s * b * h / (t * c)
    return unit * (12 + 4 * k / a + 8 * f / h), unit * 8, unit * 4 * (1 + v / h)


def paper_estimate(model: ModelDims, layout: Layout, seq: int, mbs: int) -> MemoryEstimate:
    """The paper's formula for the first pipeline stage under 1F1B, exactly as published.

    L/p is taken as a real number, as in the paper, also where p divides only L + 2."""
    check_config(model, layout, seq, mbs)
    h, a, k, f, v, L = (model.hidden, model.heads, model.kv_heads, model.ffn_hidden, model.vocab,
                        model.layers)
    t, c, p, d = layout.tp, layout.cp, layout.pp, layout.dp
    vocab_term = h * v / t if p > 1 else 2 * h * v / t + h
    params = vocab_term + 2 * (L / p) * h**2 * ((1 + k / a + 1.5 * f / h) / t + 1 / h)
    per_layer, embed, head = _activation_terms(model, t, c, seq, mbs)
    acts = per_layer * L + embed * p + (head if p == 1 else 0.0)
    return MemoryEstimate(
        model=model.name, formula="paper", tp=t, cp=c, pp=p, dp=d, seq=seq, mbs=mbs, stage=0,
        params=params, weights=2 * params, gradients=4 * params, optimizer=12 * params / (d * c),
        activations=acts,
        detail={"act_layers": per_layer * L, "act_embedding": embed * p,
                "act_head": head if p == 1 else 0.0},
    )


def estimate_rank(
    model: ModelDims,
    layout: Layout,
    seq: int,
    mbs: int,
    *,
    stage: int = 0,
    contents: StageContents | Sequence[StageContents] | None = None,
    state: StateBytes | Sequence[StateBuffer] = StateBytes(),
    microbatches_in_flight: int | None = None,
    activation_bytes: int = 2,
    attention_matrix_bytes: int = 0,
) -> MemoryEstimate:
    """One rank of ``stage`` from exact parameter counts; the knobs the paper fixes are arguments.

    ``contents`` defaults to ``stage_contents``; a sequence means one flat buffer per entry (e.g. per
    virtual stage), each padded to a multiple of d*c on its own. ``state`` is ``StateBytes`` or
    explicit ``StateBuffer``s. ``microbatches_in_flight`` is the number of micro-batches whose
    activations the stage holds at its peak: p - stage under 1F1B (the default), the micro-batch
    count under all-forward-all-backward. The head term counts once (its backward runs right after
    its forward). ``activation_bytes`` scales the bf16 coefficients (4 for fp32 compute).
    ``attention_matrix_bytes``: bytes per attention-score element kept for backward by an attention
    that materializes them (0 with FlashAttention, as the paper assumes; e.g. 4 + 2 for fp32 scores
    kept by softmax plus bf16 probabilities): b*(a/t)*(s/c)*s elements per layer and micro-batch
    (queries of this CP rank against all gathered keys).
    """
    check_config(model, layout, seq, mbs, stage_rule=contents is None)
    t, c, p, d = layout.tp, layout.cp, layout.pp, layout.dp
    if not 0 <= stage < p:
        raise EstimateError(f"stage {stage} outside 0..{p - 1}")
    contents = contents if contents is not None else stage_contents(model, p, stage)
    buckets = [contents] if isinstance(contents, StageContents) else list(contents)
    if not buckets:
        raise EstimateError("contents must name at least one stage")
    inflight = p - stage if microbatches_in_flight is None else microbatches_in_flight
    if inflight < 1:
        raise EstimateError(f"microbatches_in_flight must be >= 1, got {inflight}")
    buffers = state.buffers() if isinstance(state, StateBytes) else tuple(state)
    counts = [param_count(model, t, b).total for b in buckets]
    held = {comp: 0 for comp in COMPONENTS}
    for buf in buffers:
        held[buf.component] += buf.bytes_per_element * sum(buf.elements(n, d * c) for n in counts)
    layers = sum(b.layers for b in buckets)
    per_layer, embed, head = _activation_terms(model, t, c, seq, mbs)
    scale = activation_bytes / 2
    act_layers = per_layer * layers * inflight * scale
    act_embed = embed * inflight * scale if any(b.embedding for b in buckets) else 0.0
    act_head = head * scale if any(b.head for b in buckets) else 0.0
    scores = mbs * (model.heads // t) * (seq // c) * seq
    act_attention = attention_matrix_bytes * scores * layers * inflight
    return MemoryEstimate(
        model=model.name, formula="exact", tp=t, cp=c, pp=p, dp=d, seq=seq, mbs=mbs, stage=stage,
        params=sum(counts),
        weights=held["weights"], gradients=held["gradients"], optimizer=held["optimizer"],
        activations=act_layers + act_embed + act_head + act_attention,
        detail={"act_layers": act_layers, "act_embedding": act_embed, "act_head": act_head,
                "act_attention_matrices": act_attention,
                "shard_params": sum(-(-n // (d * c)) for n in counts),
                "microbatches_in_flight": inflight},
    )


# -- sweep ---------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def sweep(
    model: ModelDims,
    gpus: int,
    seq: int,
    *,
    mbs_values: tuple[int, ...] = (1, 2, 4),
    device_gib: float = 80.0,
    global_batch: int | None = None,
    max_tp: int | None = None,
):
    """Every valid (tp, cp, pp, mbs) on ``gpus`` GPUs with the paper's estimate, smallest first.

    dp = gpus / (tp*cp*pp) must be whole; validity per ``config_problems``. With ``global_batch``
    (sequences per step) mbs*dp must divide it. ``max_tp`` caps TP (e.g. GPUs per NVLink domain).
    Returns a polars DataFrame with GiB by component, the fraction of the device and the verdict.
    """
    import polars as pl

    if gpus < 1:
        raise EstimateError(f"gpus must be >= 1, got {gpus}")
    if device_gib <= 0:
        raise EstimateError(f"device size must be positive, got {device_gib} GiB")
    if not mbs_values or any(m < 1 for m in mbs_values):
        raise EstimateError(f"micro-batch sizes must be >= 1, got {mbs_values!r}")
    rows = []
    for tp in _divisors(gpus):
        if max_tp is not None and tp > max_tp:
            continue
        for cp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                layout = Layout(tp=tp, cp=cp, pp=pp, dp=gpus // (tp * cp * pp))
                for mbs in mbs_values:
                    if config_problems(model, layout, seq, mbs):
                        continue
                    if global_batch is not None and global_batch % (mbs * layout.dp):
                        continue
                    e = paper_estimate(model, layout, seq, mbs)
                    g = e.gib()
                    rows.append({
                        "tp": tp, "cp": cp, "pp": pp, "dp": layout.dp, "mbs": mbs,
                        "weights_gib": g["weights"], "gradients_gib": g["gradients"],
                        "optimizer_gib": g["optimizer"], "activations_gib": g["activations"],
                        "total_gib": g["total"], "fraction": e.total / (device_gib * GIB),
                        "verdict": e.verdict(device_gib),
                    })
    schema = {"tp": pl.Int64, "cp": pl.Int64, "pp": pl.Int64, "dp": pl.Int64, "mbs": pl.Int64,
              "weights_gib": pl.Float64, "gradients_gib": pl.Float64, "optimizer_gib": pl.Float64,
              "activations_gib": pl.Float64, "total_gib": pl.Float64, "fraction": pl.Float64,
              "verdict": pl.Utf8}
    return pl.DataFrame(rows, schema=schema).sort(["total_gib", "tp", "cp", "pp", "mbs"])
