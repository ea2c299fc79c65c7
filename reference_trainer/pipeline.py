"""Pipeline parallelism: interleaved 1F1B with v virtual stages and tunable N, or all-forward-all-backward.

Virtual stage ``vs`` lives on PP rank ``vs % pp`` as its chunk ``vs // pp`` (Megatron interleaving).
Micro-batches are taken in groups of N (Llama 3's tunable N); within a group a rank runs chunk 0
for the N micro-batches, then chunk 1, ... (forward) and the chunks in reverse for backward. Any
micro-batch count works, including fewer than pp and counts that are not a multiple of N.

Each rank's action order comes from a tick simulation of the whole pipeline: a rank runs its next
backward when ready and its forwards in flight reached the warm-up budget (Megatron's interleaved
warm-up, generalized to N), else its next forward within that budget; only if the whole pipeline
would otherwise stall may a rank exceed its budget.
Because every action is placed after the actions it depends on, the real run with blocking
receives and asynchronous sends cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from .compute import ComputeSpans
from .model import MicroBatch, Stage
from .parallel_state import ParallelContext


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    vstage: int
    mb: int


class ScheduleError(RuntimeError):
    pass


def _orders(pp_rank: int, pp: int, v: int, m: int, n: int) -> tuple[list[Action], list[Action]]:
    fwd, bwd = [], []
    for g0 in range(0, m, n):
        group = range(g0, min(g0 + n, m))
        for c in range(v):
            fwd += [Action("F", c * pp + pp_rank, mb) for mb in group]
        for c in reversed(range(v)):
            bwd += [Action("B", c * pp + pp_rank, mb) for mb in group]
    return fwd, bwd


def build_schedule(pp: int, v: int, m: int, n: int, kind: str) -> list[list[Action]]:
    """Per PP rank, the ordered forward/backward actions of one step."""
    if kind not in ("1f1b", "afab"):
        raise ScheduleError(f"unknown schedule {kind!r}")
    n = max(1, min(n, m))
    last = pp * v - 1
    orders = [_orders(r, pp, v, m, n) for r in range(pp)]
    ptr = [[0, 0] for _ in range(pp)]
    done: set[Action] = set()
    out: list[list[Action]] = [[] for _ in range(pp)]
    # warm-up budget of forwards in flight (Megatron's interleaved warm-up, generalized to N)
    limit = [(pp - r - 1) * 2 + (v - 1) * n + 1 if v > 1 else pp - r for r in range(pp)]
    total = 2 * v * m
    relax = False  # set for one tick when the warm-up budget alone would stall the pipeline
    while any(len(o) < total for o in out):
        tick: list[tuple[int, Action, int]] = []
        for r in range(pp):
            fwd, bwd = orders[r]
            nf = fwd[ptr[r][0]] if ptr[r][0] < len(fwd) else None
            nb = bwd[ptr[r][1]] if ptr[r][1] < len(bwd) else None
            f_ok = nf is not None and (nf.vstage == 0 or Action("F", nf.vstage - 1, nf.mb) in done)
            b_ok = nb is not None and Action("F", nb.vstage, nb.mb) in done and (
                nb.vstage == last or Action("B", nb.vstage + 1, nb.mb) in done)
            if kind == "afab":
                b_ok = b_ok and nf is None
            in_flight = ptr[r][0] - ptr[r][1]
            if b_ok and (in_flight >= limit[r] or not f_ok or kind == "afab"):
                tick.append((r, nb, 1))
            elif f_ok and (in_flight < limit[r] or kind == "afab" or relax):
                tick.append((r, nf, 0))
        if not tick:
            if relax:
                raise ScheduleError(f"pipeline schedule stalled (pp={pp} v={v} m={m} n={n} {kind})")
            relax = True
            continue
        relax = False
        for r, a, which in tick:
            ptr[r][which] += 1
            out[r].append(a)
            done.add(a)
    return out


def bubble_fraction(pp: int, v: int, m: int, n: int, kind: str) -> float:
    """Idle time / busy time of the schedule when every forward and backward of a virtual stage
    costs 1/v and p2p is free (theory for interleaved 1F1B with N >= pp: (pp - 1) / (v * m))."""
    sched, last = build_schedule(pp, v, m, n, kind), pp * v - 1
    finish: dict[Action, float] = {}
    clock, ptr = [0.0] * pp, [0] * pp
    while any(p < len(s) for p, s in zip(ptr, sched)):
        before = sum(ptr)
        for r in range(pp):
            if ptr[r] == len(sched[r]):
                continue
            a = sched[r][ptr[r]]
            if a.kind == "F":
                deps = [Action("F", a.vstage - 1, a.mb)] if a.vstage else []
            else:
                deps = [Action("F", a.vstage, a.mb)] + ([Action("B", a.vstage + 1, a.mb)] if a.vstage < last else [])
            if all(d in finish for d in deps):
                clock[r] = max([clock[r]] + [finish[d] for d in deps]) + 1.0 / v
                finish[a] = clock[r]
                ptr[r] += 1
        if sum(ptr) == before:
            raise ScheduleError(f"schedule deadlocks (pp={pp} v={v} m={m} n={n} {kind})")
    return (max(clock) - 2 * m) / (2 * m)


class PipelineRunner:
    """Runs one rank's schedule over its virtual stages; p2p goes through the comm layer."""

    def __init__(self, ctx: ParallelContext, stages: dict[int, Stage], schedule: list[Action],
                 act_shape: tuple[int, ...], dtype: torch.dtype, n_micro: int,
                 spans: ComputeSpans, on_backward: Callable[[int, int], None] | None = None):
        self.ctx, self.stages, self.schedule = ctx, stages, schedule
        self.act_shape, self.dtype, self.n_micro = act_shape, dtype, n_micro
        self.n_vstages = ctx.layout.pp * len(stages)
        self.spans = spans
        self.on_backward = on_backward  # (vstage, mb) after each backward, e.g. ZeRO-2 reduction

    def _tag(self, direction: int, vstage: int, mb: int) -> int:
        # unique per message, so gloo matches sends and receives regardless of interleaving
        return (direction * self.n_vstages + vstage) * self.n_micro + mb

    def _peer(self, vstage: int) -> int:
        return self.ctx.pp_rank_global(vstage % self.ctx.layout.pp)

    def run(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Run the step's forwards and backwards; returns this rank's summed loss (0 off the last stage)."""
        comm, pp, pp_bwd = self.ctx.comm, self.ctx.pp, self.ctx.pp_bwd
        inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        local_fwd: dict[tuple[int, int], torch.Tensor] = {}  # handoffs between stages on this rank
        local_bwd: dict[tuple[int, int], torch.Tensor] = {}
        loss = torch.zeros((), dtype=torch.float32, device=comm.device)
        for a in self.schedule:
            key, stage = (a.vstage, a.mb), self.stages[a.vstage]
            if a.kind == "F":
                x = None
                if a.vstage > 0:
                    if self._peer(a.vstage - 1) == self.ctx.rank:
                        x = local_fwd.pop(key)
                    else:
                        x = comm.recv(self.act_shape, self.dtype, self._peer(a.vstage - 1), pp,
                                      tag=self._tag(0, a.vstage, a.mb))
                    x.requires_grad_(True)
                with self.spans.span("fwd", a.vstage, a.mb):
                    y = stage(x, micro_batches[a.mb])
                inputs[key], outputs[key] = x, y
                if stage.is_last:
                    loss = loss + y.detach()
                elif self._peer(a.vstage + 1) == self.ctx.rank:
                    local_fwd[(a.vstage + 1, a.mb)] = y.detach()
                else:
                    comm.send(y, self._peer(a.vstage + 1), pp, tag=self._tag(0, a.vstage + 1, a.mb))
            else:
                y, x = outputs.pop(key), inputs.pop(key)
                if stage.is_last:
                    grad = None
                elif self._peer(a.vstage + 1) == self.ctx.rank:
                    grad = local_bwd.pop(key)
                else:
                    grad = comm.recv(self.act_shape, self.dtype, self._peer(a.vstage + 1), pp_bwd,
                                     tag=self._tag(1, a.vstage, a.mb))
                with self.spans.span("bwd", a.vstage, a.mb):
                    torch.autograd.backward(y, grad)
                if x is not None:
                    if self._peer(a.vstage - 1) == self.ctx.rank:
                        local_bwd[(a.vstage - 1, a.mb)] = x.grad
                    else:
                        comm.send(x.grad, self._peer(a.vstage - 1), pp_bwd,
                                  tag=self._tag(1, a.vstage - 1, a.mb))
                if self.on_backward is not None:
                    self.on_backward(a.vstage, a.mb)
        comm.wait_sends()
        return loss
