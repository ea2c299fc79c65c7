"""Data parallelism, ZeRO style over the DP x CP group (CP ranks see different tokens, so their
gradients are summed like DP's).

Per virtual stage, one flat bucket of this rank's parameters (TP-sharded ones first, then the
TP-replicated norm weights). Gradients of every micro-batch are added into the bucket's buffer in
``grad_accum_dtype`` (in schedule order). Norm-weight gradients are partial per TP rank under
sequence parallelism and are all-reduced over TP first. The bucket is then reduce-scattered over
DP x CP in ``reduce_dtype``: once per step (ZeRO-1) or after every micro-batch's backward with the
shards accumulated in ``grad_accum_dtype`` (ZeRO-2). AdamW updates this rank's fp32 master shard;
the compute-dtype parameters are all-gathered back. The loss is already normalized by the tokens
of the whole step, so gradients are summed, never averaged.
"""

from __future__ import annotations

import torch

from . import bugs
from .config import TrainConfig
from .model import DTYPES, Stage
from .parallel_state import ParallelContext


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
           cfg: TrainConfig) -> None:
    """In-place AdamW (decoupled weight decay) on fp32 tensors; elementwise, so sharding-invariant."""
    p.mul_(1 - cfg.lr * cfg.weight_decay)
    m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
    m_hat = m / (1 - cfg.beta1 ** step)
    v_hat = v / (1 - cfg.beta2 ** step)
    p.sub_(cfg.lr * m_hat / (v_hat.sqrt() + cfg.adam_eps))


class Bucket:
    """One virtual stage's parameters as a flat, padded buffer sharded over DP x CP."""

    def __init__(self, stage: Stage, cfg: TrainConfig, ctx: ParallelContext):
        self.stage, self.cfg, self.ctx = stage, cfg, ctx
        order = sorted(range(len(stage.specs)), key=lambda i: stage.specs[i].tp_dim is None)
        self.names = [stage.specs[i].name for i in order]
        init = stage.full_init_fp32()
        self.params = [stage.params[n] for n in self.names]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        n_rep = sum(p.numel() for p, i in zip(self.params, order) if stage.specs[i].tp_dim is None)
        self.replicated = slice(off - n_rep, off)
        shards = ctx.dp_cp.size
        self.padded = -(-off // shards) * shards
        self.shard_len = self.padded // shards
        me = ctx.dp_cp.local_rank
        self.shard = slice(me * self.shard_len, (me + 1) * self.shard_len)
        flat = torch.zeros(self.padded)
        for i, o in zip(order, self.offsets):
            flat[o:o + init[i].numel()] = init[i].reshape(-1)
        dev = ctx.comm.device
        self.master = flat[self.shard].clone().to(dev)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.accum_dtype = DTYPES[cfg.grad_accum_dtype]
        self.grad = torch.zeros(self.padded, dtype=self.accum_dtype, device=dev)
        self.grad_shard = torch.zeros(self.shard_len, dtype=self.accum_dtype, device=dev)  # ZeRO-2
        self.reduced: torch.Tensor | None = None  # this step's reduced gradient shard, as fp32
        for p, o in zip(self.params, self.offsets):
            p.register_post_accumulate_grad_hook(self._hook(o))

    def _hook(self, offset: int):
        def accumulate(p: torch.Tensor) -> None:
            # the add rounds to the buffer dtype: fp32 buffer += bf16 grad, or bf16 += bf16
            self.grad[offset:offset + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        return accumulate

    def reduce(self) -> None:
        """TP all-reduce of norm gradients, then reduce-scatter over DP x CP. ZeRO-1 keeps the
        reduced shard as is; ZeRO-2 adds it into ``grad_shard`` (``grad_accum_dtype``)."""
        comm, ctx = self.ctx.comm, self.ctx
        if ctx.tp.size > 1 and self.replicated.stop > self.replicated.start:
            self.grad[self.replicated] = comm.all_reduce(self.grad[self.replicated], ctx.tp)
        shard = comm.reduce_scatter(self.grad.to(DTYPES[self.cfg.reduce_dtype]), ctx.dp_cp)
        if bugs.active("dp-double-scale"):  # planted bug: averaging a gradient that is already a mean
            shard = shard / ctx.dp_cp.size
        if self.cfg.zero_stage == 1:
            self.reduced = shard.to(torch.float32, copy=True)
        else:
            self.grad_shard.add_(shard)
            self.reduced = self.grad_shard.to(torch.float32, copy=True)
        self.grad.zero_()

    def step(self, step: int) -> None:
        assert self.reduced is not None, "step() before reduce()"
        self.grad_shard.zero_()
        adamw_(self.master, self.reduced, self.exp_avg, self.exp_avg_sq, step, self.cfg)
        dtype = self.params[0].dtype
        full = self.ctx.comm.all_gather(self.master.to(dtype), self.ctx.dp_cp)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                p.copy_(full[o:o + p.numel()].view_as(p))

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: flat[o:o + p.numel()].view(p.shape).clone()
                for n, p, o in zip(self.names, self.params, self.offsets)}


class ShardedOptimizer:
    def __init__(self, stages: dict[int, Stage], cfg: TrainConfig, ctx: ParallelContext):
        self.cfg, self.ctx = cfg, ctx
        self.buckets = {vs: Bucket(st, cfg, ctx) for vs, st in sorted(stages.items())}
        self.steps_taken = 0

    def after_backward(self, vstage: int, mb: int) -> None:
        """Called after each backward action; ZeRO-2 reduces right away."""
        if self.cfg.zero_stage == 2:
            self.buckets[vstage].reduce()

    def step(self) -> None:
        if self.cfg.zero_stage == 1:
            for b in self.buckets.values():
                b.reduce()
        self.steps_taken += 1
        for b in self.buckets.values():
            b.step(self.steps_taken)

    def local_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(reduced gradients, fp32 master parameters) of this rank's TP shards, gathered over
        DP x CP; every member of the DP x CP group must call it."""
        grads, params = {}, {}
        for b in self.buckets.values():
            assert b.reduced is not None, "local_state() before the first step"
            grads.update(b.unflatten(self.ctx.comm.all_gather(b.reduced, self.ctx.dp_cp).cpu()))
            params.update(b.unflatten(self.ctx.comm.all_gather(b.master, self.ctx.dp_cp).cpu()))
        return grads, params
