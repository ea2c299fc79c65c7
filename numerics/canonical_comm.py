"""Real collectives in the ``canonical`` reduction order, on any backend.

A run that routes its reductions through these functions adds rank contributions in the order
``((x0 + x1) + x2) + ...`` (group ranks), each add in the tensor dtype, whatever algorithm the backend
would have used: ``numerics.reduction_order.Canonical`` then reproduces it bit for bit. The price is
bandwidth (every rank receives n slices instead of a ring's reduced ones), acceptable for a debug mode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from numerics.reduction_order import OPS, chained_sum

# torch 2.13 renamed the tensor-in/tensor-out collectives (*_single); older releases have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unsupported reduce op {op!r}; expected one of {OPS}")


def canonical_all_reduce_(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place: all-gather, then the rank-ordered chained sum (AVG: / n)."""
    _check_op(op)
    n = dist.get_world_size(group)
    flat = tensor.contiguous().reshape(-1)
    # gloo wants the concatenated (1-D) form of the gathered output
    gathered = torch.empty(n * flat.numel(), dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(gathered, flat, group=group)
    total = chained_sum(list(gathered.view(n, -1).unbind(0))).view(tensor.shape)
    if op == "avg":
        total.div_(n)
    return tensor.copy_(total)


def canonical_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``reduce_scatter_tensor`` in the canonical order: ``output`` = rank-ordered sum of every rank's
    slice ``group_rank`` of ``input`` (split along dim 0). Only the needed slices travel (all-to-all);
    the bits equal all-gather-then-sum because the sum is elementwise."""
    _check_op(op)
    n = dist.get_world_size(group)
    if input.dim() == 0 or input.shape[0] != n * output.shape[0] or input.shape[1:] != output.shape[1:]:
        raise ValueError(f"reduce_scatter of {tuple(input.shape)} into {tuple(output.shape)} over {n} ranks")
    received = torch.empty((n, *output.shape), dtype=input.dtype, device=input.device)
    dist.all_to_all_single(received, input.contiguous(), group=group)
    total = chained_sum(list(received.unbind(0)))
    if op == "avg":
        total.div_(n)
    return output.copy_(total)
