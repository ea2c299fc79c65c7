"""Allocation sites of a CPU profiler trace's ``[memory]`` events: the spans open around each one.

The CPU profiler records every allocation and free as a ``[memory]`` instant (thread, time, address,
bytes) with no stack (the trainer profiles without ``with_stack``). What made it is known all the
same: the spans open at that instant on the same thread, the aten ops (``cpu_op``: ``aten::empty``
inside ``aten::mm`` inside ``aten::linear``) inside the trainer's annotations (``user_annotation``:
``tk.compute phase=fwd vstage=0 mb=1``, ``tk.comm ...``, ``ProfilerStep#2``). They become the
event's ``frames``, innermost first, in the shape of a CUDA snapshot's frames
(``{"filename", "line", "name"}``), with file names that say they are not source lines
(tracekit.conventions ``OP_FRAME_FILE``, ``ANNOTATION_FRAME_FILE``). A trace recorded with
``with_stack=True`` also has ``python_function`` spans; those become real source frames
(``file``, ``line``, ``function``).

Per thread, spans sorted by start (the longer first at a tie) and the thread's memory events sorted
by time are swept together with a stack of open spans: O((spans + events) log) for the sorts, where
testing every span against every event would be O(spans x events).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from tracekit.conventions import ANNOTATION_FRAME_FILE, OP_FRAME_FILE, STATE_FRAME_FILE, TRAINER_SPAN_PREFIXES

Frame = dict[str, Any]
_PY_FUNCTION = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")  # 'reference_trainer/model.py(157): _layer'
SPAN_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
_WORK_PREFIXES = ("gloo:", "nccl:")  # c10d's annotation of a collective's work, named backend:op


class _Frames:
    """One frame dict per distinct span name (and one frames list per distinct stack): a snapshot
    pickle memoizes a repeated object (so a site seen every step costs a reference), and tracekit's
    reader caches a stack by its frames' identity."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, str], Frame] = {}

    def of(self, category: str, name: str) -> Frame:
        key = (category, name)
        f = self.known.get(key)
        if f is None:
            if category == "python_function" and (m := _PY_FUNCTION.match(name)):
                f = {"filename": m["file"], "line": int(m["line"]), "name": m["func"]}
            else:
                file = {"cpu_op": OP_FRAME_FILE, "user_annotation": ANNOTATION_FRAME_FILE}.get(category, "??")
                f = {"filename": file, "line": 0, "name": name}
            self.known[key] = f
        return f


def memory_frames(events: list[dict[str, Any]], memory: list[dict[str, Any]]) -> list[list[Frame]]:
    """The frames of each of ``memory`` (``[memory]`` events of the trace ``events``), in order: the
    ``cpu_op``, ``user_annotation`` and ``python_function`` spans of the same thread whose
    [ts, ts + dur] holds the event's ts, innermost first; [] for an event outside every span."""
    spans: dict[Any, list[tuple[float, float, str, str]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in SPAN_CATEGORIES and "ts" in e:
            ts = float(e["ts"])
            spans[e.get("tid")].append((ts, ts + float(e.get("dur") or 0), e["cat"], str(e.get("name", ""))))
    by_tid: dict[Any, list[int]] = defaultdict(list)
    for i, m in enumerate(memory):
        by_tid[m.get("tid")].append(i)
    frames = _Frames()
    stacks: dict[tuple[int, ...], list[Frame]] = {}
    out: list[list[Frame]] = [[] for _ in memory]
    for tid, rows in by_tid.items():
        opened = sorted(spans.get(tid, ()), key=lambda s: (s[0], -s[1]))
        rows.sort(key=lambda i: float(memory[i]["ts"]))
        stack: list[tuple[float, Frame]] = []  # (end, frame) of the spans open, outermost first
        j = 0
        for i in rows:
            ts = float(memory[i]["ts"])
            while j < len(opened) and opened[j][0] <= ts:
                start, end, cat, name = opened[j]
                j += 1
                while stack and stack[-1][0] < start:  # closed before this one opened
                    stack.pop()
                stack.append((end, frames.of(cat, name)))
            while stack and stack[-1][0] < ts:
                stack.pop()
            chain = _callers_only(_enclosing(stack, ts))
            key = tuple(map(id, chain))  # one list per distinct stack, as for frames: a memo reference each
            out[i] = stacks.setdefault(key, chain)
    return out


def _enclosing(stack: list[tuple[float, Frame]], ts: float) -> list[Frame]:
    """The open spans that nest, innermost first: an outer span must close no earlier than the one
    inside it. Spans that only overlap (an async send's annotation, open until its work completes,
    around part of a compute span) are not one another's callers, and are left out."""
    out, inner_end = [], ts
    for end, f in reversed(stack):
        if end >= inner_end:
            out.append(f)
            inner_end = end
    return out


def _callers_only(chain: list[Frame]) -> list[Frame]:
    """Without the backend's work annotations (gloo:send, nccl:all_reduce ...) outside the trainer's
    outermost tk.* annotation: such a span lasts as long as its work, which an async op's does past
    the call that issued it, so it can enclose the compute that follows without having called it.
    (The trainer calls its tk.* spans from the step itself: only ProfilerStep#N is around them.)"""
    outer = max((i for i, f in enumerate(chain) if f["name"].startswith(TRAINER_SPAN_PREFIXES)), default=None)
    if outer is None:
        return chain
    return chain[:outer + 1] + [f for f in chain[outer + 1:] if not f["name"].startswith(_WORK_PREFIXES)]


def state_frames(category: str, name: str | None = None) -> list[Frame]:
    """The frames of one of the trainer's persistent buffers: what it is, by the trainer's name
    ('parameter layers.0.wq.weight'), or by its category alone where the name is not known."""
    return [{"filename": STATE_FRAME_FILE, "line": 0, "name": f"{category} {name}" if name else category}]
