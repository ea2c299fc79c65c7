"""What every format parser returns, and the one error type for bad input."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from tracekit import schema
from tracekit.ingest import columns

# Tests only (tests/test_ingest_crash.py, test_interrupts.py): "<point>[:<n>]" sends this process
# SIGKILL (or the signal named by CRASH_SIGNAL_ENV, e.g. INT) the n-th time it passes
# crash_point(<point>), to check what a crash or a Ctrl-C there leaves behind.
CRASH_ENV = "TRACEKIT_TEST_CRASH_AT"
CRASH_SIGNAL_ENV = "TRACEKIT_TEST_CRASH_SIGNAL"
_passes: Counter = Counter()
_passes_lock = threading.Lock()


def crash_point(point: str) -> None:
    want = os.environ.get(CRASH_ENV)
    if not want or want.partition(":")[0] != point:
        return
    with _passes_lock:
        _passes[point] += 1
        if _passes[point] == int(want.partition(":")[2] or 1):
            os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get(CRASH_SIGNAL_ENV, "KILL")))


class IngestError(ValueError):
    """A file that cannot be ingested; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class RankDependent:
    """A table whose values depend on the file's rank, which is known only at commit (Kineto p2p:
    in a two-rank group the peer is the member that is not this rank)."""

    build: Callable[[int | None], pa.Table]  # the rank -> the table
    rows: int


@dataclass
class Parsed:
    """One file, parsed. Tables lack ``run_id`` (and ``rank`` unless ``multi_rank``)."""

    format: str  # kineto | fr | memory | optable
    tables: dict[str, pa.Table | RankDependent]
    rank: int | None = None  # the rank the file itself states (Kineto distributedInfo)
    world_size: int | None = None
    backend: str | None = None
    groups: list[dict] = field(default_factory=list)  # {pg_name, pg_desc, ranks}
    pids: list[int] = field(default_factory=list)  # process ids seen (matched to a manifest)
    multi_rank: bool = False  # tables already carry their rank column (op tables)

    @property
    def rows(self) -> int:
        return sum(t.rows if isinstance(t, RankDependent) else t.num_rows for t in self.tables.values())


def group_key(g: dict) -> tuple[str | None, tuple[int, ...]]:
    """A recorded process group's identity: the same name and ranks are the same group."""
    return g.get("pg_name"), tuple(int(r) for r in g["ranks"])


def arrow_schema(table: str, without: tuple[str, ...] = ("run_id", "rank")) -> pa.Schema:
    """The Arrow schema of a store table minus the columns ingest fills in afterwards."""
    return pa.schema([(n, _ARROW[t]) for n, t in schema.TABLES[table] if n not in without])


_ARROW: dict[str, pa.DataType] = {
    "VARCHAR": pa.string(),
    "INTEGER": pa.int32(),
    "BIGINT": pa.int64(),
    "DOUBLE": pa.float64(),
    "BOOLEAN": pa.bool_(),
    "JSON": pa.string(),
    "TIMESTAMP": pa.timestamp("us"),
    "INTEGER[]": pa.list_(pa.int32()),
}


def table_from_rows(table: str, rows: list[dict], without: tuple[str, ...] = ("run_id", "rank")) -> pa.Table:
    """A store table from a list of row dicts (for small formats: dumps, snapshots). Raises
    TypeError or OverflowError for a value that does not fit its column, naming the column."""
    sch = arrow_schema(table, without)
    return columns.table({f.name: columns.from_values([r.get(f.name) for r in rows], f.type, f"{table}.{f.name}")
                          for f in sch})
