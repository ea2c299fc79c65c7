"""The memory estimator applied to a reference-trainer run, from its manifest alone.

The trainer (reference_trainer/data_parallel.py) keeps, per virtual pipeline stage, one flat bucket
of this rank's parameters sharded over the dp x cp group and padded to a multiple of its size:

- weights: the parameters themselves, in the compute dtype (not padded);
- gradients: the whole padded bucket in ``grad_accum_dtype``, this rank's reduce-scatter shard in
  ``grad_accum_dtype``, and (from the first optimizer step on) the reduced fp32 shard AdamW used;
- optimizer: the fp32 master shard and AdamW's two fp32 moment shards.

Those buffers are described here once, as ``StateBuffer``s, and ``estimate_rank`` does the
arithmetic. The manifest supplies the model dims, layout, dtypes and the layers of every virtual
stage (``stage_layers``), so nothing about the trainer's layer split is re-derived here.
"""

from __future__ import annotations

from typing import Mapping

from tracekit.memory.estimate import MemoryEstimate, StateBuffer, estimate_rank
from tracekit.memory.llama_dims import EstimateError, ModelDims, StageContents
from tracekit.topology import Layout

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def trainer_state(compute_dtype: str, grad_accum_dtype: str, after_first_step: bool = True
                  ) -> tuple[StateBuffer, ...]:
    """The per-bucket state buffers of the reference trainer for its dtypes."""
    try:
        w, g = DTYPE_BYTES[compute_dtype], DTYPE_BYTES[grad_accum_dtype]
    except KeyError as e:
        raise EstimateError(f"unknown dtype {e.args[0]!r}; expected one of {sorted(DTYPE_BYTES)}") from None
    bufs = [
        StateBuffer("weights", w, "params", "parameters"),
        StateBuffer("gradients", g, "padded", "grad"),
        StateBuffer("gradients", g, "shard", "grad_shard"),
        StateBuffer("optimizer", 4, "shard", "master"),
        StateBuffer("optimizer", 8, "shard", "exp_avg+exp_avg_sq"),
    ]
    if after_first_step:
        bufs.append(StateBuffer("gradients", 4, "shard", "reduced"))
    return tuple(bufs)


def _require(d: Mapping, key: str, where: str):
    if key not in d:
        raise EstimateError(f"trainer manifest: {where} lacks {key!r}")
    return d[key]


def trainer_estimate(manifest: Mapping, rank: int, after_first_step: bool = True) -> MemoryEstimate:
    """Estimate for ``rank`` of a reference-trainer run described by its ``manifest.json`` dict.

    Activations use the paper's per-layer coefficients scaled to the compute dtype, plus the
    attention matrices this trainer keeps (it does not use FlashAttention: softmax keeps its fp32
    output and the product keeps the probabilities in the compute dtype), with the micro-batches in
    flight of the schedule: all of them under all-forward-all-backward, and under 1F1B
    min(micro_batches, pp - stage) (an approximation for interleaving)."""
    cfg = _require(manifest, "config", "manifest")
    layout = Layout(**{d: int(_require(_require(manifest, "layout", "manifest"), d, "layout"))
                       for d in ("tp", "cp", "pp", "dp")})
    per_vstage = _require(manifest, "stage_layers", "manifest")
    model = ModelDims(hidden=cfg["dim"], ffn_hidden=cfg["ffn_dim"], heads=cfg["n_heads"],
                      kv_heads=cfg["n_kv_heads"], layers=cfg["n_layers"], vocab=cfg["vocab_size"],
                      name="reference-trainer")
    vstages = int(cfg.get("vstages", 1))
    n_vs = layout.pp * vstages
    if len(per_vstage) != n_vs or sum(len(x) for x in per_vstage) != model.layers:
        raise EstimateError(f"trainer manifest: stage_layers has {len(per_vstage)} stages and "
                            f"{sum(len(x) for x in per_vstage)} layers; expected {n_vs} and {model.layers}")
    stage = layout.coords(rank).pp
    mine = [k * layout.pp + stage for k in range(vstages)]  # the trainer's virtual-stage placement
    contents = [StageContents(len(per_vstage[vs]), vs == 0, vs == n_vs - 1) for vs in mine]
    m = int(cfg["micro_batches"])
    inflight = m if cfg.get("schedule", "1f1b") == "afab" else min(m, layout.pp - stage)
    return estimate_rank(
        model, layout, int(cfg["seq_len"]), int(cfg["micro_batch_size"]), stage=stage, contents=contents,
        state=trainer_state(cfg["compute_dtype"], cfg["grad_accum_dtype"], after_first_step),
        microbatches_in_flight=inflight, activation_bytes=DTYPE_BYTES[cfg["compute_dtype"]],
        attention_matrix_bytes=4 + DTYPE_BYTES[cfg["compute_dtype"]],
    )
