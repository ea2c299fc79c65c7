"""The Python API: tracekit.open(store) -> tables as polars DataFrames and SQL."""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb
import polars as pl
import pytest

import tracekit
from tracekit import schema
from tracekit.ingest.pipeline import ingest
from tracekit.store import StoreError

sys.path.insert(0, str(Path(__file__).parent))
from _traces import nccl_trace, write_trace  # noqa: E402


@pytest.fixture
def db(tmp_path: Path) -> Path:
    for r in range(2):
        write_trace(tmp_path / "runA" / f"rank{r}.json.gz", nccl_trace(r))
    write_trace(tmp_path / "runB" / "rank0.json.gz", nccl_trace(0, world=1))
    path = tmp_path / "s.duckdb"
    assert not ingest([tmp_path / "runA", tmp_path / "runB"], path).failed
    return path


def test_open_tables_and_sql(db: Path) -> None:
    with tracekit.open(db) as s:
        assert s.run_ids == ["runA", "runB"]
        coll = s.table("collectives")
        assert isinstance(coll, pl.DataFrame) and coll.columns == schema.columns("collectives")
        assert s.collectives.height == coll.height == 6
        assert s.table("collectives", run_id="runB").height == 2
        q = s.sql("SELECT run_id, count(*) AS n FROM steps GROUP BY run_id ORDER BY run_id")
        assert q.rows() == [("runA", 4), ("runB", 2)]
        assert s.sql("SELECT count(*) FROM events WHERE run_id = ?", ["runA"]).item() == 28
        with pytest.raises(KeyError, match="no table 'nope'"):
            s.table("nope")
        with pytest.raises(AttributeError):
            s.nope  # noqa: B018


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such store"):
        tracekit.open(tmp_path / "missing.duckdb")
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).execute("CREATE TABLE t (x INT)").close()
    with pytest.raises(StoreError, match="not a tracekit store"):
        tracekit.open(other)
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="junk.duckdb"):
        tracekit.open(junk)


def test_store_from_an_older_version_names_the_fix_and_a_reingest_applies_it(db: Path, tmp_path: Path) -> None:
    duckdb.connect(str(db)).execute("DROP TABLE memory_blocks").close()  # as stores written before it existed
    with pytest.raises(StoreError, match="older tracekit.*memory_blocks.*tracekit ingest"):
        tracekit.open(db)
    assert not ingest([tmp_path / "runA"], db).failed  # a writable open adds the table; nothing is lost
    with tracekit.open(db) as s:
        assert s.run_ids == ["runA", "runB"] and s.memory_blocks.height == 0


def test_store_is_plain_duckdb(db: Path) -> None:
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM runs").fetchall() == [(2,)]
    con.close()
