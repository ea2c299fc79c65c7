"""Compute spans: every forward, backward and optimizer phase runs inside ``compute_span``.

It names the span after ``tracekit.conventions.ComputeAnnotation`` (``tk.compute phase=fwd vstage=1
mb=3``) and calls registered ``ComputeHook``s around it, so timing and fault injection (e.g. a slow
rank that stretches its compute) attach here, like comm hooks attach to the comm layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol

from torch.autograd.profiler import record_function

from tracekit.conventions import ComputeAnnotation


class ComputeHook(Protocol):
    def before(self, ann: ComputeAnnotation) -> None: ...

    def after(self, ann: ComputeAnnotation) -> None: ...


class ComputeSpans:
    def __init__(self) -> None:
        self.hooks: list[ComputeHook] = []

    def add_hook(self, hook: ComputeHook) -> None:
        self.hooks.append(hook)

    @contextmanager
    def span(self, phase: str, vstage: int | None = None, mb: int | None = None) -> Iterator[None]:
        ann = ComputeAnnotation(phase, vstage, mb)
        with record_function(ann.span_name()):
            for h in self.hooks:
                h.before(ann)
            yield
            for h in self.hooks:
                h.after(ann)
