"""The DuckDB store: one file, the tables of tracekit.schema, several runs keyed by run_id.

``tracekit.open(path)`` gives a :class:`Store`; its tables come back as polars DataFrames
(``store.table("collectives")`` or ``store.collectives``) and ``store.sql(query)`` runs any query.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from tracekit import schema

if TYPE_CHECKING:  # polars is imported by DuckDB's .pl() when a query result is asked for
    import polars as pl


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
    return con


class Store:
    """Read access to a store. Use as a context manager, or call :meth:`close`."""

    def __init__(self, path: str | Path, read_only: bool = True) -> None:
        self.path = Path(path)
        self._con = connect(self.path, read_only=read_only)
        present = {r[0] for r in self._con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()}
        missing = [t for t in schema.TABLES if t not in present]
        if missing:
            self._con.close()
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
