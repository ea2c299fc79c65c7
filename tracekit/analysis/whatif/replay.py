"""Replay a step graph: when every node would start and end, given durations and delays.

``recorded(g)`` reads the durations and delays off the recording: a work node's duration is its
span; a join member's is its transfer (its end minus the instance's start, the last member's
arrival), so waiting for late members is not part of it; a delay is how long after its preds
ended the node began. Replaying those reproduces the recorded step times exactly wherever the
graph is right (a negative delay, a node that began before a pred ended, is clamped to zero and
counted: ``Params.violations``). Counterfactuals change ``dur`` and ``delay`` and replay again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.analysis.whatif.graph import StepGraph


@dataclass
class Params:
    dur: np.ndarray  # [node, step] ns: work span, or transfer once every member (and a sender) arrived
    delay: np.ndarray  # [node, step] ns of idle time before the node starts once its preds are done
    violations: int = 0  # recorded starts before a pred's end (clamped); 0 when the graph fits the record

    def copy(self) -> "Params":
        return Params(self.dur.copy(), self.delay.copy(), self.violations)


@dataclass
class Replay:
    start: np.ndarray  # [node, step] ns from the step's start
    end: np.ndarray  # [node, step]
    step_ns: np.ndarray  # [step]


def _ready(g: StepGraph, i: int, end: np.ndarray) -> np.ndarray:
    ps = g.preds[i]
    if not ps:
        return np.zeros(end.shape[1])
    out = end[ps[0]]
    for p in ps[1:]:
        out = np.maximum(out, end[p])
    return out


def _begin(g: StepGraph, sup: list[int], start: np.ndarray) -> np.ndarray:
    """When a super-node's transfer (or work) begins: its last member's start, or a receive's
    sender's post, whichever is later."""
    begin = start[sup[0]] if len(sup) == 1 else start[sup].max(axis=0)
    for i in sup:
        for a in g.arrive[i]:
            begin = np.maximum(begin, start[a])
    return begin


def recorded(g: StepGraph, tolerance_ns: float = 1e6) -> Params:
    """The durations and delays the recording shows (see the module docstring)."""
    delay = np.zeros_like(g.start)
    dur = np.zeros_like(g.start)
    violations = 0
    for sup in g.order:
        for i in sup:
            ready = _ready(g, i, g.end)
            d = g.start[i] - ready
            violations += int((d < -tolerance_ns).sum())
            delay[i] = np.maximum(d, 0.0)
        begin = _begin(g, sup, g.start)
        for i in sup:
            dur[i] = np.maximum(g.end[i] - begin, 0.0)
    return Params(dur, delay, violations)


def replay(g: StepGraph, p: Params) -> Replay:
    """Start and end of every node, and each step's time (the last end)."""
    start = np.zeros_like(p.dur)
    end = np.zeros_like(p.dur)
    for sup in g.order:
        for i in sup:
            start[i] = _ready(g, i, end) + p.delay[i]
        begin = _begin(g, sup, start)
        for i in sup:
            end[i] = begin + p.dur[i]
    return Replay(start, end, end.max(axis=0))
