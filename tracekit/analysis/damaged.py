"""Ranks an analysis cannot judge: a file of theirs failed to ingest, or they have no data of a kind
that the run's other ranks have. Such a rank is named with its reason, never blamed as late or as a
hang's culprit (the analyses exclude it; tracekit.analysis.hangs does).

From the store's ``ingest_log`` (and the run's world size): a failed file's rank is the one the log
gives, else the one its name gives (a trace cut short fails before its distributedInfo is read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import polars as pl

FORMAT_WORDS = {"kineto": "profiler trace", "fr": "flight-recorder dump", "memory": "memory snapshot",
                "optable": "op table"}
PER_RANK = ("kineto", "fr", "memory")


def damaged_ranks(ingest_log: pl.DataFrame, world_size: int | None = None,
                  formats: Iterable[str] | None = None) -> dict[int, str]:
    """{rank: why it cannot be judged} for one run's ``ingest_log`` rows, over ``formats`` (default:
    the per-rank formats: kineto, fr, memory). A rank with no data of a format is damaged only if
    other ranks of the run have that format (a run without flight recorder is not damaged)."""
    from tracekit.ingest.rundir import rank_from_name

    wanted = tuple(formats) if formats is not None else PER_RANK
    log = ingest_log.select("path", "format", "rank", "status", "error")
    have: dict[str, set[int]] = {}
    for fmt, rank in log.filter((pl.col("status") == "ok") & pl.col("rank").is_not_null()).select(
            "format", "rank").iter_rows():
        have.setdefault(fmt, set()).add(int(rank))
    out: dict[int, str] = {}
    for path, fmt, rank, error in log.filter(pl.col("status") == "failed").select(
            "path", "format", "rank", "error").iter_rows():
        if fmt is not None and fmt not in wanted:
            continue
        r = rank if rank is not None else (rank_from_name(Path(path)) if path else None)
        if r is None or (fmt is not None and r in have.get(fmt, set())):
            continue  # rank unknown, or a later version of the file went in
        if fmt is None and any(r in have.get(f, set()) for f in wanted):
            continue  # not even recognized, while the rank has data of the formats asked for
        out.setdefault(int(r), f"a file failed to ingest: {error}")
    ranks = set(range(world_size)) if world_size else set().union(*have.values()) if have else set()
    for fmt in wanted:
        if not have.get(fmt):
            continue
        for r in sorted(ranks - have[fmt]):
            out.setdefault(r, f"no {FORMAT_WORDS.get(fmt, fmt)}")
    return dict(sorted(out.items()))


def describe(damaged: dict[int, str]) -> str:
    """One line: 'rank 2: no flight-recorder dump; rank 3: a file failed to ingest: ...'."""
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(damaged.items()))
