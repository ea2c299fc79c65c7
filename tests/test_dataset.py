"""The Parquet dataset store (tracekit/dataset.py): a DuckDB store exported to a dataset reads back
the same, every analysis command gives the same JSON on both, partitions prune whole files, parts
are written atomically and idempotently, and a damaged dataset is one line naming the file (exit 2).

The reference side of each comparison reads the DuckDB file with duckdb itself, or the Parquet
files with pyarrow, never through tracekit.dataset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import tracekit
from tracekit import dataset, schema
from tracekit.cli import main
from tracekit.ingest.pipeline import ingest

SAMPLE = Path(__file__).resolve().parents[1] / "sample_traces" / "slow_rank_8"
VOLATILE = {"ingested_at", "seconds"}  # when and how fast, not what


def _cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stdout, res.stderr


def duckdb_table(store: Path, table: str) -> pl.DataFrame:
    con = duckdb.connect(str(store), read_only=True)
    try:
        return pl.from_arrow(con.sql(f"SELECT * FROM {table}").to_arrow_table())
    finally:
        con.close()


def same_rows(a: pl.DataFrame, b: pl.DataFrame, table: str) -> bool:
    cols = [c for c in schema.columns(table) if c not in VOLATILE]
    key = [c for c, t in schema.TABLES[table] if c not in VOLATILE and t != "INTEGER[]"]
    a, b = a.select(cols), b.select(cols)
    return a.schema == b.schema and a.sort(key, nulls_last=True).equals(b.sort(key, nulls_last=True))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """The sample run in a DuckDB store, and that store exported to a dataset."""
    d = tmp_path_factory.mktemp("dataset")
    store = d / "slow.duckdb"
    report = ingest([SAMPLE], store, workers=2)
    assert len(report.ok) == 24 and not report.failed
    dataset.export_store(store, d / "slow_ds")
    return store, d / "slow_ds"


def test_export_round_trip_gives_every_table_back(pair) -> None:
    store, ds = pair
    assert dataset.is_dataset(ds) and not dataset.is_dataset(store)
    opened = tracekit.open(ds)
    for table in schema.TABLES:
        ref = duckdb_table(store, table)
        got = opened.table(table)
        assert got.columns == schema.columns(table)
        assert got.height == ref.height, table
        assert same_rows(ref, got, table), table
    assert opened.table("events").height > 200_000 and opened.run_ids == ["slow_rank_8"]


def test_layout_is_hive_partitioned_and_sorted(pair) -> None:
    _, ds = pair
    marker = json.loads((ds / dataset.MARKER).read_text())
    assert marker["format"] == "tracekit-parquet" and marker["version"] == 2 and marker["rank_block"] == 256
    events = list((ds / "events").rglob("*.parquet"))
    assert [p.relative_to(ds).parts[:3] for p in events] == [("events", "run_id=slow_rank_8", "rank_block=0")]
    runs = list((ds / "runs").rglob("*.parquet"))
    assert [p.relative_to(ds).parts[:2] for p in runs] == [("runs", "run_id=slow_rank_8")] and \
        runs[0].parent.name == "run_id=slow_rank_8"
    coll = pl.from_arrow(pq.read_table(next((ds / "collectives").rglob("*.parquet"))))
    assert coll.height == 4320
    assert coll.select("pg_name", "rank", "seq").equals(coll.select("pg_name", "rank", "seq").sort("pg_name", "rank", "seq"))


@pytest.mark.parametrize("command", [["stragglers"], ["report"], ["hangs"], ["steps"], ["cp-wait"], ["memory"]])
def test_every_analysis_command_gives_the_same_json(pair, command) -> None:
    store, ds = pair
    code_a, out_a, err_a = _cli(*command, str(store), "--json")
    code_b, out_b, err_b = _cli(*command, str(ds), "--json")
    assert (code_a, code_b) == (0, 0), err_a + err_b
    assert json.loads(out_a) == json.loads(out_b)
    assert len(out_a) > 200  # something was analysed
    if command == ["stragglers"]:
        assert json.loads(out_b)["stragglers"]["localization"]["culprit_rank"] == 5


def test_align_clocks_save_writes_the_runs_ranks_part(pair, tmp_path) -> None:
    store, ds = pair
    store2, ds2 = tmp_path / "s.duckdb", tmp_path / "ds"
    shutil.copy(store, store2)
    shutil.copytree(ds, ds2)
    with tracekit.Store(store2, read_only=False) as s:
        want = s.align_clocks(save=True)
    with tracekit.open(ds2) as s:
        got = s.align_clocks(save=True)
    assert got.to_dict() == want.to_dict()
    ref = duckdb_table(store2, "ranks")
    assert ref["clock_offset_ns"].null_count() == 0
    with tracekit.open(ds2) as s:  # read back from the files
        assert same_rows(ref, s.table("ranks"), "ranks")
    assert [p.name for p in (ds2 / "ranks").rglob("*.parquet")] == ["run.parquet"]


def _coll(ranks: range, run_id: str = "r") -> pl.DataFrame:
    n = len(ranks)
    return pl.DataFrame({"run_id": [run_id] * n, "rank": list(ranks), "pg_name": ["0"] * n,
                         "seq": [1] * n, "op": ["all_reduce"] * n, "start_ns": [10] * n, "end_ns": [20] * n})


def test_a_rank_block_filter_reads_only_its_files(tmp_path) -> None:
    ds = tmp_path / "ds"
    dataset.write_tables(ds, {"collectives": _coll(range(0, 600)), "runs": pl.DataFrame({"run_id": ["r"]})}, "p0")
    dataset.write_tables(ds, {"collectives": _coll(range(0, 10), "other")}, "p0")
    blocks = sorted(p.parent.name for p in (ds / "collectives" / "run_id=r").rglob("*.parquet"))
    assert blocks == ["rank_block=0", "rank_block=1", "rank_block=2"]
    con = dataset.connect(ds)
    plan = con.execute("EXPLAIN ANALYZE SELECT start_ns FROM collectives_parts WHERE rank_block = 1").fetchall()
    assert "Total Files Read: 1" in plan[0][1]
    assert con.execute("SELECT count(*), min(rank), max(rank) FROM collectives_parts WHERE rank_block = 1"
                       ).fetchall() == [(256, 256, 511)]
    plan = con.execute("EXPLAIN ANALYZE SELECT start_ns FROM collectives WHERE run_id = 'other'").fetchall()
    assert "Total Files Read: 1" in plan[0][1]  # the typed view prunes by run too (RunTables' filter)
    plan = con.execute("EXPLAIN ANALYZE SELECT start_ns FROM collectives").fetchall()
    assert "Total Files Read: 4" in plan[0][1]
    assert con.execute("SELECT count(*) FROM collectives WHERE run_id = 'other'").fetchall() == [(10,)]


def test_writing_a_part_again_replaces_it(tmp_path) -> None:
    ds = tmp_path / "ds"
    dataset.write_tables(ds, {"collectives": _coll(range(250, 300))}, "f1")
    dataset.write_tables(ds, {"collectives": _coll(range(0, 5))}, "f2")
    dataset.write_tables(ds, {"collectives": _coll(range(250, 300))}, "f1")  # again: no doubled rows
    con = dataset.connect(ds)
    assert con.execute("SELECT count(*) FROM collectives").fetchall() == [(55,)]
    dataset.write_tables(ds, {"collectives": _coll(range(0, 3))}, "f1")  # f1 moved to block 0 only
    assert con.execute("SELECT count(*) FROM collectives").fetchall() == [(8,)]
    assert not list((ds / "collectives" / "run_id=r" / "rank_block=1").glob("*.parquet"))
    dataset.write_tables(ds, {"collectives": pa.table({})}, "f1", run_id="r")  # empty: the part is gone
    assert con.execute("SELECT count(*), min(rank) FROM collectives").fetchall() == [(5, 0)]


def test_a_killed_write_leaves_no_part_visible(tmp_path, monkeypatch) -> None:
    ds = tmp_path / "ds"
    real, calls = pq.write_table, []

    def dies_on_second(table, where, **kw):
        calls.append(where)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill between two of the part's files
        return real(table, where, **kw)

    monkeypatch.setattr(pq, "write_table", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        dataset.write_tables(ds, {"collectives": _coll(range(0, 300)), "steps": _coll(range(0, 3)).select(
            "run_id", "rank")}, "f1")
    assert len(calls) == 2
    assert [p.name for p in ds.rglob("*") if p.is_file()] == [dataset.MARKER]  # no part, no temporary file


def test_bad_rows_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="no column 'bogus'"):
        dataset.write_tables(tmp_path / "ds", {"steps": pl.DataFrame({"run_id": ["r"], "rank": [0], "bogus": [1]})}, "p")
    with pytest.raises(ValueError, match="rank is NULL"):
        dataset.write_tables(tmp_path / "ds", {"steps": pl.DataFrame({"run_id": ["r"], "rank": [None]})}, "p")
    with pytest.raises(ValueError, match="part name"):
        dataset.write_tables(tmp_path / "ds", {"steps": pl.DataFrame({"run_id": ["r"], "rank": [0]})}, "../x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    with pytest.raises(dataset.DatasetError, match="not a tracekit dataset"):
        dataset.write_tables(tmp_path / "full", {"steps": pl.DataFrame({"run_id": ["r"], "rank": [0]})}, "p")


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_damaged_datasets_are_one_line_naming_the_file(pair, tmp_path) -> None:
    _, ds = pair
    corrupt_marker = tmp_path / "marker"
    shutil.copytree(ds, corrupt_marker)
    (corrupt_marker / dataset.MARKER).write_text("{not json")
    code, _, err = _cli("stragglers", str(corrupt_marker), "--json")
    assert code == 2 and str(corrupt_marker / dataset.MARKER) in _one_error_line(err)

    no_marker = tmp_path / "nomarker"
    shutil.copytree(ds, no_marker)
    (no_marker / dataset.MARKER).unlink()
    code, _, err = _cli("report", str(no_marker), "--json")
    assert code == 2 and str(no_marker / dataset.MARKER) in _one_error_line(err)
    assert not (tmp_path / "nomarker.tracekit.duckdb").exists()  # not taken for a run directory

    bad_part = tmp_path / "badpart"
    shutil.copytree(ds, bad_part)
    victim = next((bad_part / "collectives").rglob("*.parquet"))
    victim.write_bytes(b"PAR1 truncated")
    code, _, err = _cli("stragglers", str(bad_part), "--json")
    assert code == 2 and str(victim) in _one_error_line(err)

    bad_page = tmp_path / "badpage"  # footer intact (the view binds), data pages overwritten
    shutil.copytree(ds, bad_page)
    victim = next((bad_page / "events").rglob("*.parquet"))
    data = bytearray(victim.read_bytes())
    data[100:len(data) // 2] = b"\xab" * (len(data) // 2 - 100)
    victim.write_bytes(bytes(data))
    code, _, err = _cli("stragglers", str(bad_page), "--json")
    assert code == 2 and str(victim) in _one_error_line(err)

    bad_runs = tmp_path / "badruns"
    shutil.copytree(ds, bad_runs)
    victim = next((bad_runs / "runs").rglob("*.parquet"))
    victim.write_bytes(b"")
    code, _, err = _cli("hangs", str(bad_runs), "--json")
    assert code == 2 and str(victim) in _one_error_line(err)


def test_a_dataset_is_not_ingested_as_traces(pair, tmp_path) -> None:
    _, ds = pair
    code, _, err = _cli("ingest", str(ds), "--store", str(tmp_path / "x.duckdb"))
    assert code == 2 and "a tracekit Parquet dataset" in _one_error_line(err)
    code, _, err = _cli("ingest", str(SAMPLE / "fr"), "--store", str(ds))
    assert code == 2 and "a Parquet dataset, not a DuckDB store file" in _one_error_line(err)
