"""`tracekit ingest --out DIR [--engine ray]` (tracekit/ingest/to_dataset.py): the same rows as the
local ingest into DuckDB, table by table; a broken file recorded with its reason while the others
go in; a re-run skips what is done; a file whose task died before its done record is redone without
doubling its rows; and without Ray, --engine ray is one line that says how to install it.

The reference is the DuckDB store of the local ingest, read with duckdb itself."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import duckdb
import polars as pl
import pytest
from click.testing import CliRunner

from tracekit import schema
from tracekit.cli import main
from tracekit.ingest import to_dataset
from tracekit.ingest.pipeline import ingest

SAMPLE = Path(__file__).resolve().parents[1] / "sample_traces" / "slow_rank_8"
VOLATILE = {"ingested_at", "seconds"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Four ranks of the sample (traces, flight-recorder dumps, its manifest), the same content
    again under a second path, and a trace that is not gzip at all."""
    d = tmp_path_factory.mktemp("ingest") / "run4"
    for sub in ("traces", "fr"):
        (d / sub).mkdir(parents=True)
        for r in range(4):
            src = next((SAMPLE / sub).glob(f"rank{r}*"))
            shutil.copy(src, d / sub / src.name)
    shutil.copy(SAMPLE / "manifest.json", d / "manifest.json")
    (d / "traces_copy").mkdir()
    shutil.copy(d / "traces" / "rank0.json.gz", d / "traces_copy" / "rank0.json.gz")
    (d / "traces" / "rank9.json.gz").write_bytes(b"\x1f\x8b\x08\x00 this is not deflate data")
    return d


@pytest.fixture(scope="module")
def reference(run_dir, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("ref") / "ref.duckdb"
    report = ingest([run_dir], store, workers=2)
    assert len(report.ok) == 8 and len(report.failed) == 1 and len(report.skipped) == 1
    return store


def tables_of(con: duckdb.DuckDBPyConnection) -> dict[str, pl.DataFrame]:
    out = {}
    for t in schema.TABLES:
        cols = [c for c in schema.columns(t) if c not in VOLATILE]
        key = [c for c, ty in schema.TABLES[t] if c not in VOLATILE and ty != "INTEGER[]"]
        df = pl.from_arrow(con.sql(f"SELECT {', '.join(cols)} FROM {t}").to_arrow_table())
        out[t] = df.sort(key, nulls_last=True)
    return out


def assert_same_tables(store: Path, ds: Path) -> None:
    ref = duckdb.connect(str(store), read_only=True)
    try:
        want = tables_of(ref)
    finally:
        ref.close()
    from tracekit.dataset import connect

    got = tables_of(connect(ds))
    for t in schema.TABLES:
        assert got[t].schema == want[t].schema, t
        assert got[t].equals(want[t]), (t, got[t].height, want[t].height)
    assert want["events"].height > 100_000 and want["fr_entries"].height > 0


def test_local_engine_gives_the_local_ingests_rows(run_dir, reference, tmp_path) -> None:
    report = to_dataset.ingest([run_dir], tmp_path / "ds", workers=2)
    assert len(report.ok) == 8 and len(report.skipped) == 1
    [bad] = report.failed
    assert bad.path.name == "rank9.json.gz" and "rank9.json.gz" in (bad.error or "")
    assert_same_tables(reference, tmp_path / "ds")


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_engine_is_resumable_idempotent_and_gives_the_same_rows(run_dir, reference, tmp_path, ray_local) -> None:
    ds = tmp_path / "ds"
    report = to_dataset.ingest([run_dir], ds, engine="ray")
    assert len(report.ok) == 8 and len(report.skipped) == 1 and len(report.failed) == 1
    assert "rank9.json.gz" in (report.failed[0].error or "")
    assert_same_tables(reference, ds)

    again = to_dataset.ingest([run_dir], ds, engine="ray")  # resumed: nothing done is redone
    assert not again.ok and len(again.failed) == 1  # the broken file is tried again, and fails again
    assert {f.path.name for f in again.skipped} >= {"rank0.json.gz", "rank3.json.gz", "rank0"}
    assert_same_tables(reference, ds)

    # a task that died after writing its part but before its done record: redone, rows not doubled
    records = {p: json.loads(p.read_text()) for p in sorted((ds / to_dataset.DONE_DIR).glob("*.json"))}
    assert sorted(r["status"] for r in records.values()) == ["ok"] * 8 + ["skipped"]  # the copy: skipped
    done = [p for p, r in records.items() if r["status"] == "ok"]
    done[0].unlink()
    done[1].write_text("{damaged")
    third = to_dataset.ingest([run_dir], ds, engine="ray")
    assert len(third.ok) == 2
    assert_same_tables(reference, ds)

    # a file changed in place is ingested again and its part replaced
    trace = run_dir / "traces" / "rank1.json.gz"
    original = trace.read_bytes()
    try:
        trace.write_bytes(gzip.compress(gzip.decompress(original)))  # same events, new bytes and mtime
        fourth = to_dataset.ingest([run_dir], ds, engine="ray")
        assert [f.path.name for f in fourth.ok] == ["rank1.json.gz"]
    finally:
        trace.write_bytes(original)
    events = duckdb.connect(str(reference), read_only=True).execute("SELECT count(*) FROM events").fetchall()
    from tracekit.dataset import connect

    assert connect(ds).execute("SELECT count(*) FROM events").fetchall() == events


def test_cli_writes_a_dataset_the_analyses_read(run_dir, tmp_path) -> None:
    res = CliRunner().invoke(main, ["ingest", str(run_dir), "--out", str(tmp_path / "ds"), "--json"])
    assert res.exit_code == 2  # the broken file
    res = CliRunner().invoke(main, ["steps", str(tmp_path / "ds"), "--json"])
    assert res.exit_code == 0 and '"run_id": "run4"' in res.stdout
    assert not (tmp_path / "ds.tracekit.duckdb").exists()  # read in place, not ingested as a run dir


def test_engine_ray_without_ray_says_how_to_install(run_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    res = CliRunner().invoke(main, ["ingest", str(run_dir), "--out", str(tmp_path / "ds"), "--engine", "ray"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'tracekit[cluster]'" in lines[0]


def test_engine_ray_needs_a_dataset(run_dir, tmp_path) -> None:
    res = CliRunner().invoke(main, ["ingest", str(run_dir), "--store", str(tmp_path / "s.duckdb"), "--engine", "ray"])
    assert res.exit_code == 2 and "--out" in res.stderr


def test_ray_started_by_the_engine_runs_tasks_at_the_commands_priority(tmp_path, monkeypatch) -> None:
    """Without --address the engine starts Ray for the command alone (on_ray.ray_init_args): its
    tasks get this process's niceness, not Ray's default of 15 (under which anything else on the
    machine goes first); and the files it ingests give the local engine's rows."""
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()  # the module's own Ray (ray_local): this test starts its own
    from tracekit.ingest import on_ray

    ray.init(**on_ray.ray_init_args(None, None))
    try:
        import os

        nice = ray.get(ray.remote(lambda: os.nice(0)).remote())
        assert nice == os.nice(0)
    finally:
        ray.shutdown()
    traces = tmp_path / "traces"
    traces.mkdir()
    for r in (2, 3, 4):
        shutil.copy(next((SAMPLE / "traces").glob(f"rank{r}*")), traces)
    try:
        report = to_dataset.ingest([traces], tmp_path / "ds", engine="ray")
        assert [f.status for f in report.files] == ["ok"] * 3 and not report.warnings
    finally:
        on_ray.stop_ray()
    local = to_dataset.ingest([traces], tmp_path / "ds_local")
    assert [f.status for f in local.files] == ["ok"] * 3
    from tracekit.dataset import connect

    count = "SELECT count(*), sum(ts_ns) FROM events"
    assert connect(tmp_path / "ds").execute(count).fetchall() == connect(tmp_path / "ds_local").execute(count).fetchall()


def test_the_command_stops_the_ray_it_started_and_leaves_one_it_found(tmp_path: Path, monkeypatch) -> None:
    """`tracekit ingest --engine ray` stops the Ray it started before it returns (left to the
    interpreter's exit, Ray first sleeps 0.5 s); a Ray this process had already initialized is
    left running."""
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()  # the module's own Ray (ray_local)
    traces = tmp_path / "traces"
    traces.mkdir()
    for r in (2, 3):
        shutil.copy(next((SAMPLE / "traces").glob(f"rank{r}*")), traces)
    res = CliRunner().invoke(main, ["ingest", str(traces), "--out", str(tmp_path / "ds"), "--engine", "ray",
                                    "--json"])
    assert res.exit_code == 0, res.output
    assert not ray.is_initialized()
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        res = CliRunner().invoke(main, ["ingest", str(traces), "--out", str(tmp_path / "ds2"), "--engine", "ray",
                                        "--json"])
        assert res.exit_code == 0, res.output
        assert ray.is_initialized()
    finally:
        ray.shutdown()


def test_a_rerun_with_nothing_to_do_starts_no_ray(run_dir, tmp_path, monkeypatch) -> None:
    """Every file already done: the ray engine has no task to run and starts no Ray (5-8 s here)."""
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(next((SAMPLE / "traces").glob("rank2*")), traces)
    assert len(to_dataset.ingest([traces], tmp_path / "ds").ok) == 1
    again = to_dataset.ingest([traces], tmp_path / "ds", engine="ray")
    assert [f.status for f in again.files] == ["skipped"] and not ray.is_initialized()


def test_ray_that_cannot_start_leaves_every_file_to_the_driver(run_dir, reference, tmp_path, monkeypatch) -> None:
    """If the Ray the command starts fails to come up, this process ingests every file (the same
    rows) and the command says so in one line."""
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "a_file" / "ray"))  # Ray cannot make its folder there
    res = CliRunner().invoke(main, ["ingest", str(run_dir), "--out", str(tmp_path / "ds"), "--engine", "ray"])
    assert res.exit_code == 2, res.output  # the broken trace, as the local ingest
    notes = [line for line in res.stdout.splitlines() if "Ray did not start" in line]
    assert len(notes) == 1 and notes[0].startswith("warning: Ray did not start (") and "a_file" in notes[0]
    assert notes[0].endswith("): all files were ingested by this process")
    assert_same_tables(reference, tmp_path / "ds")
