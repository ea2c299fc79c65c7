"""Tensor parallelism with sequence parallelism, Megatron style.

Between blocks, activations are sharded along the sequence over TP ([b, s/tp, h]). Before a
column-parallel linear the sequence is all-gathered (backward: reduce-scatter); after a row-parallel
linear the partial sums are reduce-scattered along the sequence (backward: all-gather). The token
embedding and the output head are vocab-parallel; the loss is a vocab-parallel cross-entropy.
Weights follow torch.nn.Linear's [out, in]: column-parallel splits dim 0, row-parallel dim 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .comm import Comm, Group


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, group: Group, bwd_reduce: bool = True) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.bwd_reduce = comm, group, bwd_reduce
        return comm.all_gather(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.bwd_reduce:  # planted bug tp-bwd-reduce: own partial gradient only
            return grad.chunk(ctx.group.size, dim=1)[ctx.group.local_rank].contiguous(), None, None, None
        return ctx.comm.reduce_scatter(grad, ctx.group, dim=1), None, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return comm.reduce_scatter(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_gather(grad, ctx.group, dim=1), None, None


def gather_sequence(x: torch.Tensor, comm: Comm, group: Group, bwd_reduce: bool = True) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h] (sequence-parallel region -> tensor-parallel region).
    ``bwd_reduce=False`` only for the planted bug tp-bwd-reduce."""
    return x if group.size == 1 else _GatherSequence.apply(x, comm, group, bwd_reduce)


def reduce_scatter_sequence(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """Partial [b, s, h] -> summed [b, s/tp, h] (tensor-parallel region -> sequence-parallel)."""
    return x if group.size == 1 else _ReduceScatterSequence.apply(x, comm, group)


def vocab_parallel_embedding(tokens: torch.Tensor, weight_shard: torch.Tensor, vocab_start: int,
                             comm: Comm, group: Group) -> torch.Tensor:
    """tokens [b, s] (full local sequence on every TP rank) -> [b, s/tp, h] sequence-parallel."""
    if group.size == 1:
        return F.embedding(tokens, weight_shard)
    local = tokens - vocab_start
    outside = (local < 0) | (local >= weight_shard.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight_shard)
    out = out.masked_fill(outside[..., None], 0.0)
    return reduce_scatter_sequence(out, comm, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits sharded along the vocabulary (fp32)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, comm: Comm,
                group: Group) -> torch.Tensor:
        n_local = logits.shape[-1]
        row_max = comm.all_reduce(logits.max(dim=-1).values, group, op="max")
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group)
        local_t = targets - vocab_start
        inside = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~inside, 0)
        picked = torch.gather(shifted, -1, local_t.unsqueeze(-1)).squeeze(-1)
        picked = comm.all_reduce(picked.masked_fill(~inside, 0.0), group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, inside)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 comm: Comm, group: Group) -> torch.Tensor:
    """logits [..., V/tp] (any dtype, computed in fp32), targets [...] -> per-token loss [...] fp32."""
    return _VocabParallelCrossEntropy.apply(logits_shard.float(), targets, vocab_start, comm, group)
