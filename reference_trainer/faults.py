"""Fault injection with recorded ground truth: ``--fault KIND:key=value,...`` on the command line.

| kind | spec | effect |
|---|---|---|
| ``slow`` | ``slow:rank=5,factor=1.5[,steps=2-4]`` | the rank's compute (fwd/bwd/opt spans, minus the comm inside them) takes ``factor`` times as long |
| ``moving`` | ``moving:ranks=1+5+3,factor=2[,steps=..]`` | a straggler that moves: at step s the rank ``ranks[s % len]`` is slow |
| ``link`` | ``link:a=2,b=3,delay_ms=40[,steps=..]`` | every op whose group holds both ranks is delayed by ``delay_ms`` on them (p2p: on the sender) |
| ``hang`` | ``hang:rank=3,step=1[,op=all_reduce][,dim=dp]`` | the rank stalls forever before its first matching collective of that step |
| ``cp_imbalance`` | ``cp_imbalance:ranks=1[,weight=0.5][,short=4]`` | documents packed so that CP ranks ``ranks`` get the long ones; compute stretched by the rank's unmasked attention pairs |

Lists use ``+`` (``ranks=1+5``); steps are ``a-b`` (inclusive) or ``a+b+c``; no steps = every step.
``ground_truth`` is what the manifest's ``faults`` list records: kind, ranks, steps, magnitude.

How the injectors act (so analyses know what to expect). With an emulated device
(``device_gflops`` > 0, reference_trainer/device.py) every compute span lasts the time a device
needs for its work, and a slow or moving fault multiplies that time by ``factor`` (a CP imbalance
by the rank's attention stretch, below): the rank is as much slower as the fault says, whatever
else shares the machine's cores. Without one, slow compute burns ``factor - 1`` times the span's
own CPU time (process CPU time, comm excluded) at the end of each compute span; it spins rather
than sleeps because ranks share CPU cores and the fair scheduler repays a sleeper afterwards, and
it is only as precise as the CPU time of ranks that share cores (10-30% scatter on 2 cores).

The link delay runs after the flight recorder stamped the op's start, inside the op's ``tk.comm``
span and before the transfer: both ranks arrive on time and the transfer takes ``delay_ms`` longer,
which is what a slow link looks like. The hang stalls before the flight recorder sees the op, so the
stalled rank is missing from that collective in every dump. The trainer's attention is dense (a
masked softmax), so CP data imbalance does not change its real cost; ``cp_imbalance`` emulates a
kernel whose cost follows the unmasked (query, key) pairs: fwd/bwd compute of a CP rank is
stretched by ``1 + weight * (pairs / mean pairs of its CP group - 1)`` when that exceeds 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tracekit.conventions import ComputeAnnotation

from .comm import CommRecord
from .config import TrainConfig
from .device import EmulatedDevice

KINDS = ("slow", "moving", "link", "hang", "cp_imbalance")


class FaultError(ValueError):
    """A fault spec that does not parse or does not fit the run."""


@dataclass(frozen=True)
class Fault:
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    spec: str = ""

    def steps(self, n_steps: int) -> list[int]:
        s = self.params.get("steps")
        return list(range(n_steps)) if s is None else [x for x in s if x < n_steps]

    def active(self, step: int) -> bool:
        s = self.params.get("steps")
        return s is None or step in s

    def slow_rank(self, step: int) -> int | None:
        """The rank whose compute is slowed at ``step`` (slow and moving faults)."""
        if not self.active(step):
            return None
        if self.kind == "slow":
            return self.params["rank"]
        if self.kind == "moving":
            ranks = self.params["ranks"]
            return ranks[step % len(ranks)]
        return None


def _ints(text: str, spec: str) -> list[int]:
    try:
        if "-" in text:
            a, b = text.split("-", 1)
            return list(range(int(a), int(b) + 1))
        return [int(x) for x in text.split("+")]
    except ValueError:
        raise FaultError(f"fault {spec!r}: {text!r} is not an integer list (a-b or a+b+c)") from None


_REQUIRED = {"slow": ("rank", "factor"), "moving": ("ranks", "factor"), "link": ("a", "b", "delay_ms"),
             "hang": ("rank", "step"), "cp_imbalance": ("ranks",)}
_ALLOWED = {"slow": {"steps"}, "moving": {"steps"}, "link": {"steps"}, "hang": {"op", "dim"},
            "cp_imbalance": {"weight", "short"}}
_INT = {"rank", "a", "b", "step", "short"}
_FLOAT = {"factor", "delay_ms", "weight"}
_LIST = {"ranks", "steps"}


def parse_fault(spec: str) -> Fault:
    kind, sep, rest = spec.strip().partition(":")
    if kind not in KINDS:
        raise FaultError(f"fault {spec!r}: unknown kind {kind!r}; expected one of {KINDS}")
    params: dict[str, Any] = {}
    for tok in filter(None, rest.split(",")):
        key, eq, val = tok.partition("=")
        if not eq:
            raise FaultError(f"fault {spec!r}: {tok!r} is not key=value")
        if key not in _REQUIRED[kind] and key not in _ALLOWED[kind]:
            raise FaultError(f"fault {spec!r}: unknown field {key!r} for {kind}; "
                             f"allowed {sorted(set(_REQUIRED[kind]) | _ALLOWED[kind])}")
        try:
            params[key] = (int(val) if key in _INT else float(val) if key in _FLOAT else
                           _ints(val, spec) if key in _LIST else val)
        except ValueError:
            raise FaultError(f"fault {spec!r}: {key}={val!r} is not a number") from None
    missing = [k for k in _REQUIRED[kind] if k not in params]
    if missing:
        raise FaultError(f"fault {spec!r}: missing {missing}")
    if params.get("factor", 1.0) < 1.0:
        raise FaultError(f"fault {spec!r}: factor must be >= 1")
    if params.get("delay_ms", 0.0) < 0:
        raise FaultError(f"fault {spec!r}: delay_ms must be >= 0")
    return Fault(kind, params, spec.strip())


def parse_faults(specs: str | tuple[str, ...] | list[str]) -> list[Fault]:
    """``specs``: a list of specs, or one string of specs separated by ``;``."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(";") if s.strip()]
    return [parse_fault(s) for s in specs]


def check_faults(faults: list[Fault], cfg: TrainConfig) -> None:
    world = cfg.world_size
    for f in faults:
        p = f.params
        ranks = [p[k] for k in ("rank", "a", "b") if k in p] + (p["ranks"] if f.kind == "moving" else [])
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise FaultError(f"fault {f.spec!r}: ranks {bad} outside the world of {world}")
        if f.kind == "link" and p["a"] == p["b"]:
            raise FaultError(f"fault {f.spec!r}: a link needs two different ranks")
        if f.kind == "hang" and not 0 <= p["step"] < cfg.steps:
            raise FaultError(f"fault {f.spec!r}: step {p['step']} outside 0..{cfg.steps - 1}")
        if f.kind == "cp_imbalance":
            if cfg.cp < 2:
                raise FaultError(f"fault {f.spec!r}: needs cp >= 2, run has cp={cfg.cp}")
            if any(not 0 <= r < cfg.cp for r in p["ranks"]):
                raise FaultError(f"fault {f.spec!r}: CP ranks {p['ranks']} outside 0..{cfg.cp - 1}")


def ground_truth(f: Fault, cfg: TrainConfig) -> dict[str, Any]:
    """The manifest record of one fault: kind, global ranks, steps, magnitude (+ details)."""
    p, steps = f.params, f.steps(cfg.steps)
    out: dict[str, Any] = {"kind": f.kind, "spec": f.spec, "steps": steps}
    if f.kind == "slow":
        out.update(ranks=[p["rank"]], magnitude={"compute_factor": p["factor"]})
    elif f.kind == "moving":
        out.update(ranks=sorted(set(p["ranks"])), magnitude={"compute_factor": p["factor"]},
                   rank_by_step={str(s): f.slow_rank(s) for s in steps})
    elif f.kind == "link":
        out.update(ranks=[p["a"], p["b"]], magnitude={"delay_ms": p["delay_ms"]})
    elif f.kind == "hang":
        out.update(ranks=[p["rank"]], steps=[p["step"]], magnitude={"stall": "forever"},
                   op=p.get("op"), dim=p.get("dim"))
    elif f.kind == "cp_imbalance":
        pairs = cp_pairs_by_step(cfg, p["ranks"], p.get("short", 4))
        weight = p.get("weight", 0.5)
        factors = {str(s): [round(stretch(v, weight), 4) for v in ratios] for s, ratios in pairs.items()}
        slow = sorted({r for r in range(cfg.world_size)
                       if any(v[cfg.layout.coords(r).cp] > 1.05 for v in factors.values())})
        out.update(ranks=slow, cp_ranks=p["ranks"], sharding=cfg.cp_sharding,
                   magnitude={"weight": weight, "pair_ratio_by_step": pairs, "compute_factor_by_step": factors})
    return out


# -- CP data imbalance ------------------------------------------------------------------------
def stretch(pair_ratio: float, weight: float) -> float:
    return max(1.0, 1.0 + weight * (pair_ratio - 1.0))


class ImbalancedCorpus:
    """Same interface as ``data.Corpus``. Every sequence is cut into 2*cp chunks; the chunks that
    sequence sharding gives to CP ranks ``cp_ranks`` (i and 2cp-1-i) each hold one long document,
    every other chunk short documents of ``short`` tokens: the loaded ranks get most of the
    causal attention pairs. Per-document sharding splits every document evenly, and rebalances."""

    def __init__(self, cfg: TrainConfig, cp_ranks: list[int], short: int = 4):
        self.cfg, self.cp_ranks, self.short = cfg, list(cp_ranks), max(1, short)

    def _sequence(self, rng: np.random.Generator) -> torch.Tensor:
        c = self.cfg
        n = c.seq_len + 1
        chunk = c.seq_len // (2 * c.cp)
        long_chunks = {i for r in self.cp_ranks for i in (r, 2 * c.cp - 1 - r)}
        toks = rng.integers(1, c.vocab_size, size=n)
        toks[toks == c.eos_id] = (c.eos_id + 1) % c.vocab_size
        for i in range(2 * c.cp):
            lo, hi = i * chunk, (i + 1) * chunk
            if i in long_chunks:
                toks[hi - 1] = c.eos_id
            else:
                toks[lo + self.short:hi:self.short + 1] = c.eos_id
                toks[hi - 1] = c.eos_id
        return torch.from_numpy(toks.astype(np.int64))

    def global_batch(self, step: int) -> torch.Tensor:
        c = self.cfg
        rng = np.random.default_rng([c.seed, step, 7])
        return torch.stack([self._sequence(rng) for _ in range(c.dp * c.micro_batches * c.micro_batch_size)])

    def micro_batches(self, step: int, dp_rank: int) -> list[torch.Tensor]:
        c = self.cfg
        per = c.micro_batches * c.micro_batch_size
        return list(self.global_batch(step)[dp_rank * per:(dp_rank + 1) * per].split(c.micro_batch_size, 0))


def cp_pair_counts(cfg: TrainConfig, tokens: torch.Tensor) -> list[int]:
    """Unmasked (query, key) pairs of every CP rank for [b, S+1] tokens, under cfg.cp_sharding."""
    from .context_parallel import batch_shard_positions, document_causal_mask
    from .data import document_ids

    inputs = tokens[:, :-1]
    doc = document_ids(inputs, cfg.eos_id)
    pos = batch_shard_positions(doc, cfg.cp, cfg.cp_sharding)
    k_pos = pos.reshape(pos.shape[0], -1)
    return [int(document_causal_mask(pos[:, r], k_pos, doc).sum()) for r in range(cfg.cp)]


def cp_pairs_by_step(cfg: TrainConfig, cp_ranks: list[int], short: int) -> dict[str, list[float]]:
    """Per step, every CP rank's attention pairs over the whole global batch / the CP mean."""
    corpus = ImbalancedCorpus(cfg, cp_ranks, short)
    out = {}
    for s in range(cfg.steps):
        counts = np.array(cp_pair_counts(cfg, corpus.global_batch(s)), dtype=float)
        out[str(s)] = [round(float(v), 4) for v in counts / counts.mean()]
    return out


# -- injectors --------------------------------------------------------------------------------
class _Clock:
    """CPU time this rank spent inside synchronous comm ops (to take it out of compute spans)."""

    def __init__(self) -> None:
        self.comm_cpu_s = 0.0

    def before(self, record: CommRecord) -> None:
        record.extra["fault_c0"] = time.process_time()

    def after(self, record: CommRecord) -> None:
        if not record.is_async and "fault_c0" in record.extra:
            self.comm_cpu_s += time.process_time() - record.extra["fault_c0"]


class FaultFactor:
    """How much longer this rank's compute takes at the current step, by phase: the product of the
    slow/moving faults that name the rank, and (fwd/bwd) its CP data-imbalance stretch."""

    def __init__(self, rank: int, faults: list[Fault], step_of, cp_factor_by_step: dict[int, float] | None = None):
        self.rank, self.faults, self.step_of = rank, faults, step_of
        self.cp_factor_by_step = cp_factor_by_step or {}

    def __call__(self, ann: ComputeAnnotation) -> float:
        step = self.step_of()
        f = 1.0
        for fault in self.faults:
            if fault.slow_rank(step) == self.rank:
                f *= fault.params["factor"]
        if ann.phase in ("fwd", "bwd"):
            f *= self.cp_factor_by_step.get(step, 1.0)
        return f


class ComputeStretch:
    """ComputeHook without an emulated device: burns (factor - 1) x the span's own CPU time (comm
    excluded) at its end."""

    def __init__(self, factor: FaultFactor, clock: _Clock):
        self.factor, self.clock = factor, clock
        self._cpu0 = self._comm0 = 0.0
        self.burnt_s = 0.0

    def before(self, ann: ComputeAnnotation) -> None:
        self._cpu0, self._comm0 = time.process_time(), self.clock.comm_cpu_s

    def after(self, ann: ComputeAnnotation) -> None:
        f = self.factor(ann)
        if f > 1.0:
            own = (time.process_time() - self._cpu0) - (self.clock.comm_cpu_s - self._comm0)
            extra = max(0.0, own) * (f - 1.0)
            end = time.process_time() + extra
            while time.process_time() < end:
                pass
            self.burnt_s += extra


class Stall:
    """CommHook (registered before the flight recorder): the hang fault."""

    def __init__(self, rank: int, faults: list[Fault], step_of):
        self.rank, self.step_of = rank, step_of
        self.faults = [f for f in faults if f.kind == "hang" and f.params["rank"] == rank]

    def before(self, record: CommRecord) -> None:
        step = self.step_of()
        for f in self.faults:
            p = f.params
            if (step == p["step"] and record.annotation.peer is None
                    and p.get("op", record.op) == record.op and p.get("dim", record.group.dim) == record.group.dim):
                while True:  # stalled for good: the launcher's timeout ends the world
                    time.sleep(1.0)

    def after(self, record: CommRecord) -> None:
        pass


class LinkDelay:
    """CommHook (registered after the flight recorder): the slow-link fault."""

    def __init__(self, rank: int, faults: list[Fault], step_of):
        self.rank, self.step_of = rank, step_of
        self.faults = [f for f in faults if f.kind == "link" and rank in (f.params["a"], f.params["b"])]

    def before(self, record: CommRecord) -> None:
        pass

    def during(self, record: CommRecord) -> None:
        step = self.step_of()
        for f in self.faults:
            a, b = f.params["a"], f.params["b"]
            if not f.active(step) or a not in record.group.ranks or b not in record.group.ranks:
                continue
            peer = record.annotation.peer
            if peer is None or (record.op == "send" and peer in (a, b)):
                time.sleep(f.params["delay_ms"] / 1000.0)

    def after(self, record: CommRecord) -> None:
        pass


def install(trainer, faults: list[Fault]) -> dict[str, Any]:
    """Attach this rank's injectors (and its emulated device, if configured) to ``trainer``: call
    before registering the flight recorder, then ``late_hooks`` after it.
    Returns {"late_hooks": [...], "stretch": ComputeStretch | None, "device": EmulatedDevice | None}."""
    cfg, comm = trainer.cfg, trainer.ctx.comm
    rank = comm.rank

    def step_of() -> int:
        return trainer.step_index

    cp_factors: dict[int, float] = {}
    for f in faults:
        if f.kind == "cp_imbalance":
            trainer.corpus = ImbalancedCorpus(cfg, f.params["ranks"], f.params.get("short", 4))
            me = trainer.ctx.coords
            weight = f.params.get("weight", 0.5)
            for s in range(cfg.steps):
                mine = torch.cat(trainer.corpus.micro_batches(s, me.dp))
                counts = np.array(cp_pair_counts(cfg, mine), dtype=float)
                cp_factors[s] = stretch(float(counts[me.cp] / counts.mean()), weight)
    clock = _Clock()
    factor = FaultFactor(rank, faults, step_of, cp_factors)
    device = stretch_hook = None
    if cfg.device_gflops > 0:
        device = EmulatedDevice(rank, cfg.device_gflops, cfg.device_gbps, cfg.device_launch_us, cfg.device_jitter,
                                cfg.seed, factor, step_of)
        comm.add_hook(device.comm_hook)  # first: its wait for the device is compute, not comm
    comm.add_hook(clock)
    comm.add_hook(Stall(rank, faults, step_of))
    if device is not None:
        trainer.spans.add_hook(device.compute_hook)
    else:
        stretch_hook = ComputeStretch(factor, clock)
        trainer.spans.add_hook(stretch_hook)
    return {"late_hooks": [LinkDelay(rank, faults, step_of)], "stretch": stretch_hook, "device": device}
