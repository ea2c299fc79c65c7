"""Precision flags: which gradient buffers need FP32 accumulation?

Model of one gradient buffer fed by k = micro_batches x dp terms (ALGORITHMS.md, Numerics):

- each term is a gradient as backward produces it: its exact value rounded once to ``grad_dtype``
  (bf16);
- on each DP rank the micro-batch terms are accumulated into the buffer in micro-batch order by
  chained adds in the buffer dtype (``buf = g0; buf += g1; ...``);
- the DP ranks' buffers are summed (SUM) by a reduction-order model (default ``gloo_ring``) in the
  buffer dtype. A ZeRO reduce-scatter gives the same bits per element on gloo; averaging or loss
  scaling by a power of two changes no relative error.

Errors are normwise against the exact sum S of the unrounded terms, computed in fp64:
``E(dtype) = ||buffer_dtype - S||_2 / ||S||_2``. The bf16 storage floor is ``F = ||bf16(S) - S||_2 / ||S||_2``:
the error of rounding the exact sum once, which no accumulation scheme that stores the result in
bf16 can beat.

Rule (exact): a buffer needs FP32 accumulation iff ``E(bf16) > threshold * F``, threshold = 2 by default
(ALGORITHMS.md: "exceeds about 2x the bf16 storage floor"). With S = 0 the floor is 0 and any
nonzero bf16 accumulation error flags the buffer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

import polars as pl
import torch

from numerics.reduction_order import chained_sum, get_order

DEFAULT_THRESHOLD = 2.0


def accumulate(terms: torch.Tensor, buffer_dtype: torch.dtype, grad_dtype: torch.dtype = torch.bfloat16, order: str = "gloo_ring") -> torch.Tensor:
    """The buffer after accumulating ``terms`` of shape (micro_batches, dp, *shape) as modelled above."""
    grads = terms.to(grad_dtype)
    per_rank = [chained_sum([g.to(buffer_dtype) for g in grads[:, r]]) for r in range(grads.shape[1])]
    return get_order(order).all_reduce(per_rank, "sum")


def absorbed_fraction(terms: torch.Tensor, grad_dtype: torch.dtype = torch.bfloat16) -> float:
    """Fraction of nonzero micro-batch additions that leave a bf16 buffer unchanged (the term is
    swallowed by rounding), over all DP ranks; 0 when there is only one micro-batch."""
    grads = terms.to(grad_dtype)
    absorbed = total = 0
    for r in range(grads.shape[1]):
        acc = grads[0, r].to(torch.bfloat16)
        for g in grads[1:, r]:
            new = acc + g.to(torch.bfloat16)
            nonzero = g != 0
            absorbed += int(((new == acc) & nonzero).sum())
            total += int(nonzero.sum())
            acc = new
    return absorbed / total if total else 0.0


def _normwise(x: torch.Tensor, exact: torch.Tensor, exact_norm: float) -> float:
    err = float(torch.linalg.vector_norm(x.double() - exact))
    if exact_norm > 0:
        return err / exact_norm
    return 0.0 if err == 0 else float("inf")


@dataclass(frozen=True)
class BufferPrecision:
    """Accumulation errors of one gradient buffer and the FP32 verdict."""

    buffer: str
    numel: int
    micro_batches: int
    dp: int
    terms: int
    order: str
    err_bf16: float  # bf16 buffer vs exact fp64 sum, normwise
    err_fp32: float  # fp32 buffer (fed the same bf16 gradients) vs exact
    storage_floor: float  # bf16(exact) vs exact
    ratio: float  # err_bf16 / storage_floor
    absorbed: float  # fraction of bf16 additions swallowed entirely
    needs_fp32: bool
    reason: str


def buffer_precision(
    name: str,
    terms: torch.Tensor,
    order: str = "gloo_ring",
    threshold: float = DEFAULT_THRESHOLD,
    grad_dtype: torch.dtype = torch.bfloat16,
) -> BufferPrecision:
    """Judge one buffer from its exact terms, shape (micro_batches, dp, *shape), fp32 or fp64."""
    if terms.dim() < 3 or terms.shape[0] < 1 or terms.shape[1] < 1:
        raise ValueError(f"buffer {name!r}: terms must have shape (micro_batches, dp, *buffer_shape), got {tuple(terms.shape)}")
    if terms.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"buffer {name!r}: terms must be the exact (fp32/fp64) gradients, got {terms.dtype}")
    if threshold <= 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    micro_batches, dp = terms.shape[0], terms.shape[1]
    exact = terms.double().sum(dim=(0, 1))
    exact_norm = float(torch.linalg.vector_norm(exact))
    err_bf16 = _normwise(accumulate(terms, torch.bfloat16, grad_dtype, order), exact, exact_norm)
    err_fp32 = _normwise(accumulate(terms, torch.float32, grad_dtype, order), exact, exact_norm)
    floor = _normwise(exact.to(torch.bfloat16), exact, exact_norm)
    ratio = err_bf16 / floor if floor > 0 else (0.0 if err_bf16 == 0 else float("inf"))
    needs = err_bf16 > threshold * floor
    k = micro_batches * dp
    verdict = "needs FP32: accumulate this buffer in FP32" if needs else "BF16 accumulation is fine"
    reason = (
        f"bf16 accumulation error {err_bf16:.2e} over {k} terms is {ratio:.2f}x the bf16 storage floor "
        f"{floor:.2e} ({'>' if needs else '<='} {threshold:g}x); {verdict}"
    )
    return BufferPrecision(
        name, int(exact.numel()), micro_batches, dp, k, order, err_bf16, err_fp32, floor, ratio,
        absorbed_fraction(terms, grad_dtype), needs, reason,
    )


def precision_table(
    buffers: Mapping[str, torch.Tensor], order: str = "gloo_ring", threshold: float = DEFAULT_THRESHOLD
) -> pl.DataFrame:
    """One row per buffer (see BufferPrecision), in the mapping's order."""
    rows = [asdict(buffer_precision(name, terms, order, threshold)) for name, terms in buffers.items()]
    return pl.DataFrame(rows)


def synthetic_terms(micro_batches: int, dp: int, numel: int, signal: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Noisy gradient stream, shape (micro_batches, dp, numel), fp32: i.i.d. N(0, 1) noise per term plus
    ``signal`` times one N(0, 1) direction shared by every term (0 = pure noise, the hard case)."""
    if micro_batches < 1 or dp < 1 or numel < 1:
        raise ValueError(f"need micro_batches, dp, numel >= 1 (got {micro_batches}, {dp}, {numel})")
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(micro_batches, dp, numel, generator=gen)
    return noise + signal * torch.randn(numel, generator=gen) if signal else noise
