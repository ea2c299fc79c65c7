"""Context parallelism, all-gather based (Llama 3): shard the sequence, gather K/V, mask by document.

Two shardings of a length-S sequence over ``cp`` ranks, both giving every rank S/cp positions:
- ``sequence``: 2*cp equal chunks; rank i holds chunks i and 2*cp-1-i (balances a causal mask).
- ``document`` (WLB-LLM): every document is split into 2*cp equal pieces assigned the same way;
  a document's remainder tokens are dealt round-robin over ranks, continuing across documents.
Positions stay global: RoPE and the document-causal mask use them, so attention over the gathered
K/V equals full attention with the same mask. K/V are all-gathered in forward and their gradients
reduce-scattered in backward.
"""

from __future__ import annotations

import math

import torch

from . import bugs
from .comm import Comm, Group


def shard_positions(doc_ids: torch.Tensor, cp: int, mode: str) -> torch.Tensor:
    """Global positions held by each CP rank, [cp, S/cp] (ascending within a rank), for one sequence."""
    s = doc_ids.numel()
    if cp == 1:
        return torch.arange(s).unsqueeze(0)
    if mode == "sequence":
        chunks = torch.arange(s).view(2 * cp, s // (2 * cp))
        second = 2 * cp - 2 if bugs.active("cp-chunk") else 2 * cp - 1  # planted bug: off by one chunk
        return torch.stack([torch.cat([chunks[i], chunks[(second - i) % (2 * cp)]]) for i in range(cp)])
    if mode != "document":
        raise ValueError(f"unknown cp sharding {mode!r}")
    owner = torch.empty(s, dtype=torch.long)
    piece_owner = [min(p, 2 * cp - 1 - p) for p in range(2 * cp)]
    bounds = torch.nonzero(torch.diff(doc_ids, prepend=doc_ids[:1] - 1)).flatten().tolist() + [s]
    deal = 0  # round-robin counter for remainder tokens, continued across documents
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        piece = n // (2 * cp)
        for p in range(2 * cp):
            owner[start + p * piece:start + (p + 1) * piece] = piece_owner[p]
        for j in range(start + 2 * cp * piece, end):
            owner[j] = deal % cp
            deal += 1
    out = [torch.nonzero(owner == r).flatten() for r in range(cp)]
    if any(o.numel() != s // cp for o in out):  # impossible when s % (2*cp) == 0, kept as a guard
        raise AssertionError(f"unbalanced document sharding: {[o.numel() for o in out]}")
    return torch.stack(out)


def batch_shard_positions(doc_ids: torch.Tensor, cp: int, mode: str) -> torch.Tensor:
    """[b, S] document ids -> [b, cp, S/cp] global positions per CP rank."""
    return torch.stack([shard_positions(d, cp, mode) for d in doc_ids])


class _GatherKV(torch.autograd.Function):
    """Forward: all-gather along the sequence (dim 1) over CP. Backward: reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return comm.all_gather(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.reduce_scatter(grad, ctx.group, dim=1), None, None


def gather_kv(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    return _GatherKV.apply(x, comm, group)


def document_causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """[b, q, k] True where query position q may attend key position k: same document, k <= q.
    ``doc`` is the [b, S] document id of every global position."""
    q_doc = torch.gather(doc, 1, q_pos)
    if bugs.active("doc-mask-off-by-one"):  # planted bug: the key's document read one position late
        k_pos_doc = (k_pos + 1).clamp(max=doc.shape[1] - 1)
        k_doc = torch.gather(doc, 1, k_pos_doc)
    else:
        k_doc = torch.gather(doc, 1, k_pos)
    return (q_doc[:, :, None] == k_doc[:, None, :]) & (k_pos[:, None, :] <= q_pos[:, :, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention with grouped-query heads.

    q [b, sq, hq, d], k/v [b, sk, hkv, d], mask [b, sq, sk] -> [b, sq, hq, d]. Softmax in fp32.
    """
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)
