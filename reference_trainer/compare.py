"""Compare two exported training states (``Trainer.full_state``) tensor by tensor, by canonical name."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorDiff:
    kind: str  # grads | params
    name: str
    max_abs: float  # max |a - b|
    ref_max: float  # max |b|
    normwise: float  # ||a - b|| / ||b||
    equal: bool  # bit-identical

    @property
    def rel_to_max(self) -> float:
        return self.max_abs / self.ref_max if self.ref_max else (0.0 if self.max_abs == 0 else float("inf"))


@dataclass(frozen=True)
class StateDiff:
    loss_a: float
    loss_b: float
    tensors: list[TensorDiff]

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_a - self.loss_b)

    def worst(self, kind: str) -> TensorDiff:
        return max((t for t in self.tensors if t.kind == kind), key=lambda t: t.rel_to_max)

    @property
    def bit_identical(self) -> bool:
        return self.loss_a == self.loss_b and all(t.equal for t in self.tensors)


class StateMismatch(ValueError):
    pass


def diff_states(a: dict, b: dict) -> StateDiff:
    """``b`` is the reference. Raises StateMismatch if names or shapes differ."""
    rows = []
    for kind in ("grads", "params"):
        if set(a[kind]) != set(b[kind]):
            raise StateMismatch(f"{kind} names differ: only in a {sorted(set(a[kind]) - set(b[kind]))}, "
                                f"only in b {sorted(set(b[kind]) - set(a[kind]))}")
        for name, ref in b[kind].items():
            x = a[kind][name]
            if x.shape != ref.shape:
                raise StateMismatch(f"{kind} {name}: shape {tuple(x.shape)} vs {tuple(ref.shape)}")
            d = (x.double() - ref.double())
            rn, dn = float(ref.double().norm()), float(d.norm())
            normwise = dn / rn if rn else (0.0 if dn == 0 else float("inf"))
            rows.append(TensorDiff(kind, name, float(d.abs().max()), float(ref.abs().max()), normwise,
                                   bool(torch.equal(x, ref))))
    return StateDiff(float(a["loss"]), float(b["loss"]), rows)
