"""The DuckDB store: one file, the tables of tracekit.schema, several runs keyed by run_id.

``tracekit.open(path)`` gives a :class:`Store`; its tables come back as polars DataFrames
(``store.table("collectives")`` or ``store.collectives``) and ``store.sql(query)`` runs any query.
The analyses hang off it as small methods (``diagnose``, ``cp_wait``, ``steps``, ``hangs``,
``align_clocks``), each on the newest run unless given a ``run_id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from tracekit import schema

if TYPE_CHECKING:  # polars is imported by DuckDB's .pl() when a query result is asked for
    import polars as pl

    from tracekit.analysis.collectives import ClockAlignment
    from tracekit.analysis.cp_wait import CPWait
    from tracekit.analysis.hangs import HangReport
    from tracekit.analysis.diagnosis import Diagnosis
    from tracekit.analysis.steps import StepReport
    from tracekit.analysis.tables import RunTables
    from tracekit.analysis.tunables import Tunables


class StoreError(ValueError):
    """The store file is missing, locked or not a tracekit store."""


def connect(path: str | Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A connection to the store at ``path`` with every table present (created when writable)."""
    p = Path(path)
    if read_only and not p.exists():
        raise StoreError(f"{p}: no such store")
    try:
        con = duckdb.connect(str(p), read_only=read_only)
        con.execute("SET enable_progress_bar = false")  # a library does not draw on the terminal
    except duckdb.Error as e:
        raise StoreError(f"{p}: cannot open store ({str(e).splitlines()[0]})") from None
    if not read_only:
        for t in schema.TABLES:
            con.execute(schema.create_sql(t))
        # tables only ever gain columns: a store an older tracekit wrote gets the new ones (NULL in
        # its rows) before anything is written into it
        have = set(con.execute("SELECT table_name, column_name FROM information_schema.columns "
                               "WHERE table_schema = 'main'").fetchall())
        for t, cols in schema.TABLES.items():
            for name, typ in cols:
                if (t, name) not in have:
                    con.execute(f"ALTER TABLE {t} ADD COLUMN {name} {typ}")
    return con


class Store:
    """Read access to a store. Use as a context manager, or call :meth:`close`."""

    def __init__(self, path: str | Path, read_only: bool = True) -> None:
        self.path = Path(path)
        self._read_only = read_only
        self._con = connect(self.path, read_only=read_only)
        present = {r[0] for r in self._con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()}
        missing = [t for t in schema.TABLES if t not in present]
        if missing:
            self._con.close()
            if "runs" in present:  # tables are only ever added: an older version wrote this store
                raise StoreError(f"{self.path}: written by an older tracekit (no table {', '.join(missing)}); "
                                 f"ingest into it again (tracekit ingest RUN... --store {self.path}) to add them")
            raise StoreError(f"{self.path}: not a tracekit store (missing tables: {', '.join(missing)})")

    def sql(self, query: str, params: list | None = None) -> pl.DataFrame:
        """Run a query; the result as a polars DataFrame."""
        return self._con.sql(query, params=params).pl()

    def table(self, name: str, run_id: str | None = None) -> pl.DataFrame:
        """A whole table (optionally one run's rows) as a polars DataFrame."""
        if name not in schema.TABLES:
            raise KeyError(f"no table {name!r}; tables: {', '.join(schema.TABLES)}")
        if run_id is None:
            return self.sql(f"SELECT * FROM {name}")
        return self.sql(f"SELECT * FROM {name} WHERE run_id = ?", [run_id])

    def __getattr__(self, name: str) -> pl.DataFrame:
        if name in schema.TABLES:
            return self.table(name)
        raise AttributeError(name)

    @property
    def run_ids(self) -> list[str]:
        return [r[0] for r in self._con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]

    def newest_run(self) -> str:
        """The run ingested last (the default of every analysis method)."""
        rows = self._con.execute("SELECT run_id FROM runs ORDER BY ingested_at DESC NULLS LAST, run_id DESC "
                                 "LIMIT 1").fetchall()
        if not rows:
            raise StoreError(f"{self.path}: the store holds no runs")
        return rows[0][0]

    def _run(self, run_id: str | None) -> str:
        if run_id is None:
            return self.newest_run()
        if run_id not in self.run_ids:
            raise StoreError(f"{self.path}: no run {run_id!r}; runs: {', '.join(self.run_ids) or 'none'}")
        return run_id

    def run_tables(self, run_id: str | None = None) -> RunTables:
        """One run's tables, the input of every analysis."""
        from dataclasses import replace

        import polars as pl

        from tracekit.analysis.tables import RunTables

        tables = RunTables.from_duckdb(self._con, self._run(run_id))
        row = tables.runs.row(0, named=True)
        if any(row[d] is None for d in ("tp", "cp", "pp", "dp")):
            # No layout (e.g. traces without process-group metadata): compare every rank with every
            # other, as data-parallel replicas; layout_source says so in every result.
            world = row["world_size"] or tables.ranks["rank"].n_unique()
            tables = replace(tables, runs=tables.runs.with_columns(
                pl.lit(1, pl.Int32).alias("tp"), pl.lit(1, pl.Int32).alias("cp"), pl.lit(1, pl.Int32).alias("pp"),
                pl.lit(int(world), pl.Int32).alias("dp"), pl.lit("assumed-dp").alias("layout_source")))
        return tables

    def attention_work(self, run_id: str | None = None) -> pl.DataFrame | None:
        """Attention work per (rank, step) where the run's manifest records it
        (``attention_work``: {step: {rank: work}}); None when unknown."""
        from tracekit.analysis.work import work_from_manifest

        return work_from_manifest(self.run_tables(run_id).manifest)

    def diagnose(self, run_id: str | None = None, tunables: Tunables | None = None) -> Diagnosis:
        """Which rank made the run slow, and why (localization + root cause)."""
        from tracekit.analysis.diagnosis import diagnose
        from tracekit.analysis.tunables import Tunables

        tables = self.run_tables(run_id)
        return diagnose(tables, tunables or Tunables(), self.attention_work(tables.run_id), self.hangs(tables.run_id),
                        self.damaged_ranks(tables.run_id, formats=("kineto",)))

    def cp_wait(self, run_id: str | None = None, tunables: Tunables | None = None) -> CPWait:
        """Exposed CP communication split into wait and transfer, and what the waiting is due to."""
        from tracekit.analysis.cp_wait import cp_wait
        from tracekit.analysis.tunables import Tunables

        tables = self.run_tables(run_id)
        return cp_wait(tables, tunables or Tunables(), self.attention_work(tables.run_id))

    def steps(self, run_id: str | None = None, tunables: Tunables | None = None) -> StepReport:
        """Step times per rank, the slow steps and what made each slow."""
        from tracekit.analysis.steps import step_report
        from tracekit.analysis.tunables import Tunables

        return step_report(self.run_tables(run_id), tunables or Tunables())

    def hangs(self, run_id: str | None = None) -> HangReport:
        """Where the ranks stopped, from the flight-recorder entries."""
        from tracekit.analysis.hangs import diagnose_hang

        rid = self._run(run_id)
        world = self.table("runs", rid)["world_size"]
        return diagnose_hang(self.table("fr_entries", rid), self.table("groups", rid),
                             int(world[0]) if world.len() and world[0] is not None else None,
                             self.damaged_ranks(rid, formats=("fr",)))

    def damaged_ranks(self, run_id: str | None = None, formats: tuple[str, ...] | None = None) -> dict[int, str]:
        """{rank: why} for the ranks an analysis cannot judge: a file failed to ingest, or no data of a
        format the other ranks have (tracekit.analysis.damaged; ``formats`` default kineto, fr, memory)."""
        from tracekit.analysis.damaged import damaged_ranks

        rid = self._run(run_id)
        world = self.sql("SELECT world_size FROM runs WHERE run_id = ?", [rid])
        return damaged_ranks(self.table("ingest_log", rid), world["world_size"][0] if world.height else None,
                             formats)

    def align_clocks(self, run_id: str | None = None, save: bool = True) -> ClockAlignment:
        """Estimate one clock offset per host from the collectives; with ``save`` store them in
        ``ranks.clock_offset_ns`` (later analyses of the run use them)."""
        from tracekit.analysis.collectives import align_clocks, with_clock_offsets

        tables = self.run_tables(run_id)
        alignment = align_clocks(tables)
        if save:
            ranks = with_clock_offsets(tables, alignment).select("rank", "clock_offset_ns")
            self._write(lambda con: con.executemany(
                "UPDATE ranks SET clock_offset_ns = ? WHERE run_id = ? AND rank = ?",
                [(o, tables.run_id, r) for r, o in ranks.iter_rows()]))
        return alignment

    def _write(self, fn) -> None:
        """Run ``fn(con)`` on a writable connection (a read-only store reopens around it)."""
        if not self._read_only:
            fn(self._con)
            return
        self._con.close()
        try:
            con = connect(self.path)
            try:
                fn(con)
            finally:
                con.close()
        finally:
            self._con = connect(self.path, read_only=True)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, runs={self.run_ids})"


def open(path: str | Path) -> Store:  # noqa: A001 - the public name is tracekit.open
    """Open an existing store for reading."""
    return Store(path, read_only=True)
