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
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from tracekit import schema

if TYPE_CHECKING:  # polars is imported by DuckDB's .pl() when a query result is asked for
    import polars as pl

    from tracekit.analysis.collectives import ClockAlignment
    from tracekit.analysis.cp_wait import CPWait
    from tracekit.analysis.hangs import HangReport
    from tracekit.analysis.diagnosis import Diagnosis
    from tracekit.analysis.scope import Scope
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
    if p.is_dir():
        from tracekit.dataset import is_dataset, looks_like_dataset

        if is_dataset(p) or looks_like_dataset(p):
            raise StoreError(f"{p}: a Parquet dataset, not a DuckDB store file (write to it with "
                             "tracekit ingest ... --out DIR)")
        raise StoreError(f"{p}: a directory, not a store file")
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
    """Read access to a store: a DuckDB file, or a Parquet dataset directory (tracekit.dataset),
    read through views of the same tables. Use as a context manager, or call :meth:`close`."""

    def __init__(self, path: str | Path, read_only: bool = True) -> None:
        from tracekit import dataset

        self.path = Path(path)
        self._read_only = read_only
        self.is_dataset = dataset.is_dataset(self.path) or dataset.looks_like_dataset(self.path)
        self._scopes: dict = {}  # the scope of a large job's analyses, per run (scope())
        if self.is_dataset:
            self._con = dataset.connect(self.path)  # DatasetError (a StoreError) names the bad file
            return
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
        if not self.is_dataset:
            return self._con.sql(query, params=params).pl()
        try:
            return self._con.sql(query, params=params).pl()
        except (duckdb.IOException, duckdb.InvalidInputException) as e:  # a damaged part file
            raise self._damaged(e) from None

    def _damaged(self, e: Exception, tables: tuple[str, ...] = ()) -> StoreError:
        """The error for a dataset whose scan failed, naming the damaged file (DuckDB does not
        always, e.g. for a damaged data page)."""
        import re

        from tracekit.dataset import find_damaged

        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        bad = find_damaged(self.path, tables or tuple(re.findall(r"table '(\w+)'", first)))
        if bad is None:
            return StoreError(f"{self.path}: {first}")
        return StoreError(f"{bad[0]}: damaged Parquet file ({bad[1]})")

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
        return [r[0] for r in self._fetch("SELECT run_id FROM runs ORDER BY run_id")]

    def _fetch(self, query: str) -> list[tuple]:
        """Rows of a query; a dataset's damaged file is a StoreError naming it (DuckDB's first line)."""
        try:
            return self._con.execute(query).fetchall()
        except duckdb.Error as e:
            if not self.is_dataset:
                raise
            raise self._damaged(e, ("runs",)) from None

    def newest_run(self) -> str:
        """The run ingested last (the default of every analysis method)."""
        rows = self._fetch("SELECT run_id FROM runs ORDER BY ingested_at DESC NULLS LAST, run_id DESC LIMIT 1")
        if not rows:
            raise StoreError(f"{self.path}: the store holds no runs")
        return rows[0][0]

    def _run(self, run_id: str | None) -> str:
        if run_id is None:
            return self.newest_run()
        if run_id not in self.run_ids:
            raise StoreError(f"{self.path}: no run {run_id!r}; runs: {', '.join(self.run_ids) or 'none'}")
        return run_id

    def check(self, run_id: str | None = None) -> str:
        """The run id (newest by default), after checking that the run exists and that every table the
        analyses read has the schema's columns: a bad store fails here, with its name, not halfway
        through an analysis. Reads no rows."""
        from tracekit.analysis.tables import TABLE_NAMES, TablesError

        rid = self._run(run_id)
        for t in TABLE_NAMES:
            try:
                have = set(self._con.sql(f"SELECT * FROM {t} LIMIT 0").columns)
            except duckdb.Error as e:
                if self.is_dataset:
                    raise self._damaged(e, (t,)) from None
                raise TablesError(f"cannot read table {t!r} from the store: {str(e).splitlines()[0]}") from None
            lacking = [c for c in schema.columns(t) if c not in have]
            if lacking:
                raise TablesError(f"table {t!r} lacks columns {lacking}")
        return rid

    def run_tables(self, run_id: str | None = None, ranks: list[tuple[int, int]] | None = None) -> RunTables:
        """One run's tables, the input of every analysis (with ``ranks``, inclusive rank ranges, only
        those ranks' rows of the per-rank tables)."""
        from dataclasses import replace

        import polars as pl

        from tracekit.analysis.tables import RunTables

        try:
            tables = RunTables.from_duckdb(self._con, self._run(run_id), ranks)
        except ValueError as e:  # TablesError: on a dataset, a part file that cannot be read
            if not self.is_dataset or "cannot read table" not in str(e):
                raise
            raise self._damaged(e) from None
        row = tables.runs.row(0, named=True)
        if any(row[d] is None for d in ("tp", "cp", "pp", "dp")):
            # No layout (e.g. traces without process-group metadata): every rank in one dimension,
            # as layout_source says in every result (layout_infer.ASSUMED_LAYOUTS)
            world = int(row["world_size"] or tables.ranks["rank"].n_unique())
            source = self.layout_source(run_id)
            dim = {"assumed-pp": "pp", "assumed-dp": "dp"}[source]
            tables = replace(tables, runs=tables.runs.with_columns(
                *(pl.lit(world if d == dim else 1, pl.Int32).alias(d) for d in ("tp", "cp", "pp", "dp")),
                pl.lit(source).alias("layout_source")),
                # ... whose group is then the one that holds every rank (a pure DP job on gloo's
                # 'undefined' group read "no collectives across ranks: nothing to compare")
                groups=tables.groups.with_columns(pl.when(pl.col("dim") == "world").then(pl.lit(dim))
                                                  .otherwise(pl.col("dim")).alias("dim")))
        return tables

    def layout_source(self, run_id: str | None = None) -> str:
        """How the run's layout was found (``runs.layout_source``); where none was, the one assumed
        (``layout_infer.assumed_layout``)."""
        rid = self._run(run_id)
        row = self.sql("SELECT layout_source, tp, cp, pp, dp, world_size FROM runs WHERE run_id = ?", [rid]).row(
            0, named=True)
        if all(row[d] is not None for d in ("tp", "cp", "pp", "dp")):
            return row["layout_source"]
        from tracekit.layout_infer import assumed_layout

        pairs = self.sql("SELECT DISTINCT rank, peer FROM p2p WHERE run_id = ? AND peer IS NOT NULL", [rid]).rows()
        return assumed_layout(int(row["world_size"] or 0), pairs)

    def attention_work(self, run_id: str | None = None) -> pl.DataFrame | None:
        """Attention work per (rank, step) where the run's manifest records it
        (``attention_work``: {step: {rank: work}}); None when unknown."""
        import json

        from tracekit.analysis.work import work_from_manifest

        rows = self._con.execute("SELECT manifest FROM runs WHERE run_id = ?", [self._run(run_id)]).fetchall()
        return work_from_manifest(json.loads(rows[0][0]) if rows and rows[0][0] else {})

    def scope(self, run_id: str | None = None, tunables: Tunables | None = None) -> Scope | None:
        """For a job of at least ``scope_above_ranks`` ranks with a layout, the ranks the analyses
        read, chosen top-down from aggregates (tracekit.analysis.scope); None for smaller jobs."""
        from tracekit.analysis.tunables import Tunables

        tun = tunables or Tunables()
        rid = self._run(run_id)
        key = (rid, tun)
        if key not in self._scopes:
            row = self.sql("SELECT world_size, tp, cp, pp, dp FROM runs WHERE run_id = ?", [rid]).row(0, named=True)
            scope = None
            if (row["world_size"] or 0) >= tun.scope_above_ranks and all(row[d] for d in ("tp", "cp", "pp", "dp")):
                from tracekit.analysis.scope import narrow
                from tracekit.topology import Layout, order_from_coords

                sizes = {d: int(row[d]) for d in ("tp", "cp", "pp", "dp")}
                known = self.sql("SELECT rank, dp, pp, cp, tp FROM ranks WHERE run_id = ? AND dp IS NOT NULL "
                                 "ORDER BY rank LIMIT 4096", [rid]).rows()
                lay = Layout(**sizes, order=order_from_coords(sizes, known))
                scope = narrow(self._con, rid, lay, tun)
            self._scopes[key] = scope
        return self._scopes[key]

    def _scoped_tables(self, run_id: str | None, tun: Tunables | None) -> tuple[RunTables, Scope | None]:
        scope = self.scope(run_id, tun)
        return self.run_tables(run_id, scope.ranges() if scope else None), scope

    def diagnose(self, run_id: str | None = None, tunables: Tunables | None = None) -> Diagnosis:
        """Which rank made the run slow, and why (localization + root cause)."""
        from tracekit.analysis.diagnosis import diagnose
        from tracekit.analysis.tunables import Tunables

        tun = tunables or Tunables()
        rid = self._run(run_id)
        tables, scope = self._scoped_tables(rid, tun)
        damaged = self.damaged_ranks(rid, formats=("kineto",))
        return diagnose(tables, tun, self.attention_work(rid), self.hangs(rid, tun), damaged, scope,
                        self._recorder(rid, damaged, tables, tun))

    def _recorder(self, rid: str, damaged: dict[int, str], tables: RunTables, tun: Tunables):
        """What the flight recorder says of the ranks without a profiler trace (None: every rank has
        one): their groups' timed collectives, every member's, read for those groups alone."""
        if not damaged:
            return None
        from tracekit.analysis.localize import step_time_ns
        from tracekit.analysis.unprofiled import COLUMNS, ROWS_MAX, RecorderJudgement, recorder_lateness

        ranks = sorted(damaged)
        # their collective groups' entries, and the p2p entries of those groups' members
        groups = ("SELECT DISTINCT pg_name FROM fr_entries WHERE run_id = $r AND NOT coalesce(is_p2p, false) "
                  "AND list_contains($ranks, rank)")
        members = f"SELECT DISTINCT rank FROM fr_entries WHERE run_id = $r AND pg_name IN ({groups})"
        where = (f"FROM fr_entries WHERE run_id = $r AND (NOT coalesce(is_p2p, false) AND pg_name IN ({groups}) "
                 f"OR coalesce(is_p2p, false) AND rank IN ({members}))")
        params = {"r": rid, "ranks": ranks}
        rows = int(self.sql(f"SELECT count(*) AS n {where}", params)["n"][0])
        if rows > ROWS_MAX:
            return RecorderJudgement(unjudged=tuple(ranks), why_unjudged=(
                f"their groups' flight-recorder entries ({rows:,}) are more than the {ROWS_MAX:,} read at most"))
        return recorder_lateness(self.sql(f"SELECT {', '.join(COLUMNS)} {where}", params), ranks,
                                 step_time_ns(tables), tun)

    def cp_wait(self, run_id: str | None = None, tunables: Tunables | None = None) -> CPWait:
        """Exposed CP communication split into wait and transfer, and what the waiting is due to."""
        from tracekit.analysis.cp_wait import cp_wait
        from tracekit.analysis.tunables import Tunables

        tables, _ = self._scoped_tables(run_id, tunables)
        return cp_wait(tables, tunables or Tunables(), self.attention_work(tables.run_id))

    def steps(self, run_id: str | None = None, tunables: Tunables | None = None) -> StepReport:
        """Step times per rank, the slow steps and what made each slow."""
        from tracekit.analysis.steps import step_report
        from tracekit.analysis.tunables import Tunables

        tables, _ = self._scoped_tables(run_id, tunables)
        return step_report(tables, tunables or Tunables())

    def hangs(self, run_id: str | None = None, tunables: Tunables | None = None) -> HangReport:
        """Where the ranks stopped, from the flight-recorder entries."""
        from tracekit.analysis.hangs import diagnose_hang

        from tracekit.analysis.tunables import Tunables

        rid = self._run(run_id)
        world = self.table("runs", rid)["world_size"]
        size = int(world[0]) if world.len() and world[0] is not None else None
        if (size or 0) >= (tunables or Tunables()).scope_above_ranks:
            # a large job: only the groups where some entry never completed can hold the stuck
            # collective, and a clean run has none (the rest is a million completed entries)
            fr = self.sql("SELECT * FROM fr_entries WHERE run_id = $r AND pg_name IN (SELECT DISTINCT pg_name "
                          "FROM fr_entries WHERE run_id = $r AND coalesce(state, '') <> 'completed')", {"r": rid})
            names = fr["pg_name"].unique().to_list()
            groups = self.sql("SELECT * FROM groups WHERE run_id = $r AND list_contains($n, pg_name)",
                              {"r": rid, "n": names})
        else:
            fr, groups = self.table("fr_entries", rid), self.table("groups", rid)
        return diagnose_hang(fr, groups, size, self.damaged_ranks(rid, formats=("fr",)))

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

    def _write(self, fn, tables: tuple[str, ...] = ("ranks",)) -> None:
        """Run ``fn(con)`` on a writable connection (a read-only store reopens around it). On a
        dataset, ``fn`` runs on in-memory copies of ``tables`` (those it changes), and each run's
        rows of them are then written back as that table's only part of the run."""
        if self.is_dataset:
            self._write_dataset(fn, tables)
            return
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

    def _write_dataset(self, fn, tables: tuple[str, ...]) -> None:
        from tracekit import dataset

        scratch = duckdb.connect(":memory:")
        try:
            for t in tables:
                scratch.execute(schema.create_sql(t))
                scratch.register("_tk_rows", self._con.sql(f"SELECT * FROM {t}").to_arrow_table())
                scratch.execute(f"INSERT INTO {t} SELECT * FROM _tk_rows")
                scratch.unregister("_tk_rows")
            fn(scratch)
            for t in tables:
                rows = scratch.sql(f"SELECT * FROM {t}").to_arrow_table()
                for rid in sorted(set(rows.column("run_id").to_pylist())):
                    dataset.replace_run_table(self.path, t, rid, rows.filter(pa.compute.equal(rows["run_id"], rid)))
        except OSError as e:
            raise StoreError(f"{self.path}: cannot write ({e.strerror or e})") from None
        finally:
            scratch.close()

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, runs={self.run_ids})"


def open(path: str | Path) -> Store:  # noqa: A001 - the public name is tracekit.open
    """Open an existing store (a DuckDB file or a Parquet dataset directory) for reading."""
    return Store(path, read_only=True)
