"""Sequential reference of one micro-batch of a parallel training step: a plain Llama forward/backward in torch that
follows an ``AccumulationPlan`` bit for bit, in one process, without torch.distributed.

It is an independent implementation: data sharding, masks, parameter slicing, the gradient buckets and
AdamW are derived here from the plan, and every sum over ranks is computed by a reduction-order model
(``numerics.reduction_order``), so a bug in the trainer's parallel code is not reproduced here.

What it must copy from a parallel run is the shape of every rank's work: GEMMs are not
batch-invariant, so each rank's GEMM runs with that rank's shapes (its TP weight slice, its CP
tokens) and memory layout; the ranks of one micro-batch are kept as lists and advanced op by op in
lock step, so autograd meets each rank's nodes in the same relative order as on that rank.
Collectives are autograd functions over those lists (gather <-> reduce-scatter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from numerics.plan import AccumulationPlan
from numerics.reduction_order import ReductionOrder

Members = list[torch.Tensor]


# -- collectives over lists of per-rank tensors ---------------------------------------------------
def _gathered(parts: Members, dim: int) -> torch.Tensor:
    # same memory layout as a real gather along ``dim``: concatenate along dim 0, move back
    return torch.cat([p.movedim(dim, 0).contiguous() for p in parts], 0).movedim(0, dim)


def _reduce_scattered(order: ReductionOrder, parts: Members, dim: int) -> Members:
    chunks = order.reduce_scatter([p.movedim(dim, 0).contiguous() for p in parts])
    return [c.movedim(0, dim) for c in chunks]


class _AllGather(torch.autograd.Function):
    """Forward: every member gets the concatenation along ``dim``. Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, order: ReductionOrder, dim: int, *parts: torch.Tensor):
        ctx.order, ctx.dim = order, dim
        return tuple(_gathered(list(parts), dim) for _ in parts)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *_reduce_scattered(ctx.order, list(grads), ctx.dim))


class _ReduceScatter(torch.autograd.Function):
    """Forward: sum over members (reduction model), member i keeps slice i along ``dim``.
    Backward: every member's gradient is the gather of all members' gradients."""

    @staticmethod
    def forward(ctx, order: ReductionOrder, dim: int, *parts: torch.Tensor):
        ctx.dim = dim
        return tuple(_reduce_scattered(order, list(parts), dim))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *(_gathered(list(grads), ctx.dim) for _ in grads))


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of fp32 logits split along the vocabulary over the members."""

    @staticmethod
    def forward(ctx, order: ReductionOrder, targets: torch.Tensor, *logits: torch.Tensor):
        n_local = logits[0].shape[-1]
        row_max = logits[0].max(dim=-1).values
        for lg in logits[1:]:
            row_max = torch.maximum(row_max, lg.max(dim=-1).values)  # max is exact in any order
        shifted = [lg - row_max.unsqueeze(-1) for lg in logits]
        exp = [s.exp() for s in shifted]
        sum_exp = order.all_reduce([e.sum(dim=-1) for e in exp])
        picked_parts, locals_ = [], []
        for r, s in enumerate(shifted):
            local = targets - r * n_local
            inside = (local >= 0) & (local < n_local)
            local = local.masked_fill(~inside, 0)
            picked_parts.append(torch.gather(s, -1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0))
            locals_.append((local, inside))
        picked = order.all_reduce(picked_parts)
        ctx.saved = [(e / sum_exp.unsqueeze(-1), lt, ins) for e, (lt, ins) in zip(exp, locals_)]
        return tuple(sum_exp.log() - picked for _ in logits)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        out = []
        for (softmax, local, inside), g in zip(ctx.saved, grads):
            d = softmax.clone()
            d.scatter_add_(-1, local.unsqueeze(-1), -inside.to(d.dtype).unsqueeze(-1))
            out.append(d * g.unsqueeze(-1))
        return (None, None, *out)


# -- plain model pieces -------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [b, s, heads, d] at global positions pos [b, s] (pairs 2j, 2j+1)."""
    d = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * freqs
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x32 = x.float()
    a, b = x32[..., 0::2], x32[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax(q k^T / sqrt(d)) v over allowed pairs [b, q, k], fp32 softmax, GQA by repetition."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1).to(v.dtype), v)


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Document index of each position; an eos token belongs to the document it ends."""
    ends = (tokens == eos).long()
    return torch.cumsum(ends, dim=-1) - ends


@dataclass
class MicroBatchView:
    """One micro-batch as each CP rank sees it."""

    tokens: list[torch.Tensor]  # per CP rank [b, S/cp]
    targets: list[torch.Tensor]
    positions: list[torch.Tensor]
    allowed: list[torch.Tensor]  # [b, S/cp, S]: same document and key position <= query position


def micro_batch_view(plan: AccumulationPlan, tokens: torch.Tensor) -> MicroBatchView:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    doc = document_ids(inputs, plan.cfg.eos_id)
    pos = plan.cp_positions(doc)  # [b, cp, S/cp]
    keys = pos.reshape(pos.shape[0], -1)  # K/V arrive in CP rank order
    k_doc = torch.gather(doc, 1, keys)
    view = MicroBatchView([], [], [], [])
    for c in range(plan.cfg.cp):
        q = pos[:, c]
        q_doc = torch.gather(doc, 1, q)
        view.tokens.append(torch.gather(inputs, 1, q))
        view.targets.append(torch.gather(targets, 1, q))
        view.positions.append(q)
        view.allowed.append((q_doc[:, :, None] == k_doc[:, None, :]) & (keys[:, None, :] <= q[:, :, None]))
    return view


# -- the ranks of one DP replica, one micro-batch -------------------------------------------------
class ReplicaStep:
    """The TP x CP members of every virtual stage of one DP replica. ``weights[vs][m][name]`` is member
    m's (= cp * tp + tp_rank) leaf tensor of its shard of ``name``."""

    def __init__(self, plan: AccumulationPlan, weights: list[list[dict[str, torch.Tensor]]],
                 record: Callable[[str, Members], None] | None = None):
        self.plan, self.c, self.w = plan, plan.cfg, weights
        self.tp_order, self.cp_order = plan.order_of("tp"), plan.order_of("cp")
        self.n = self.c.tp * self.c.cp
        self.record = record  # (point, members' tensors) at the trainer's recording points

    def _rec(self, point: str, xs: Members) -> Members:
        if self.record is not None:
            self.record(point, [x.detach().clone() for x in xs])
        return xs

    # member m = cp_rank * tp + tp_rank
    def _tp_groups(self) -> list[list[int]]:
        return [[c * self.c.tp + t for t in range(self.c.tp)] for c in range(self.c.cp)]

    def _cp_groups(self) -> list[list[int]]:
        return [[c * self.c.tp + t for c in range(self.c.cp)] for t in range(self.c.tp)]

    def _collective(self, fn: type[torch.autograd.Function], xs: Members, groups: list[list[int]],
                    order: ReductionOrder) -> Members:
        if len(groups[0]) == 1:
            return xs
        out: list[torch.Tensor | None] = [None] * len(xs)
        for g in groups:
            for m, y in zip(g, fn.apply(order, 1, *(xs[m] for m in g))):
                out[m] = y
        return out  # type: ignore[return-value]

    def tp_gather(self, xs: Members) -> Members:
        return self._collective(_AllGather, xs, self._tp_groups(), self.tp_order)

    def tp_reduce_scatter(self, xs: Members) -> Members:
        return self._collective(_ReduceScatter, xs, self._tp_groups(), self.tp_order)

    def cp_gather(self, xs: Members) -> Members:
        return self._collective(_AllGather, xs, self._cp_groups(), self.cp_order)

    def _cp_of(self, m: int) -> int:
        return m // self.c.tp

    def embed(self, vs: int, mb: MicroBatchView) -> Members:
        c, w = self.c, self.w[vs]
        if c.tp == 1:
            return self._rec("embed", [F.embedding(mb.tokens[self._cp_of(m)], w[m]["embed.weight"]) for m in range(self.n)])
        rows = c.vocab_size // c.tp
        out = []
        for m in range(self.n):
            local = mb.tokens[self._cp_of(m)] - (m % c.tp) * rows
            outside = (local < 0) | (local >= rows)
            e = F.embedding(local.masked_fill(outside, 0), w[m]["embed.weight"])
            out.append(e.masked_fill(outside[..., None], 0.0))
        return self._rec("embed", self.tp_reduce_scatter(out))

    def layer(self, vs: int, i: int, xs: Members, mb: MicroBatchView) -> Members:
        c, n = self.c, range(self.n)
        w = [{k.split(".")[2]: v for k, v in self.w[vs][m].items() if k.startswith(f"layers.{i}.")} for m in n]
        b, hd = xs[0].shape[0], c.head_dim
        hf = self.tp_gather([rms_norm(xs[m], w[m]["attn_norm"], c.norm_eps) for m in n])
        s = hf[0].shape[1]
        q = [F.linear(hf[m], w[m]["wq"]).view(b, s, -1, hd) for m in n]
        k = [F.linear(hf[m], w[m]["wk"]).view(b, s, -1, hd) for m in n]
        v = [F.linear(hf[m], w[m]["wv"]).view(b, s, -1, hd) for m in n]
        pos = [mb.positions[self._cp_of(m)] for m in n]
        q = [rope(q[m], pos[m], c.rope_theta) for m in n]
        k = [rope(k[m], pos[m], c.rope_theta) for m in n]
        k, v = self.cp_gather(k), self.cp_gather(v)
        o = [attention(q[m], k[m], v[m], mb.allowed[self._cp_of(m)]).reshape(b, s, -1) for m in n]
        self._rec(f"layers.{i}.attention.heads", o)
        r = self._rec(f"layers.{i}.attention", self.tp_reduce_scatter([F.linear(o[m], w[m]["wo"]) for m in n]))
        xs = [xs[m] + r[m] for m in n]
        hf = self.tp_gather([rms_norm(xs[m], w[m]["mlp_norm"], c.norm_eps) for m in n])
        act = [F.silu(F.linear(hf[m], w[m]["w1"])) * F.linear(hf[m], w[m]["w3"]) for m in n]
        r = self._rec(f"layers.{i}.mlp", self.tp_reduce_scatter([F.linear(act[m], w[m]["w2"]) for m in n]))
        return self._rec(f"layers.{i}", [xs[m] + r[m] for m in n])

    def head_loss(self, vs: int, xs: Members, mb: MicroBatchView) -> Members:
        """Each member's share of the step loss: its token losses summed / tokens of the step."""
        c, w, n = self.c, self.w[vs], range(self.n)
        hf = self.tp_gather(self._rec("norm", [rms_norm(xs[m], w[m]["norm.weight"], c.norm_eps) for m in n]))
        logits = [lg.float() for lg in self._rec("logits", [F.linear(hf[m], w[m]["head.weight"]) for m in n])]
        losses: list[torch.Tensor | None] = [None] * self.n
        for g in self._tp_groups():
            for m, loss in zip(g, _CrossEntropy.apply(self.tp_order, mb.targets[self._cp_of(g[0])], *(logits[m] for m in g))):
                losses[m] = loss
        self._rec("token_loss", losses)  # type: ignore[arg-type]
        return [losses[m].sum() / c.tokens_per_step for m in n]

    def stage_forward(self, vs: int, xs: Members | None, mb: MicroBatchView) -> Members:
        if vs == 0:
            xs = self.embed(vs, mb)
        assert xs is not None
        for i in self.plan.stage_layers[vs]:
            xs = self.layer(vs, i, xs, mb)
        return self.head_loss(vs, xs, mb) if vs == self.c.n_vstages_total - 1 else xs

    def run(self, mb: MicroBatchView) -> list[torch.Tensor]:
        """Forward and backward of one micro-batch stage by stage (each stage boundary is a fresh leaf,
        as after a pipeline send); returns each member's loss share. Gradients land in the leaves."""
        n_vs, cross_rank = self.c.n_vstages_total, self.c.pp > 1
        inputs: list[Members | None] = []
        outputs: list[Members] = []
        xs: Members | None = None
        for vs in range(n_vs):
            if xs is not None:
                xs = [(x.detach().contiguous() if cross_rank else x.detach()).requires_grad_(True) for x in xs]
            inputs.append(xs)
            ys = self.stage_forward(vs, xs, mb)
            outputs.append(ys)
            xs = ys
        grads: Members | None = None
        for vs in reversed(range(n_vs)):
            torch.autograd.backward(outputs[vs], grads)
            if inputs[vs] is not None:
                grads = [x.grad.contiguous() if cross_rank else x.grad for x in inputs[vs]]  # type: ignore[union-attr]
        return [y.detach() for y in outputs[-1]]
