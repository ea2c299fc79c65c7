"""Per-layer forward activations of every micro-batch, recorded for the numerics check only
(``record_activations``; never in normal training).

A record is a ``detach().clone()`` at a module boundary, so it adds no op to the computation and
cannot change a bit of it. Each rank keeps its own shard as it is; the numerics side reassembles the
full (global sequence, full hidden) tensors from the plan, not from what the rank believed.

Recording points, in forward order (``activation_points``), with the shard layout on a rank:

- ``seq``: sequence-parallel [b, S/(cp*tp), h], TP rank t holding rows t*S/(cp*tp).. of the rank's
  CP-local sequence: ``embed``, ``layers.<i>.attention`` (after wo and its reduce-scatter, before the
  residual add), ``layers.<i>.mlp`` (likewise after w2), ``layers.<i>`` (the block output), ``norm``;
- ``last``: the CP-local sequence, split over TP along the last dimension:
  ``layers.<i>.attention.heads`` (softmax(q k^T) v of this rank's heads, before wo), ``logits`` ([.., V/tp]);
- ``tokens``: [b, S/cp], the same on every TP rank: ``token_loss`` (per-token cross-entropy, fp32).
"""

from __future__ import annotations

import torch

from .config import TrainConfig

LAYER_POINTS = (("attention.heads", "last"), ("attention", "seq"), ("mlp", "seq"), ("", "seq"))


def activation_points(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(point name, shard layout) of every recording point, in forward order."""
    out = [("embed", "seq")]
    for i in range(cfg.n_layers):
        out += [(f"layers.{i}" + (f".{p}" if p else ""), kind) for p, kind in LAYER_POINTS]
    return out + [("norm", "seq"), ("logits", "last"), ("token_loss", "tokens")]


def shard_key(point: str, dp: int, cp: int, tp: int, mb: int) -> str:
    """Key of one rank's shard in a state dump's ``activations`` dict."""
    return f"{point}/dp{dp}/cp{cp}/tp{tp}/mb{mb}"


def positions_key(dp: int, cp: int, mb: int) -> str:
    """Key of the global positions a CP rank held, in a state dump's ``positions`` dict."""
    return f"dp{dp}/cp{cp}/mb{mb}"


class ActivationRecorder:
    """One rank's records of the current step: (micro-batch, point) -> shard, mb -> positions."""

    def __init__(self) -> None:
        self.shards: dict[tuple[int, str], torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.shards.clear()
        self.positions.clear()

    def record(self, mb: int, point: str, x: torch.Tensor) -> None:
        self.shards[(mb, point)] = x.detach().clone()

    def record_positions(self, mb: int, positions: torch.Tensor) -> None:
        self.positions[mb] = positions.detach().clone()

    def export(self, dp: int, cp: int, tp: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(activations, positions) on the CPU under their dump keys."""
        acts = {shard_key(p, dp, cp, tp, mb): t.cpu() for (mb, p), t in self.shards.items()}
        pos = {positions_key(dp, cp, mb): t.cpu() for mb, t in self.positions.items()}
        return acts, pos
