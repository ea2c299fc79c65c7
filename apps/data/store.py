"""The store behind the dashboard: one read-only connection, the runs, and each run's analysis.

The analyses are tracekit's own (``tracekit.store.Store.run_tables`` for the tables with its
layout fallback, ``diagnose`` and ``cp_wait`` with the manifest's attention work, as the CLI runs
them); they are computed once per run and shared by every browser session. Everything else a
view shows is queried from DuckDB when the view asks for it (apps/data/<view>.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, TypeVar

import polars as pl

from tracekit.analysis.collectives import clock_offsets, match_collectives
from tracekit.analysis.cp_wait import CPWait, cp_wait
from tracekit.analysis.diagnosis import Diagnosis
from tracekit.analysis.hangs import HangReport
from tracekit.analysis.work import work_from_manifest
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables
from tracekit.store import Store, StoreError
from tracekit.topology import Coords, Layout

T = TypeVar("T")


class DashboardData:
    """Read-only access to one store file for the dashboard's views (shared by all sessions)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._store = Store(self.path, read_only=True)  # StoreError: missing, locked, not a store
        self._lock = threading.RLock()  # one DuckDB connection, several Panel sessions
        self._memo: dict[tuple, Any] = {}
        self._recent: OrderedDict[tuple, Any] = OrderedDict()

    def sql(self, query: str, params: dict | None = None) -> pl.DataFrame:
        with self._lock:
            return self._store.sql(query, params or {})

    def memo(self, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()`` once per key (per-run results that every session reuses)."""
        with self._lock:
            if key not in self._memo:
                self._memo[key] = compute()
            return self._memo[key]

    def recent(self, key: tuple, compute: Callable[[], T], keep: int = 64) -> T:
        """``compute()`` unless one of the last ``keep`` keys asked for (answers to clicks)."""
        with self._lock:
            if key in self._recent:
                self._recent.move_to_end(key)
                return self._recent[key]
            self._recent[key] = value = compute()
            while len(self._recent) > keep:
                self._recent.popitem(last=False)
            return value

    def has_column(self, table: str, column: str) -> bool:
        """Whether the store's ``table`` has ``column`` (tables gain columns; an older store lacks them)."""
        return self.memo(("column", table, column), lambda: bool(self.sql(
            "SELECT count(*) AS n FROM information_schema.columns WHERE table_name = $t AND column_name = $c",
            {"t": table, "c": column})["n"][0]))

    # --- runs ----------------------------------------------------------------------------------
    def runs(self) -> list[str]:
        """Run ids, newest ingested first (the order ``Store.newest_run`` picks from)."""
        return self.sql("SELECT run_id FROM runs ORDER BY ingested_at DESC NULLS LAST, run_id DESC")["run_id"].to_list()

    def newest_run(self) -> str:
        with self._lock:
            return self._store.newest_run()

    def run_info(self, run_id: str) -> dict:
        """The run's ``runs`` row with its manifest parsed and the layout the analyses use."""
        def load() -> dict:
            rows = self.sql("SELECT * FROM runs WHERE run_id = $r", {"r": run_id})
            if not rows.height:
                raise StoreError(f"{self.path}: no run {run_id!r}")
            info = rows.row(0, named=True)
            try:
                info["manifest"] = json.loads(info["manifest"]) if info["manifest"] else {}
            except json.JSONDecodeError as e:
                raise StoreError(f"{self.path}: run {run_id!r} has a manifest that is not JSON ({e})") from None
            return info
        return self.memo(("info", run_id), load)

    # --- the library's analyses, once per run --------------------------------------------------
    def tables(self, run_id: str) -> RunTables:
        self.run_info(run_id)  # a clear error for an unknown run
        return self.memo(("tables", run_id), lambda: self._store.run_tables(run_id))

    def layout(self, run_id: str) -> Layout:
        return self.tables(run_id).layout

    def coords(self, run_id: str, rank: int) -> Coords:
        return self.layout(run_id).coords(rank)

    def attention_work(self, run_id: str) -> pl.DataFrame | None:
        return work_from_manifest(self.tables(run_id).manifest)

    def diagnosis(self, run_id: str) -> Diagnosis:
        # the CLI's own call (hangs included), so the page and `tracekit report` never disagree
        return self.memo(("diagnosis", run_id), lambda: self._store.diagnose(run_id))

    def hangs(self, run_id: str) -> HangReport:
        # the CLI's `tracekit hangs` (and the hang finding of `diagnose`)
        return self.memo(("hangs", run_id), lambda: self._store.hangs(run_id))

    def cp_wait(self, run_id: str) -> CPWait:
        return self.memo(("cp_wait", run_id),
                         lambda: cp_wait(self.tables(run_id), Tunables(), self.attention_work(run_id)))

    def clock_offsets(self, run_id: str) -> pl.DataFrame:
        """rank, offset_ns: the clock offsets `tracekit export perfetto` applies (the stored ones,
        else estimated from the collectives), so the views' timelines line up as Perfetto's do."""
        return self.memo(("offsets", run_id), lambda: clock_offsets(self.tables(run_id)))

    def on_common_clock(self, df: pl.DataFrame, run_id: str, *columns: str) -> pl.DataFrame:
        """``df`` (with a rank column) with its ns ``columns`` moved onto the run's common clock."""
        off = self.clock_offsets(run_id)
        out = df.with_columns(pl.col("rank").cast(pl.Int32)).join(off, on="rank", how="left")
        return out.with_columns(pl.col(c) - pl.col("offset_ns").fill_null(0) for c in columns).drop("offset_ns")

    def matched(self, run_id: str) -> pl.DataFrame:
        """Collective instances matched across ranks (``match_collectives``: one source per rank,
        stored clock offsets applied, as the diagnosis matches them: the heatmap's lateness is the
        localizer's)."""
        return self.memo(("matched", run_id), lambda: match_collectives(self.tables(run_id)))

    def perfetto_trace(self, run_id: str, ranks: list[int] | None = None, steps: list[int] | None = None) -> bytes:
        """`tracekit export perfetto` of the run (gzipped Chrome JSON), as bytes for a download."""
        import tempfile

        from tracekit.perfetto import write_chrome_trace

        with tempfile.TemporaryDirectory() as tmp, self._lock:
            out = Path(tmp) / "trace.json.gz"
            write_chrome_trace(self._store, out, run_id, ranks, steps)
            return out.read_bytes()

    def warm(self, run_id: str) -> None:
        """Compute what the first page of a run needs, before anyone asks (the server does this
        for the newest run before it listens)."""
        from apps.data.heatmap import rank_step

        self.diagnosis(run_id)
        self.clock_offsets(run_id)
        rank_step(self, run_id)

    def close(self) -> None:
        with self._lock:
            self._store.close()
