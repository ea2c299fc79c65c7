"""A whole emulated training step: every DP replica's micro-batches through ``ReplicaStep``, the
flat gradient buckets in ``grad_accum_dtype``, the TP and DP x CP reductions by the reduction model
(ZeRO-1 once per step, ZeRO-2 after every micro-batch), and AdamW on every fp32 master shard, each
shard a separate tensor as on its rank (vectorized and scalar-tail code paths round alike only if the
shard boundaries are the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from numerics.plan import AccumulationPlan, BucketPlan
from numerics.reduction_order import get_order
from numerics.reference_model import ReplicaStep, micro_batch_view
from numerics.corpus import global_batch, positions_key, shard_key


def adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, c) -> None:
    """AdamW with decoupled weight decay, bias-corrected moments, eps outside the square root."""
    p.mul_(1 - c.lr * c.weight_decay)
    m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
    v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
    m_hat = m / (1 - c.beta1 ** step)
    v_hat = v / (1 - c.beta2 ** step)
    p.sub_(c.lr * m_hat / (v_hat.sqrt() + c.adam_eps))


@dataclass
class ShardState:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@dataclass
class ReferenceRun:
    """The emulated training run: state per (virtual stage, TP rank, DP x CP shard)."""

    plan: AccumulationPlan
    shards: dict[tuple[int, int, int], ShardState] = field(default_factory=dict)
    steps_taken: int = 0

    def __post_init__(self) -> None:
        c = self.plan.cfg
        for bp in self.plan.buckets:
            for t in range(c.tp):
                flat = torch.zeros(bp.padded)
                for p, off, numel in zip(bp.params, bp.offsets, bp.shard_numels):
                    flat[off:off + numel] = p.tp_slice(p.initial(c.seed), c.tp, t).reshape(-1)
                for k in range(c.dp * c.cp):
                    master = flat[k * bp.shard_len:(k + 1) * bp.shard_len].clone()
                    self.shards[(bp.vstage, t, k)] = ShardState(master, torch.zeros_like(master), torch.zeros_like(master))

    def _full(self, vs: int, t: int, which: str) -> torch.Tensor:
        n = self.plan.cfg.dp * self.plan.cfg.cp
        return torch.cat([getattr(self.shards[(vs, t, k)], which) for k in range(n)])

    def _weights(self) -> list[list[dict[str, torch.Tensor]]]:
        """Fresh compute-dtype leaves for every (vstage, member) from the gathered master shards."""
        c, out = self.plan.cfg, []
        for bp in self.plan.buckets:
            per_tp = []
            for t in range(c.tp):
                full = self._full(bp.vstage, t, "master").to(self.plan.compute_dtype)
                per_tp.append({p.name: full[o:o + n] for p, o, n in zip(bp.params, bp.offsets, bp.shard_numels)})
            members = []
            for m in range(c.cp * c.tp):
                tp_rank, shapes = m % c.tp, {}
                for p in bp.params:
                    shape = list(p.shape)
                    if p.tp_dim is not None:
                        shape[p.tp_dim] //= c.tp
                    shapes[p.name] = per_tp[tp_rank][p.name].view(shape).clone().requires_grad_(True)
                members.append(shapes)
            out.append(members)
        return out

    def step(self, term_hook: Callable[[int, int, list[list[dict[str, torch.Tensor]]]], None] | None = None) -> dict:
        """One training step of every DP replica; returns {"loss", "grads", "params"} like the trainer's
        ``--dump-state``. ``term_hook(dp, mb, weights)`` sees every micro-batch's leaf gradients.
        With ``record_activations`` also ``activations`` and ``positions``, keyed like the trainer's."""
        plan, c = self.plan, self.plan.cfg
        torch.set_num_threads(1)  # the ranks run single-threaded; thread count changes GEMM bits
        batches = global_batch(c, self.steps_taken)
        per_replica = c.micro_batches * c.micro_batch_size
        # bucket buffers per (vstage, dp, cp, tp) in grad_accum_dtype; ZeRO-2 shard sums per the same
        bufs = {(bp.vstage, d, cp, t): torch.zeros(bp.padded, dtype=plan.accum_dtype)
                for bp in plan.buckets for d in range(c.dp) for cp in range(c.cp) for t in range(c.tp)}
        zero2 = {key: torch.zeros(plan.buckets[key[0]].shard_len, dtype=plan.accum_dtype) for key in bufs}
        reduced: dict[tuple[int, int, int, int], torch.Tensor] = {}
        loss_parts = [torch.zeros((), dtype=torch.float32) for _ in range(c.dp * c.cp)]
        accum = dict(plan.overrides).get("accum")
        pending: dict[tuple[int, int, int, int], list[torch.Tensor]] = {}
        replicas = [batches[d * per_replica:(d + 1) * per_replica].split(c.micro_batch_size, 0) for d in range(c.dp)]
        acts: dict[str, torch.Tensor] = {}
        positions: dict[str, torch.Tensor] = {}
        for i in range(c.micro_batches):  # every replica runs micro-batch i before the ZeRO-2 reduction of i
            for d in range(c.dp):
                weights = self._weights()  # fresh leaves: their .grad is this micro-batch's gradient
                view = micro_batch_view(plan, replicas[d][i])
                record = None
                if c.record_activations:
                    positions.update({positions_key(d, cp, i): p for cp, p in enumerate(view.positions)})

                    def record(point: str, xs: list[torch.Tensor], d: int = d, i: int = i) -> None:
                        acts.update({shard_key(point, d, m // c.tp, m % c.tp, i): x for m, x in enumerate(xs)})
                losses = ReplicaStep(plan, weights, record).run(view)
                for cp in range(c.cp):
                    k = plan.dp_cp_index(d, cp)
                    loss_parts[k] = loss_parts[k] + losses[cp * c.tp]
                if term_hook is not None:
                    term_hook(d, i, weights)
                for bp in plan.buckets:
                    for m in range(c.cp * c.tp):
                        key = (bp.vstage, d, m // c.tp, m % c.tp)
                        # the run's order adds each micro-batch as it comes; another order collects them
                        buf = bufs[key]
                        if accum is not None:
                            buf = torch.zeros(bp.padded, dtype=plan.accum_dtype)
                            pending.setdefault(key, []).append(buf)
                        for p, off, numel in zip(bp.params, bp.offsets, bp.shard_numels):
                            buf[off:off + numel].add_(weights[bp.vstage][m][p.name].grad.reshape(-1))
            if c.zero_stage == 2:
                for bp in plan.buckets:
                    self._reduce(bp, self._accumulated(bufs, pending, accum), zero2, reduced)
        if c.zero_stage == 1:
            for bp in plan.buckets:
                self._reduce(bp, self._accumulated(bufs, pending, accum), zero2, reduced)
        loss = plan.order_of("loss").all_reduce(loss_parts)
        self.steps_taken += 1
        out = self._update(reduced, float(loss))
        if c.record_activations:
            out["activations"], out["positions"] = acts, positions
        return out

    def _accumulated(self, bufs: dict, pending: dict, accum: str | None) -> dict:
        """The bucket buffers; under another accumulation order, its sum of the collected terms."""
        if accum is not None:
            for key, terms in pending.items():
                bufs[key] = get_order(accum).all_reduce(terms) if len(terms) > 1 else terms[0]
            pending.clear()
        return bufs

    def _reduce(self, bp: BucketPlan, bufs: dict, zero2: dict, reduced: dict) -> None:
        """TP all-reduce of the norm-weight slice, then reduce-scatter over DP x CP in reduce_dtype.
        ZeRO-1 keeps the shard (fp32); ZeRO-2 adds it into a grad_accum_dtype shard sum."""
        plan, c = self.plan, self.plan.cfg
        rep = bp.replicated
        if c.tp > 1 and rep.stop > rep.start:
            for d in range(c.dp):
                for cp in range(c.cp):
                    total = plan.order_of("tp").all_reduce([bufs[(bp.vstage, d, cp, t)][rep].clone() for t in range(c.tp)])
                    for t in range(c.tp):
                        bufs[(bp.vstage, d, cp, t)][rep] = total
        for t in range(c.tp):
            keys = [(bp.vstage, d, cp, t) for d in range(c.dp) for cp in range(c.cp)]
            flats = [bufs[k].to(plan.reduce_dtype) for k in keys]
            shards = plan.order_of("dp").reduce_scatter(flats) if len(keys) > 1 else [flats[0].clone()]
            for k, sh in zip(keys, shards):
                if c.zero_stage == 1:
                    reduced[k] = sh.to(torch.float32, copy=True)
                else:
                    zero2[k].add_(sh)
                    reduced[k] = zero2[k].to(torch.float32, copy=True)
                bufs[k].zero_()

    def _update(self, reduced: dict, loss: float) -> dict:
        plan, c = self.plan, self.plan.cfg
        grads, params = {}, {}
        for bp in plan.buckets:
            for t in range(c.tp):
                g_full = torch.cat([reduced[(bp.vstage, d, cp, t)] for d in range(c.dp) for cp in range(c.cp)])
                for d in range(c.dp):
                    for cp in range(c.cp):
                        k = plan.dp_cp_index(d, cp)
                        st = self.shards[(bp.vstage, t, k)]
                        adamw(st.master, reduced[(bp.vstage, d, cp, t)], st.exp_avg, st.exp_avg_sq,
                              self.steps_taken, c)
                p_full = self._full(bp.vstage, t, "master")
                for p, o, n in zip(bp.params, bp.offsets, bp.shard_numels):
                    shape = list(p.shape)
                    if p.tp_dim is not None:
                        shape[p.tp_dim] //= c.tp
                    for store, flat in ((grads, g_full), (params, p_full)):
                        store.setdefault(p.name, []).append(flat[o:o + n].view(shape).clone())
        out: dict = {"loss": loss, "grads": {}, "params": {}}
        for p in plan.params:
            for key, store in (("grads", grads), ("params", params)):
                parts = store[p.name]
                out[key][p.name] = parts[0] if p.tp_dim is None else torch.cat(parts, p.tp_dim)
        return out
