"""The store as a Parquet dataset: a directory that DuckDB queries in place, with the store's tables.

Layout (partitioning and row order are data in tracekit/schema.py)::

    DIR/_tracekit_dataset.json                                   the marker: format, version, rank_block
    DIR/<table>/run_id=<id>/rank_block=<rank // 256>/<part>.parquet   per-rank tables (events, collectives...)
    DIR/<table>/run_id=<id>/<part>.parquet                           per-run tables (runs, groups, ...)

A *part* is one unit of writing (an ingested file, a batch of simulated ranks, an export): writing a
part again replaces it, within the runs it names. Each file is written under a temporary name and
renamed, so a killed writer leaves no half-written file where readers look. ``tracekit.open(DIR)``
(tracekit.store) reads a dataset through :func:`connect`: one view per table, so every SQL query and
analysis runs unchanged; ``<table>_parts`` views add the partition columns (``rank_block``) for
queries that want to read a rank range alone.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Mapping
from urllib.parse import quote

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracekit import schema
from tracekit.store import StoreError

if TYPE_CHECKING:
    import polars as pl

MARKER = "_tracekit_dataset.json"
# the version changes with the schema's columns (every part has exactly them): 2 added the
# allocation stacks (memory_events.frames, memory_blocks.frames)
FORMAT, VERSION = "tracekit-parquet", 2
ROW_GROUP_ROWS = 122_880  # DuckDB's row group: its scans parallelize and prune per row group
_PART_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class DatasetError(StoreError):
    """A dataset directory that cannot be read or written; the message names the file."""


def is_dataset(path: str | Path) -> bool:
    """A directory with the dataset marker (a damaged marker still says that it is one)."""
    p = Path(path)
    return p.is_dir() and (p / MARKER).exists()


def looks_like_dataset(path: str | Path) -> bool:
    """A directory laid out as a dataset (a table's ``run_id=`` folders), marker or not: opening one
    whose marker is missing then says so rather than ingesting its Parquet files as traces."""
    p = Path(path)
    return p.is_dir() and any(next((p / t).glob("run_id=*"), None) is not None for t in ("runs", "events"))


def read_marker(path: str | Path) -> dict:
    """The marker's contents, checked; DatasetError naming the marker file otherwise."""
    marker = Path(path) / MARKER
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{marker}: no such file (not a tracekit dataset)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{marker}: unreadable dataset marker ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DatasetError(f"{marker}: not a tracekit dataset marker (format is not {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise DatasetError(f"{marker}: dataset version {meta.get('version')!r}; this tracekit reads version {VERSION}")
    if meta.get("rank_block") != schema.RANK_BLOCK:
        raise DatasetError(f"{marker}: rank_block {meta.get('rank_block')!r}; this tracekit writes {schema.RANK_BLOCK}")
    return meta


def create(out_dir: str | Path) -> Path:
    """Make ``out_dir`` a dataset (a new or empty directory, or one already a dataset)."""
    d = Path(out_dir)
    if is_dataset(d):
        read_marker(d)
        return d
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise DatasetError(f"{d}: exists and is not a tracekit dataset (no {MARKER}); give a new directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
        _atomic_bytes(d / MARKER, json.dumps({
            "format": FORMAT, "version": VERSION, "rank_block": schema.RANK_BLOCK,
            "partition_by": {t: list(c) for t, c in schema.PARTITION_BY.items()},
            "sort_by": {t: list(c) for t, c in schema.SORT_BY.items()}}, indent=1).encode())
    except OSError as e:
        raise DatasetError(f"{d}: cannot create dataset ({e.strerror or e})") from None
    return d


def rank_block(rank: int) -> int:
    """The ``rank_block`` partition that holds ``rank``'s rows."""
    return rank // schema.RANK_BLOCK


def run_dir(out_dir: str | Path, table: str, run_id: str) -> Path:
    """The directory of one run's files of a table (hive encoding: DuckDB decodes %XX)."""
    return Path(out_dir) / table / f"run_id={quote(run_id, safe='')}"


def write_tables(out_dir: str | Path, tables: Mapping[str, "pl.DataFrame | pa.Table"], part: str,
                 run_id: str | None = None) -> None:
    """Write part ``part`` of each table: one file per partition its rows fall in.

    Rows carry ``run_id`` (or take ``run_id`` when they lack the column) and, for per-rank tables,
    ``rank``; other schema columns may be missing (NULL); a column not in the schema is an error.
    Writing a part again replaces it in the runs it names: files of that part left from an earlier
    write (e.g. in a rank block the new rows no longer reach) are removed, and an empty table given
    with ``run_id`` removes the run's part of that table. Creates the dataset if needed."""
    if not _PART_NAME.match(part):
        raise ValueError(f"part name {part!r}: letters, digits, '.', '_' and '-' only")
    out = create(out_dir)
    # Every file is written under a temporary name first and only then are all renamed into place,
    # so a writer killed while writing leaves none of the part visible (only the quick renames
    # stand between the first file of the part appearing and the last).
    staged: list[tuple[Path, Path]] = []
    scopes: dict[str, set[str]] = {}  # table -> the runs whose part of it this write replaces
    try:
        for table, frame in tables.items():
            data = conform(table, frame, run_id)
            scopes[table] = set(data.column("run_id").unique().to_pylist()) | ({run_id} if run_id is not None else set())
            for path, piece in _split(out, table, data, part):
                staged.append((_write_temporary(path, piece), path))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in staged:
        os.replace(tmp, path)
    # The part's earlier files that this write did not replace (a rank block the rows left) are
    # found in its list of files per run, not by listing the table's directories: at thousands of
    # parts a listing per write would cost the square of their number.
    by_run: dict[str, dict[str, list[str]]] = {}
    for table, runs in scopes.items():
        for rid in runs:
            by_run.setdefault(rid, {})[table] = []
    for _, path in staged:
        rel = path.relative_to(out)
        by_run[_run_of(rel)][rel.parts[0]].append(rel.as_posix())
    for rid, files in by_run.items():
        listed = _parts_list(out, rid, part)
        had = json.loads(listed.read_text()) if listed.exists() else {}
        for table, now in files.items():
            for gone in set(had.get(table, [])) - set(now):
                (out / gone).unlink(missing_ok=True)
            had[table] = sorted(now)
        had = {t: fs for t, fs in had.items() if fs}
        listed.parent.mkdir(parents=True, exist_ok=True)
        if had:
            _atomic_bytes(listed, json.dumps(had).encode())
        else:
            listed.unlink(missing_ok=True)


def _parts_list(out: Path, run_id: str, part: str) -> Path:
    """Where the files of one part of one run are listed (``write_tables`` keeps it)."""
    return out / "_parts" / quote(run_id, safe="") / f"{part}.json"


def _run_of(rel: Path) -> str:
    from urllib.parse import unquote

    return unquote(rel.parts[1].partition("=")[2])


def remove_part(out_dir: str | Path, part: str, run_id: str, tables: tuple[str, ...] | None = None) -> None:
    """Remove part ``part`` of run ``run_id`` from the given tables (default: every table)."""
    write_tables(out_dir, {t: pa.table({}) for t in tables or schema.TABLES}, part, run_id)


def replace_run_table(out_dir: str | Path, table: str, run_id: str, frame: "pl.DataFrame | pa.Table",
                      part: str = "run") -> None:
    """Make ``frame`` the whole of ``run_id``'s rows of ``table`` (every other part removed)."""
    write_tables(out_dir, {table: frame}, part, run_id)
    for old in run_dir(out_dir, table, run_id).glob("**/*.parquet"):
        if old.name != f"{part}.parquet":
            old.unlink(missing_ok=True)


def conform(table: str, frame: "pl.DataFrame | pa.Table", run_id: str | None = None) -> pa.Table:
    """``frame`` as an Arrow table of exactly the schema's columns and types, ``run_id`` filled in."""
    from tracekit.ingest.common import arrow_schema

    if table not in schema.TABLES:
        raise ValueError(f"no table {table!r}; tables: {', '.join(schema.TABLES)}")
    data = frame if isinstance(frame, pa.Table) else frame.to_arrow()
    unknown = [c for c in data.column_names if c not in schema.columns(table)]
    if unknown:
        raise ValueError(f"table {table!r} has no column {unknown[0]!r}")
    if "run_id" not in data.column_names:
        if run_id is None:
            raise ValueError(f"table {table!r}: rows lack run_id and none was given")
        data = data.append_column("run_id", pa.repeat(pa.scalar(run_id, pa.string()), data.num_rows))
    sch = arrow_schema(table, without=())
    cols = [data.column(f.name).cast(f.type) if f.name in data.column_names else pa.nulls(data.num_rows, f.type)
            for f in sch]
    out = pa.table(cols, schema=sch)
    if out.column("run_id").null_count:
        raise ValueError(f"table {table!r}: run_id is NULL in some rows")
    if "rank_block" in schema.PARTITION_BY[table]:
        if out.column("rank").null_count:
            raise ValueError(f"table {table!r}: rank is NULL in some rows (its files are partitioned by rank)")
        if out.num_rows and pc.min(out.column("rank")).as_py() < 0:
            raise ValueError(f"table {table!r}: negative rank")
    return out


def _split(out: Path, table: str, data: pa.Table, part: str) -> list[tuple[Path, pa.Table]]:
    """(file, rows) per partition, each in the table's SORT_BY order: one sort by the partition
    columns and then SORT_BY, cut where the partition changes."""
    if not data.num_rows:
        return []
    by_block = "rank_block" in schema.PARTITION_BY[table]
    keys = ["run_id"]
    if by_block:
        block = pc.divide(data.column("rank").cast(pa.int64()), schema.RANK_BLOCK)  # rank >= 0: floor
        data = data.append_column("_block", block)
        keys.append("_block")
    data = data.sort_by([(c, "ascending") for c in keys + list(schema.SORT_BY[table])])
    change = pc.dictionary_encode(data.column("run_id")).combine_chunks().indices.to_numpy()
    change = change[1:] != change[:-1]
    if by_block:
        blocks = data.column("_block").to_numpy()
        change |= blocks[1:] != blocks[:-1]
        data = data.drop_columns(["_block"])
    starts = [0, *(np.flatnonzero(change) + 1).tolist(), data.num_rows]
    pieces = []
    for a, b in zip(starts[:-1], starts[1:]):
        d = run_dir(out, table, data.column("run_id")[a].as_py())
        if by_block:
            d = d / f"rank_block={int(blocks[a])}"
        pieces.append((d / f"{part}.parquet", data.slice(a, b - a)))
    return pieces


def _dictionary_columns(data: pa.Table) -> list[str]:
    """Dictionary-encode the strings (kinds, names, groups repeat); trying it on times and ids costs
    write time (a fallback per page) for nothing."""
    return [f.name for f in data.schema if pa.types.is_string(f.type) or pa.types.is_boolean(f.type)]


def _write_temporary(path: Path, data: pa.Table) -> Path:
    """Write ``data`` beside ``path`` under a temporary name (never matched by readers' *.parquet)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(data, tmp, row_group_size=ROW_GROUP_ROWS, use_dictionary=_dictionary_columns(data))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def parts_source(path: str | Path, table: str) -> str | None:
    """The ``read_parquet(...)`` expression over a table's files, with the hive partition columns
    (``run_id``, ``rank_block``) that prune whole files; None when the table has no files yet."""
    d = Path(path) / table
    if next(d.glob("**/*.parquet"), None) is None:
        return None
    glob = str(d / "**" / "*.parquet").replace("'", "''")
    types = ", ".join(f"'{c}': {'VARCHAR' if c == 'run_id' else 'INTEGER'}" for c in schema.PARTITION_BY[table])
    # Not union_by_name: it reads every file's footer whenever a query is planned, so a filter on
    # rank_block would still open every file. Every part has exactly the schema's columns (conform);
    # a change of the schema's columns is a new marker version.
    return f"read_parquet('{glob}', hive_partitioning = true, hive_types = {{{types}}})"


def table_sql(path: str | Path, table: str, parts: bool = False) -> str:
    """A SELECT of a table's rows in the dataset at ``path``, with the schema's columns and types
    (and with ``parts`` the partition columns too); no files yet: no rows, the same columns."""
    cols = schema.TABLES[table]
    src = parts_source(path, table)
    extra = [c for c in schema.PARTITION_BY[table] if c != "run_id"] if parts else []
    if src is None:
        nulls = [f'CAST(NULL AS {t}) AS "{c}"' for c, t in cols] + [f"CAST(NULL AS INTEGER) AS {c}" for c in extra]
        return f"SELECT {', '.join(nulls)} WHERE false"
    typed = [f'CAST("{c}" AS {t}) AS "{c}"' for c, t in cols] + extra
    return f"SELECT {', '.join(typed)} FROM {src}"


def find_damaged(path: str | Path, tables: tuple[str, ...] = ()) -> tuple[Path, str] | None:
    """(file, why) of the first part file that cannot be read whole, looking in ``tables`` first
    and then the rest; None when all read. For an error message after DuckDB's scan failed
    without naming the file (a damaged data page): it reads every file, so only then."""
    for table in dict.fromkeys([*tables, *schema.TABLES]):
        for f in sorted((Path(path) / table).glob("**/*.parquet")):
            try:
                pq.read_table(f)
            except (OSError, pa.ArrowException) as e:
                return f, str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def connect(path: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per table over the dataset at ``path``, and
    ``<table>_parts`` with the partition columns as well (``WHERE rank_block = ...`` reads those
    files alone); an empty table is an empty view of its types."""
    read_marker(path)
    con = duckdb.connect(":memory:")
    con.execute("SET enable_progress_bar = false")
    try:  # a view is bound from its table's first file: a damaged one shows here
        for table in schema.TABLES:
            con.execute(f"CREATE VIEW {table} AS {table_sql(path, table)}")
            con.execute(f"CREATE VIEW {table}_parts AS {table_sql(path, table, parts=True)}")
    except duckdb.Error as e:
        con.close()
        raise DatasetError(f"{path}: {str(e).splitlines()[0]}") from None
    return con


def export_store(store_path: str | Path, out_dir: str | Path, part: str = "export") -> None:
    """Write every table of the DuckDB store at ``store_path`` into the dataset ``out_dir``, one
    part per table and run (an existing part ``part`` of those runs is replaced)."""
    from tracekit.store import connect as connect_store

    con = connect_store(store_path, read_only=True)
    try:
        create(out_dir)
        runs = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM runs UNION "
                                          "SELECT DISTINCT run_id FROM ingest_log ORDER BY 1").fetchall()]
        for rid in runs:
            for table in schema.TABLES:
                rows = con.sql(f"SELECT * FROM {table} WHERE run_id = $rid", params={"rid": rid}).to_arrow_table()
                write_tables(out_dir, {table: rows}, part, rid)
    finally:
        con.close()
