"""Reduction-order models: what a collective computes, add by add, so it can be reproduced bit for bit.

Floating-point addition is not associative, so a sum over ranks is only reproducible if its
association is known. Two orders are modelled:

- ``gloo_ring``: gloo's default ring all-reduce, as measured on this project's torch/gloo (see
  ALGORITHMS.md, Numerics). For n ranks and a tensor of B bytes, the tensor is cut into
  ``num_segments = roundUp(max(ceil(B / 1 MiB), 2n), n)`` segments of
  ``ceil(B / num_segments)`` bytes (rounded up to the element size; the tail may be short or
  empty). Chunk c (``num_segments / n`` consecutive segments) is owned by group rank c and summed as
  ``x[c-1] + x[c-2] + ... + x[c+1] + x[c]`` (indices mod n), each add rounded in the tensor dtype.
  AVG is that sum divided by n. ``reduce_scatter_tensor`` is the full all-reduce of the
  concatenated input, then the caller's own slice. These are gloo internals, not an API contract:
  ``numerics.gloo_selftest`` checks them against real gloo collectives.
- ``canonical``: all-gather, then the rank-ordered chained sum ``((x0 + x1) + x2) + ...`` in the
  tensor dtype; AVG divides by n. Any backend can be made to follow it
  (``numerics.canonical_comm``), so a run switched to it is emulatable everywhere.

Apply a model to exactly the tensor the real collective reduces: the ring's segment layout depends
on that tensor's total size, so a flat gradient bucket must be modelled as one tensor, not parameter
by parameter.

Every add is an explicit elementwise tensor add in the collective's dtype: torch's own ``sum`` of a
bf16 tensor accumulates in fp32 internally and would NOT reproduce a bf16 collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

MAX_SEGMENT_BYTES = 1 << 20  # gloo's ring all-reduce cuts messages into segments of at most 1 MiB
OPS = ("sum", "avg")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, multiple: int) -> int:
    return _ceil_div(a, multiple) * multiple


@dataclass(frozen=True)
class RingPlan:
    """How gloo's ring all-reduce partitions a tensor of ``numel`` elements over ``n`` ranks."""

    n: int
    numel: int
    element_size: int
    num_segments: int
    segment_elems: int

    @property
    def segments_per_rank(self) -> int:
        return self.num_segments // self.n

    def chunk_range(self, owner: int) -> tuple[int, int]:
        """Element range [start, stop) of the chunk that group rank ``owner`` reduces (may be empty)."""
        span = self.segments_per_rank * self.segment_elems
        start = min(owner * span, self.numel)
        return start, min(start + span, self.numel)

    def add_order(self, owner: int) -> list[int]:
        """Group ranks whose inputs are added, in order, for the chunk owned by ``owner``."""
        return [(owner - 1 - i) % self.n for i in range(self.n)]


def ring_plan(numel: int, element_size: int, n: int) -> RingPlan:
    """The segment layout gloo's ring all-reduce uses for ``numel`` elements on ``n`` ranks."""
    if n < 1 or numel < 0 or element_size < 1:
        raise ValueError(f"ring_plan needs n >= 1, numel >= 0, element_size >= 1 (got {n}, {numel}, {element_size})")
    total_bytes = numel * element_size
    num_segments = _round_up(max(_ceil_div(total_bytes, MAX_SEGMENT_BYTES), 2 * n), n)
    segment_bytes = _round_up(_ceil_div(total_bytes, num_segments), element_size)
    return RingPlan(n, numel, element_size, num_segments, segment_bytes // element_size)


def chained_sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((t0 + t1) + t2) + ...``, each add rounded in the terms' dtype. Returns a new tensor."""
    if not terms:
        raise ValueError("chained_sum needs at least one term")
    acc = terms[0].clone()
    for t in terms[1:]:
        acc.add_(t)  # elementwise: one rounding per add in acc's dtype
    return acc


def _finish(total: torch.Tensor, op: str, n: int) -> torch.Tensor:
    return total.div_(n) if op == "avg" else total


def _check_inputs(inputs: Sequence[torch.Tensor], op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unsupported reduce op {op!r}; expected one of {OPS}")
    if len(inputs) == 0:
        raise ValueError("a collective needs at least one rank's input")
    first = inputs[0]
    if not first.is_floating_point():
        raise ValueError(f"reduction-order models are for floating-point tensors, got {first.dtype}")
    for r, t in enumerate(inputs):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"rank {r} input is {tuple(t.shape)} {t.dtype}, rank 0 input is {tuple(first.shape)} {first.dtype}"
            )


def _split_rows(full: torch.Tensor, n: int) -> list[torch.Tensor]:
    if full.dim() == 0 or full.shape[0] % n:
        raise ValueError(f"reduce_scatter input of shape {tuple(full.shape)} does not split into {n} equal parts along dim 0")
    return [c.clone() for c in full.chunk(n, dim=0)]


class ReductionOrder(Protocol):
    """What a sum over ranks computes, in a fixed association. Inputs are indexed by group rank."""

    name: str

    def all_reduce(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor: ...

    def reduce_scatter(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> list[torch.Tensor]: ...


class GlooRing:
    """gloo's default ring all-reduce; ``reduce_scatter`` is gloo's all-reduce then one's own slice."""

    name = "gloo_ring"

    def all_reduce(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
        _check_inputs(inputs, op)
        n = len(inputs)
        flat = [t.reshape(-1) for t in inputs]
        plan = ring_plan(flat[0].numel(), flat[0].element_size(), n)
        out = torch.empty_like(flat[0])
        for owner in range(n):
            start, stop = plan.chunk_range(owner)
            if start < stop:
                out[start:stop] = chained_sum([flat[r][start:stop] for r in plan.add_order(owner)])
        return _finish(out, op, n).reshape(inputs[0].shape)

    def reduce_scatter(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> list[torch.Tensor]:
        _check_inputs(inputs, op)
        return _split_rows(self.all_reduce(inputs, op), len(inputs))


class Canonical:
    """All-gather, then the rank-ordered chained sum; the same on every backend."""

    name = "canonical"

    def all_reduce(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
        _check_inputs(inputs, op)
        return _finish(chained_sum(inputs), op, len(inputs))

    def reduce_scatter(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> list[torch.Tensor]:
        _check_inputs(inputs, op)
        return _split_rows(self.all_reduce(inputs, op), len(inputs))


class _Alternative:
    """Orders a collective could plausibly use instead (for the bug-or-order envelope, not a model of a
    real backend): all-gather, then a fixed association; ``reduce_scatter`` takes one's own slice."""

    name = ""

    def _sum(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
        _check_inputs(inputs, op)
        return _finish(self._sum(inputs), op, len(inputs))

    def reduce_scatter(self, inputs: Sequence[torch.Tensor], op: str = "sum") -> list[torch.Tensor]:
        _check_inputs(inputs, op)
        return _split_rows(self.all_reduce(inputs, op), len(inputs))


class Reversed(_Alternative):
    """The chained sum in descending rank order: ``((x[n-1] + x[n-2]) + ...) + x0``."""

    name = "reversed"

    def _sum(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return chained_sum(list(reversed(inputs)))


class Pairwise(_Alternative):
    """A binary tree over ranks in order (recursive halving/doubling, NCCL's tree): ``(x0 + x1) + (x2 + x3)``."""

    name = "pairwise"

    def _sum(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        level = [t.clone() for t in inputs]
        while len(level) > 1:
            level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
        return level[0]


class Exact(_Alternative):
    """Summed in fp64 and rounded once to the dtype: the best any order can do."""

    name = "fp64"

    def _sum(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return chained_sum([t.double() for t in inputs]).to(inputs[0].dtype)


ORDERS: dict[str, ReductionOrder] = {o.name: o for o in (GlooRing(), Canonical())}
ALTERNATIVES: dict[str, ReductionOrder] = {o.name: o for o in (GlooRing(), Canonical(), Reversed(), Pairwise(), Exact())}


def get_order(name: str) -> ReductionOrder:
    """The reduction-order model called ``name`` (``gloo_ring`` or ``canonical``)."""
    try:
        return ALTERNATIVES[name]
    except KeyError:
        raise ValueError(f"unknown reduction order {name!r}; expected one of {sorted(ORDERS)}") from None
