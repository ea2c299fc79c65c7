"""Per-rank torch.profiler traces over chosen steps, and memory snapshots in the CUDA snapshot format.

``RankProfiler`` profiles steps ``first..last`` with a ``torch.profiler.schedule`` (so
``ProfilerStep#N`` spans exist, N = the trainer's step index) and exports
``<run>/traces/rank<R>.json.gz``. Memory goes to ``<run>/memory/rank<R>.pickle``:

- CUDA: the allocator's own history (``_record_memory_history`` from the first profiled step,
  ``_dump_snapshot`` at the end): source ``cuda``.
- CPU: built here from the trace's ``[memory]`` events (``profile_memory=True``): source
  ``profiler_events``. torch's ``_memory_viz._profile_to_snapshot`` is not used because its
  data-flow pass (``torch.profiler._memory_profiler.DataFlowNode``) asserts that a leaf op moves a
  tensor's version by at most one; in the profiled step of a pipelined run one leaf op moves a fresh
  buffer from version 0 to 2, and it fails with "version mismatch" (measured on torch 2.13: tp=2
  alone passes, tp=2 x pp=2 fails; see docs/trace_conventions.md). Categories are kept by attributing addresses instead: the
  trainer's parameters, gradient buckets and optimizer state by storage address; other blocks
  allocated in a ``fwd`` compute span and alive after it are ``activation``, freed within the
  span they were allocated in ``temporary``, otherwise ``unknown``. The state is read when the
  recording starts and when it ends, so that the segments are the allocator's state at the end of
  the trace (as ``_dump_snapshot``'s are). The CPU profiler reports no free of a block allocated
  before it started: a state buffer of the start that is gone by the end (last step's reduced
  gradient shard) gets its free entries, with its category, where its address is next allocated,
  or else at the end of the trace. The profiler records no stack (``with_stack`` is off): each
  entry's frames are the profiler spans open around its event (reference_trainer.alloc_sites), and
  a state buffer's the trainer's name for it.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
from bisect import bisect_right
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from .alloc_sites import memory_frames, state_frames
from tracekit.conventions import parse_compute


class ProfilingError(ValueError):
    """A bad --profile-steps value or an unreadable trace."""


def parse_steps(text: str, n_steps: int) -> tuple[int, int] | None:
    """``"a-b"`` or ``"a"`` -> (a, b) clipped to the run; ``""`` -> None (no profiling)."""
    if not text:
        return None
    try:
        a, _, b = text.partition("-")
        first, last = int(a), int(b) if b else int(a)
    except ValueError:
        raise ProfilingError(f"profile_steps {text!r}: expected a-b or a") from None
    if not 0 <= first <= last or first >= n_steps:
        raise ProfilingError(f"profile_steps {text!r}: need 0 <= a <= b and a < steps ({n_steps})")
    return first, min(last, n_steps - 1)


TRACE_GZIP_LEVEL = 6


def trace_path(run: Path, rank: int) -> Path:
    return Path(run) / "traces" / f"rank{rank}.json.gz"


def memory_path(run: Path, rank: int) -> Path:
    return Path(run) / "memory" / f"rank{rank}.pickle"


def memory_source(backend: str) -> str:
    return "cuda" if backend == "nccl" else "profiler_events"


class StateBuffer(NamedTuple):
    nbytes: int
    category: str  # parameter | gradient | optimizer_state
    name: str | None = None  # the trainer's name: 'layers.0.wq.weight', 'vstage 0 grad_shard'


def state_categories(trainer) -> dict[int, StateBuffer]:
    """Storage address -> (bytes, category, name) of the trainer's persistent state."""
    out: dict[int, StateBuffer] = {}

    def add(t: torch.Tensor | None, cat: str, name: str) -> None:
        if t is not None:
            s = t.untyped_storage()
            out[s.data_ptr()] = StateBuffer(s.nbytes(), cat, name)

    for st in trainer.stages.values():
        for name, p in st.params.items():
            add(p, "parameter", name)
    for vstage, b in trainer.optimizer.buckets.items():
        for name in ("grad", "grad_shard", "reduced"):
            add(getattr(b, name, None), "gradient", f"vstage {vstage} {name}")
        for name in ("master", "exp_avg", "exp_avg_sq"):
            add(getattr(b, name, None), "optimizer_state", f"vstage {vstage} {name}")
    return out


def read_trace(path: Path) -> dict[str, Any]:
    try:
        with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ProfilingError(f"{path}: not a readable Chrome trace: {e}") from None


def snapshot_from_trace(trace: dict[str, Any], state: dict[int, StateBuffer],
                        state_before: dict[int, StateBuffer] | None = None) -> dict[str, Any]:
    """A CUDA-format snapshot (device 0 = this rank's CPU) from a trace's ``[memory]`` events.
    ``state``: the persistent state when the trace ended; ``state_before``: when it began.

    Frames (reference_trainer.alloc_sites): an entry's are the profiler spans open around its event
    (the op and the trainer's annotations); a block's are its allocation's. A state buffer allocated
    before the trace has no allocation entry: its block and its free entries (if it is freed) carry
    the trainer's name for it instead, so that every block says what it is."""
    events = trace["traceEvents"]
    # trace times are microseconds from baseTimeNanoseconds; snapshots carry epoch microseconds,
    # so that memory entries line up with the trace's steps and spans once ingested
    base_us = (trace.get("baseTimeNanoseconds") or 0) // 1000
    fwd = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("ph") == "X" and (a := _compute(e)) is not None and a.phase == "fwd")
    fwd_starts = [lo for lo, _ in fwd]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Bytes")),
                 key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    frames_of = memory_frames(events, mem)

    def span_of(ts: float) -> tuple[float, float] | None:
        i = bisect_right(fwd_starts, ts) - 1  # forward spans do not overlap: the last one opened
        return fwd[i] if i >= 0 and ts <= fwd[i][1] else None

    before = state_before or {}
    seen: set[int] = set()
    live: dict[int, dict[str, Any]] = {}
    trace_out: list[dict[str, Any]] = []

    def freed_unseen(addr: int, ts_us: int) -> None:
        # the CPU profiler reports no free of a block allocated before it started: a state buffer
        # from before the recording (last step's reduced shard) is freed where its address is
        # reused, or else by the end
        buf = before[addr]
        for action in ("free_requested", "free_completed"):
            trace_out.append({"action": action, "addr": addr, "size": buf.nbytes, "stream": 0, "time_us": ts_us,
                              "frames": state_frames(buf.category, buf.name), "category": buf.category})

    for e, frames in zip(mem, frames_of):
        addr, nbytes, ts = int(e["args"]["Addr"]), int(e["args"]["Bytes"]), float(e["ts"])
        if addr not in seen:
            seen.add(addr)
            if nbytes > 0 and addr in before:
                freed_unseen(addr, int(ts + base_us))
        if nbytes > 0:
            r = {"action": "alloc", "addr": addr, "size": nbytes, "stream": 0, "time_us": int(ts + base_us),
                 "frames": frames, "category": "unknown", "_span": span_of(ts)}
            live[addr] = r
            trace_out.append(r)
        else:
            a = live.pop(addr, None)
            size = a["size"] if a else -nbytes
            cat = {}
            if a is None and addr in before:  # no allocation entry says what it is: its name does
                buf = before[addr]
                cat, frames = {"category": buf.category}, state_frames(buf.category, buf.name)
            for action in ("free_requested", "free_completed"):
                trace_out.append({"action": action, "addr": addr, "size": size, "stream": 0,
                                  "time_us": int(ts + base_us), "frames": frames, **cat})
            if a is not None and a["_span"] is not None:
                a["category"] = "temporary" if ts <= a["_span"][1] else "activation"
    end_us = trace_out[-1]["time_us"] if trace_out else int(base_us)
    for addr in before:
        if addr not in seen and addr not in state:
            freed_unseen(addr, end_us)
    for addr, r in live.items():  # still allocated at the end: a state buffer by its address
        if addr in state:
            r["category"] = state[addr].category
        elif r["_span"] is not None:
            r["category"] = "activation"
    for r in trace_out:
        r.pop("_span", None)
    blocks = {addr: (buf.nbytes, buf.category, state_frames(buf.category, buf.name)) for addr, buf in state.items()}
    blocks.update({addr: (r["size"], r["category"], r["frames"]) for addr, r in live.items()})
    segments = [{"device": 0, "address": addr, "total_size": size, "allocated_size": size,
                 "active_size": size, "requested_size": size, "stream": 0, "segment_type": "large",
                 "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames,
                 "blocks": [{"address": addr, "size": size, "requested_size": size,
                             "state": "active_allocated", "frames": frames, "category": cat}]}
                for addr, (size, cat, frames) in sorted(blocks.items())]
    # the trace first: pickle memoizes the entries' keys ('action', 'addr' ...) where first seen,
    # and after the segments' frames they would take 5-byte references instead of 2 (+40% in size)
    return {"device_traces": [trace_out], "segments": segments,
            "allocator_settings": {"source": "profiler_events"}}


def _compute(e: dict[str, Any]):
    name = e.get("name", "")
    return parse_compute(name) if name.startswith("tk.compute ") else None


class RankProfiler:
    """Profiles steps ``window`` of one rank; ``step()`` after every training step."""

    def __init__(self, rank: int, run: Path, window: tuple[int, int], backend: str, trainer, memory: bool = True,
                 stack: bool = False):
        self.rank, self.run, self.window, self.trainer = rank, Path(run), window, trainer
        self.cuda = backend == "nccl" and torch.cuda.is_available()
        self.memory = memory
        if not self.cuda:
            # Kineto prints "USDT: ... profiler_start/profiler_stop" on stderr for every rank. Its
            # levels are VERBOSE 0 .. ERROR 4, USDT 5, so only 6 hides them, and Kineto's errors with
            # them: done for CPU-only profiling (no CUPTI, whose errors matter), and never over a
            # level the user chose. Read once, at the process's first profiler start.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        first, last = window
        self._recording = False
        self.prof = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []),
            schedule=schedule(skip_first=max(first - 1, 0), wait=0, warmup=1 if first > 0 else 0,
                              active=last - first + 1, repeat=1),
            profile_memory=memory, record_shapes=False, with_stack=stack,
            on_trace_ready=self._export)
        self.exported: Path | None = None
        self.state_before: dict[int, tuple[int, str]] | None = None
        self.state_after: dict[int, tuple[int, str]] | None = None

    def start(self) -> None:
        self.prof.start()
        self._maybe_record_cuda(self.trainer.step_index)

    def step(self) -> None:
        self.prof.step()
        self._maybe_record_cuda(self.trainer.step_index)

    def _maybe_record_cuda(self, step: int) -> None:
        if step == self.window[0] and self.state_before is None:
            self.state_before = state_categories(self.trainer)
        if self.cuda and self.memory and step == self.window[0] and not self._recording:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self._recording = True

    def _export(self, prof) -> None:
        self.state_after = state_categories(self.trainer)  # the recording ends here
        path = trace_path(self.run, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        # torch gzips a .gz export line by line at level 9: 3.2 CPU-s for a 17.6 MB trace, a third
        # of a 4-rank test run's CPU on 2 cores. Exported plain and gzipped whole at zlib's default
        # level: 0.1 s, a 10% larger file
        plain = path.with_name(f".{path.name}.{os.getpid()}.json")
        try:
            prof.export_chrome_trace(str(plain))
            with open(plain, "rb") as fin, gzip.open(path, "wb", compresslevel=TRACE_GZIP_LEVEL) as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        finally:
            plain.unlink(missing_ok=True)
        self.exported = path

    def finish(self) -> dict[str, Any]:
        """Stop, and write the memory snapshot. Returns {"trace": path, "memory": path, "source"}."""
        self.prof.stop()
        if not self.memory:
            return {"trace": self.exported, "memory": None, "source": "none"}
        mpath = memory_path(self.run, self.rank)
        mpath.parent.mkdir(parents=True, exist_ok=True)
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(mpath))
            torch.cuda.memory._record_memory_history(enabled=None)
            source = "cuda"
        elif self.exported is not None:
            snap = snapshot_from_trace(read_trace(self.exported), self.state_after or state_categories(self.trainer),
                                       self.state_before)
            with open(mpath, "wb") as f:
                pickle.dump(snap, f)
            source = "profiler_events"
        else:
            source = "none"
        return {"trace": self.exported, "memory": mpath if source != "none" else None, "source": source}
