"""One run's memory tables from a store, as polars DataFrames: what ``tracekit memory`` and the
memory analysis (tracekit.analysis.memory) work from."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import polars.selectors  # noqa: F401 - pl.selectors

from tracekit.analysis.memory import MemoryDataError
from tracekit.topology import Layout

TABLES = ("memory_events", "memory_segments", "memory_blocks", "steps")


def load_tables(store: Path, run_id: str | None
                ) -> tuple[str, dict[str, pl.DataFrame], Layout | None, dict | None]:
    """The run's memory tables from a DuckDB store (read-only) or a Parquet dataset store, its layout
    when recorded, and its trainer manifest when it has one."""
    import duckdb

    from tracekit.dataset import DatasetError, is_dataset
    from tracekit.dataset import connect as connect_dataset

    if is_dataset(store):  # a Parquet dataset: the same tables, as views over its files
        try:
            con = connect_dataset(store)
        except DatasetError as e:
            raise MemoryDataError(str(e)) from None
    elif not store.is_file():
        raise MemoryDataError(f"{store}: no such store file")
    else:
        try:
            con = duckdb.connect(str(store), read_only=True)
        except duckdb.Error as e:
            raise MemoryDataError(f"{store}: not a DuckDB store ({e})") from None
    try:
        have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "memory_events" not in have:
            raise MemoryDataError(f"{store}: has no memory_events table (ingest a memory snapshot first)")
        runs = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM memory_events ORDER BY 1").fetchall()]
        if run_id is None:
            if len(runs) != 1:
                raise MemoryDataError(f"{store}: memory events of {len(runs)} runs {runs}; pick one with --run-id")
            run_id = runs[0]
        elif run_id not in runs:
            raise MemoryDataError(f"{store}: no memory events for run {run_id!r}; runs: {runs}")
        tables = {t: _read(con, t, run_id, categories=t == "memory_events") for t in TABLES if t in have}
        if "events" in have:  # only the spans that carry a phase (the trainer's tk.compute spans)
            tables["spans"] = con.sql("SELECT rank, ts_ns, dur_ns, phase, microbatch, vstage, name, run_id"
                                      " FROM events WHERE run_id = ? AND phase IS NOT NULL",
                                      params=[run_id]).pl()
        layout = manifest = None
        if "runs" in have:
            row = con.execute("SELECT tp, cp, pp, dp, manifest FROM runs WHERE run_id = ?", [run_id]).fetchone()
            if row is not None and None not in row[:4]:
                layout = Layout(*row[:4])
            if row is not None and row[4]:
                manifest = json.loads(row[4])
    finally:
        con.close()
    return run_id, tables, layout, manifest


def _read(con, table: str, run_id: str, categories: bool = False) -> pl.DataFrame:
    """One run's rows, columnar (Arrow batches, no Python row objects). With ``categories`` the
    string columns become categories: a trace repeats a few actions, categories and sites
    millions of times."""
    reader = con.sql(f"SELECT * FROM {table} WHERE run_id = ?", params=[run_id]).to_arrow_reader(1 << 20)
    cast = pl.selectors.string().cast(pl.Categorical) if categories else pl.selectors.string()
    parts = [pl.from_arrow(batch).with_columns(cast) for batch in reader]
    return pl.concat(parts) if parts else pl.from_arrow(reader.schema.empty_table()).with_columns(cast)
