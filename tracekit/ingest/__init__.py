"""Ingest: traces, flight-recorder dumps, memory snapshots and op tables into the DuckDB store.

One module per input format (``kineto``, ``flight_recorder``, ``memory_snapshot``, and the op-table
reader ``optable``), recognized by content (``sniff``); ``rundir`` groups files into runs,
``pipeline`` parses them in parallel and commits each one atomically, ``topo`` derives the run's
layout. Use :func:`ingest` (or ``tracekit ingest`` on the command line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracekit.ingest.pipeline import IngestReport


def ingest(*args: Any, **kwargs: Any) -> "IngestReport":
    """See :func:`tracekit.ingest.pipeline.ingest`."""
    from tracekit.ingest.pipeline import ingest as _ingest

    return _ingest(*args, **kwargs)
