"""Forward activations of a step, reassembled from rank shards into full tensors and located.

Both sides, the trainer's ``--record-activations`` dump and the sequential reference, record every
rank's shard of every point (keys: ``numerics.corpus.shard_key``). Both are reassembled here the same
way, into one tensor per point of shape [dp, micro-batch, batch, S, ...] (global sequence, full hidden
or vocabulary), from the *plan's* CP positions and TP/SP split, never from the positions a rank
believed it held: a sharding bug then shows as the wrong data at the right place. The positions the
trainer recorded are checked against the plan separately (``sharding_mismatches``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from numerics.compare import _INT_VIEW
from numerics.corpus import activation_points, global_batch, positions_key, shard_key
from numerics.plan import AccumulationPlan
from numerics.reference_model import document_ids


class ActivationRecordError(ValueError):
    """A state dump whose activation records are missing or do not fit the plan."""


def plan_positions(plan: AccumulationPlan, step: int) -> list[list[torch.Tensor]]:
    """[dp][micro-batch] -> [b, cp, S/cp]: the global positions each CP rank holds, per the plan."""
    c = plan.cfg
    batches = global_batch(c, step)
    per_replica = c.micro_batches * c.micro_batch_size
    out = []
    for d in range(c.dp):
        mbs = batches[d * per_replica:(d + 1) * per_replica].split(c.micro_batch_size, 0)
        out.append([plan.cp_positions(document_ids(t[:, :-1], c.eos_id)) for t in mbs])
    return out


def assemble(plan: AccumulationPlan, acts: dict[str, torch.Tensor], positions: list[list[torch.Tensor]],
             source: str, skip_missing: bool = False) -> dict[str, torch.Tensor]:
    """Point name -> full tensor [dp, mb, b, S, ...]: ``seq`` shards concatenated along the sequence
    (TP rank order), ``last`` shards along the last dimension, ``tokens`` shards stacked on a new last
    dimension of size tp (every TP rank's copy is compared); CP-local rows placed at their positions.
    ``skip_missing``: leave out a point with missing records (a run known to lack layers) instead of failing."""
    c = plan.cfg
    out = {}
    for point, kind in activation_points(c):
        if skip_missing and shard_key(point, 0, 0, 0, 0) not in acts:
            continue
        full: torch.Tensor | None = None
        for d in range(c.dp):
            for i in range(c.micro_batches):
                pos = positions[d][i]
                rows = torch.arange(pos.shape[0])[:, None]
                for cp in range(c.cp):
                    keys = [shard_key(point, d, cp, t, i) for t in range(c.tp)]
                    missing = [k for k in keys if k not in acts]
                    if missing:
                        raise ActivationRecordError(f"{source}: no activation record {missing[0]!r}")
                    parts = [acts[k] for k in keys]
                    local = (torch.cat(parts, 1) if kind == "seq" else torch.cat(parts, -1) if kind == "last"
                             else torch.stack(parts, -1))
                    if tuple(local.shape[:2]) != tuple(pos[:, cp].shape):
                        raise ActivationRecordError(
                            f"{source}: {point} of dp {d} micro-batch {i} CP rank {cp} covers {tuple(local.shape[:2])} "
                            f"(batch, tokens); the plan gives this rank {tuple(pos[:, cp].shape)}")
                    if full is None:
                        full = torch.zeros((c.dp, c.micro_batches, pos.shape[0], c.seq_len, *local.shape[2:]),
                                           dtype=local.dtype)
                    full[d, i][rows, pos[:, cp]] = local
        assert full is not None
        out[point] = full
    return out


def _ranges(values: list[int], limit: int = 6) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0..2, 5, 7..8' (at most ``limit`` runs, then the count left out)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs[:limit])
    return text + (f", ... ({len(runs) - limit} more runs)" if len(runs) > limit else "")


@dataclass(frozen=True)
class Divergence:
    """Where one activation point differs: the first micro-batch in execution order (micro-batch,
    then DP replica), its first differing sequence and the token positions that differ there."""

    point: str
    dp: int
    micro_batch: int
    sequence: int
    tokens: tuple[int, ...]  # global positions in that sequence with at least one differing element
    micro_batches_differing: int  # (dp, micro-batch) pairs with any difference
    micro_batches_total: int

    def describe(self) -> str:
        return (f"micro-batch {self.micro_batch} (dp {self.dp}), sequence {self.sequence}: tokens "
                f"{_ranges(list(self.tokens))} differ ({len(self.tokens)} tokens; "
                f"{self.micro_batches_differing}/{self.micro_batches_total} micro-batches differ)")


def locate(point: str, actual: torch.Tensor, expected: torch.Tensor) -> Divergence | None:
    """The first differing place of a full activation tensor [dp, mb, b, S, ...]; None if bit-exact."""
    view = _INT_VIEW[actual.dtype]
    differs = actual.contiguous().view(view) != expected.contiguous().view(view)
    per_token = differs.reshape(*differs.shape[:4], -1).any(-1)  # [dp, mb, b, S]
    per_mb = per_token.any(-1).any(-1)  # [dp, mb]
    if not bool(per_mb.any()):
        return None
    d, i = min(((int(d), int(i)) for d, i in per_mb.nonzero()), key=lambda di: (di[1], di[0]))
    b = int(per_token[d, i].any(-1).nonzero()[0])
    tokens = tuple(int(t) for t in per_token[d, i, b].nonzero().flatten())
    return Divergence(point, d, i, b, tokens, int(per_mb.sum()), per_mb.numel())


def sharding_mismatches(plan: AccumulationPlan, recorded: dict[str, torch.Tensor],
                        positions: list[list[torch.Tensor]], source: str) -> tuple[str, ...]:
    """Where the positions a CP rank recorded differ from the plan's, one line per CP rank of the
    first (micro-batch, dp) that differs, plus a count; empty when every rank held its planned tokens."""
    c, lines, n_bad = plan.cfg, [], 0
    for i in range(c.micro_batches):
        for d in range(c.dp):
            bad = []
            for cp in range(c.cp):
                key = positions_key(d, cp, i)
                if key not in recorded:
                    raise ActivationRecordError(f"{source}: no positions record {key!r}")
                got, want = recorded[key], positions[d][i][:, cp]
                if got.shape != want.shape or not torch.equal(got, want):
                    bad.append((cp, got, want))
            n_bad += bool(bad)
            if bad and not lines:
                for cp, got, want in bad:
                    lines.append(f"micro-batch {i} (dp {d}) CP rank {cp} held positions "
                                 f"{_ranges(sorted(set(got[0].tolist())))} of sequence 0 (repeats: "
                                 f"{got[0].numel() - got[0].unique().numel()}); the plan gives "
                                 f"{_ranges(want[0].tolist())}")
    if lines:
        lines.append(f"{n_bad}/{c.dp * c.micro_batches} micro-batches sharded differently from the plan")
    return tuple(lines)
