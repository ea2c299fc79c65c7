"""Structural findings of a check, before any buffer is compared: the pipeline split the run
recorded against the one derived from the config, the data every rank trained on (its recorded
hashes) against the batches built from the config, and buffers the run lacks. Each is a bug
(exit 1) with no bug-or-order question: no reordering drops a layer or changes a token.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from numerics.corpus import batch_hash, data_hash_key, global_batch, replica_micro_batches
from numerics.plan import AccumulationPlan


class RunStateError(ValueError):
    """A run directory whose dumped state is missing or malformed."""


def missing_buffers(parallel: Sequence[dict], reference: Sequence[dict], plan: AccumulationPlan,
                    flatten: Callable[..., dict[str, torch.Tensor]], skip_missing: bool = False) -> tuple[str, ...]:
    """Buffers of the reference that the parallel run lacks or holds in another shape (a dropped
    layer, a lost shard), grouped by layer."""
    a = flatten(plan, parallel[0], 0, "parallel step 0", skip_missing)
    b = flatten(plan, reference[0], 0, "reference step 0")
    gone = [n for n in b if n not in a]
    odd = [f"{n} is {tuple(a[n].shape)} {a[n].dtype}, expected {tuple(b[n].shape)} {b[n].dtype}"
           for n in b if n in a and (a[n].shape != b[n].shape or a[n].dtype != b[n].dtype)]
    out = []
    if gone:
        layers = sorted({int(n.split(".")[1]) for n in gone if n.split("/", 1)[1].startswith("layers.")})
        out.append(f"the parallel run has no {len(gone)} buffer(s) the config implies (first {gone[0]!r}"
                   + (f"; layers {layers} missing" if layers else "") + ")")
    out += [f"shape/dtype differs: {t}" for t in odd[:3]]
    return tuple(out)


def data_findings(plan: AccumulationPlan, parallel: Sequence[dict]) -> tuple[str, ...]:
    """Every rank's micro-batches (the hashes the trainer recorded) against the batches the config
    specifies (built here): which rank trained on other tokens, by step, rank and micro-batch."""
    c, out, n_bad = plan.cfg, [], 0
    for step, state in enumerate(parallel):
        recorded = state.get("data_hashes")
        if not isinstance(recorded, dict):
            raise RunStateError(f"step {step}: the state dump has no data_hashes (a trainer without them "
                                "cannot be checked independently)")
        batch = global_batch(c, step)
        for d in range(c.dp):
            want = [batch_hash(t) for t in replica_micro_batches(c, batch, d)]
            for pp in range(c.pp):
                for cp in range(c.cp):
                    for tp in range(c.tp):
                        for i, h in enumerate(want):
                            got = recorded.get(data_hash_key(d, cp, tp, pp, i))
                            if got != h:
                                n_bad += 1
                                if len(out) < 3:
                                    rank = tp + c.tp * (cp + c.cp * (pp + c.pp * d))
                                    what = "recorded no hash" if got is None else "trained on other tokens"
                                    out.append(f"data: step {step} micro-batch {i}: rank {rank} (dp {d}, pp {pp}, "
                                               f"cp {cp}, tp {tp}) {what} than the config specifies")
    if n_bad > len(out):
        out.append(f"data: {n_bad} (rank, micro-batch) pairs differ in all")
    return tuple(out)


def stage_findings(plan: AccumulationPlan, manifest: Mapping[str, Any]) -> tuple[str, ...]:
    """The run's recorded pipeline split against the one derived from the config."""
    recorded = manifest.get("stage_layers")
    want = [list(r) for r in plan.stage_layers]
    if recorded is None or recorded == want:
        return ()
    held = [i for s in recorded for i in s] if isinstance(recorded, list) else []
    missing = sorted(set(range(plan.cfg.n_layers)) - set(held))
    twice = sorted({i for i in held if held.count(i) > 1})
    return (f"pipeline split: the run placed layers {recorded}, the config gives {want}"
            + (f"; layer(s) {missing} on no stage" if missing else "") + (f"; layer(s) {twice} on two stages" if twice else ""),)
