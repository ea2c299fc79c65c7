"""An emulated accelerator per rank: compute takes the time a device would need for the work done.

On a shared CPU, a rank's compute time is whatever the scheduler gives it: 8 ranks on 2 cores see
their span times scatter by 10-30% for identical work, so a 5% slower device is invisible. A real
job has one dedicated device per rank whose kernels take nearly the same time for the same shapes.
This module gives each rank such a device:

- the work of each compute span is counted once per (phase, virtual stage) by running its first
  occurrence under ``WorkCounter``: matmul FLOPs by torch's own formulas (``flop_counter``) and the
  bytes written by every other op (memory-bound: norms, softmax, the optimizer), split into
  segments at every communication op issued inside the span (a TP all-reduce, a CP all-gather);
- every occurrence then lasts ``flops / gflops + bytes / gbps + kernels * launch_us`` per segment
  (the last term models per-kernel overhead, which dominates tiny models), times the fault factor
  (a slow device, CP data imbalance) and a per-span jitter drawn from a seeded lognormal
  (``device_jitter``, relative sd; kernels on a real device vary by about 1%); the rank does the real
  CPU work, then sleeps until the device would have finished the segment, *before* it issues the
  next communication op, so its peers wait where they would wait on a GPU.

The real computation is unchanged (results stay bit for bit the same); only wall time is shaped.
If the CPU is slower than the emulated device (the model padded nothing), the span simply lasts
longer: choose a device slow enough for the machine (``device_gflops``; ``DeviceStats`` reports how
many segments overran).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from tracekit.conventions import ComputeAnnotation

_NOT_WORK = ("c10d", "_c10d_functional", "c10d_functional", "profiler", "record_function")


def _is_view(func) -> bool:
    """Ops whose outputs alias an input without writing it (view, transpose, expand): no work."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class WorkCounter(TorchDispatchMode):
    """Counts the device work of the ops run under it: matmul FLOPs and bytes written by the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _NOT_WORK:
            return out
        packet = func._overloadpacket
        if packet in flop_registry:
            self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
            self.ops += 1
        elif not _is_view(func):
            self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                              if isinstance(t, torch.Tensor))
            self.ops += 1
        return out

    def take(self) -> tuple[int, int, int]:
        """(flops, bytes, kernels) since the last take."""
        got = (self.flops, self.bytes, self.ops)
        self.flops = self.bytes = self.ops = 0
        return got


@dataclass
class DeviceStats:
    spans: int = 0
    segments: int = 0
    overruns: int = 0  # segments whose real CPU time already exceeded the device time
    slept_s: float = 0.0
    # span key -> (flops, bytes, kernels) per segment
    work: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


class EmulatedDevice:
    """Shapes compute-span wall time to a device model. Register ``compute_hook`` on the trainer's
    ComputeSpans and ``comm_hook`` on the comm layer *before* any hook that times comm ops."""

    def __init__(self, rank: int, gflops: float, gbps: float, launch_us: float, jitter: float, seed: int,
                 factor_of: Callable[[ComputeAnnotation], float], step_of: Callable[[], int],
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        if gflops <= 0 or gbps <= 0 or launch_us < 0:
            raise ValueError(f"device speed must be positive, got {gflops} GFLOP/s, {gbps} GB/s, "
                             f"{launch_us} us per kernel")
        self.rank, self.gflops, self.gbps, self.launch_us = rank, gflops, gbps, launch_us
        self.jitter, self.seed, self.factor_of, self.step_of = jitter, seed, factor_of, step_of
        self.clock, self.sleep = clock, sleep
        self.comm_s = 0.0  # time inside communication ops' spans (not compute)
        self._comm_t0 = 0.0
        self.stats = DeviceStats()
        self._costs: dict[str, list[float]] = {}  # span key -> device seconds per segment
        self._ann: ComputeAnnotation | None = None
        self._counter: WorkCounter | None = None
        self.compute_hook = _ComputeSide(self)
        self.comm_hook = _CommSide(self)

    def seconds(self, flops: int, nbytes: int, kernels: int) -> float:
        return flops / (self.gflops * 1e9) + nbytes / (self.gbps * 1e9) + kernels * self.launch_us * 1e-6

    def _jitter(self, ann: ComputeAnnotation) -> float:
        if self.jitter <= 0:
            return 1.0
        key = zlib.crc32(ann.span_name().encode())
        rng = np.random.default_rng([self.seed, self.rank, self.step_of(), key])
        return float(np.exp(rng.normal(0.0, self.jitter)))

    # -- span lifecycle -----------------------------------------------------------------------
    def open(self, ann: ComputeAnnotation) -> None:
        self._ann, self._key = ann, f"{ann.phase}|{ann.vstage}"
        self._scale = self.factor_of(ann) * self._jitter(ann)
        self._t0, self._comm0 = self.clock(), self.comm_s
        self._seg, self._due = 0, 0.0
        self.stats.spans += 1
        if self._key not in self._costs:  # first occurrence: count its work as it runs
            self._counter = WorkCounter()
            self._counter.__enter__()
            self.stats.work[self._key] = []

    def boundary(self) -> None:
        """A segment ends (a comm op is about to be issued, or the span ends): wait for the device."""
        if self._ann is None:
            return
        if self._counter is not None:
            work = self._counter.take()
            self.stats.work[self._key].append(work)
            cost = self.seconds(*work)
            self._costs.setdefault(self._key, []).append(cost)
        else:
            costs = self._costs[self._key]
            cost = costs[self._seg] if self._seg < len(costs) else 0.0
        self._seg += 1
        self._due += cost * self._scale
        self.stats.segments += 1
        busy = (self.clock() - self._t0) - (self.comm_s - self._comm0)
        if busy >= self._due:
            self.stats.overruns += 1
            return
        self.sleep(self._due - busy)
        self.stats.slept_s += self._due - busy

    def close(self) -> None:
        if self._ann is None:
            return
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.boundary()
            self._counter = None
        else:
            self.boundary()
        self._ann = None


class _ComputeSide:
    def __init__(self, dev: EmulatedDevice):
        self.dev = dev

    def before(self, ann: ComputeAnnotation) -> None:
        self.dev.open(ann)

    def after(self, ann: ComputeAnnotation) -> None:
        self.dev.close()


class _CommSide:
    """Registered first on the comm layer: its ``during`` runs first inside the op's profiler span
    and its ``after`` first once the span has closed, so the time it counts as communication is
    the op's span, as the trace shows it (the other hooks' work counts as compute, as there)."""

    def __init__(self, dev: EmulatedDevice):
        self.dev = dev

    def before(self, record) -> None:
        self.dev.boundary()

    def during(self, record) -> None:
        self.dev._comm_t0 = self.dev.clock()

    def after(self, record) -> None:
        if not record.is_async:
            self.dev.comm_s += self.dev.clock() - self.dev._comm_t0
