"""Hostile input through the real CLI: every case fails its file alone, in bounded memory, with one
clear line naming the file and the limit, exit code 2, and the store's earlier rows unchanged.

Each case runs `tracekit ingest` in a subprocess; its peak RSS (measured in the subprocess: its own
VmHWM, or its children's, the parser processes) must stay under 1 GB. The files are generated (tests/_hostile.py): the
bombs inflate to a gigabyte from about a megabyte of gzip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import tracekit
from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
import _hostile as H  # noqa: E402
from _traces import nccl_trace, write_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEAK_RSS = 1 << 30
TABLES = ("events", "collectives", "p2p", "steps", "fr_entries", "memory_events", "groups", "runs", "ranks")
# The CLI, reporting at exit its own peak RSS (VmHWM: this process since its exec) or its children's
# (the parser processes, through the zygote that waits for them), whichever is larger. (wait4's
# figure from here would include this test process's RSS at the fork.)
CLI = """import atexit, os, resource, sys
def _peak():
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(os.environ["TK_PEAK_RSS_FILE"], "w") as f:
        f.write(str(max(hwm, kids) * 1024))
atexit.register(_peak)
from tracekit.cli import main
sys.argv[0] = "tracekit"
main()
"""


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str, int]:
    """(exit code, stdout + stderr, peak RSS in bytes as the subprocess measured it) of `tracekit *args`."""
    with tempfile.NamedTemporaryFile(prefix="tk-peak-", suffix=".txt") as peak:
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "TK_PEAK_RSS_FILE": peak.name,
                    **(env or {})}
        done = subprocess.run([sys.executable, "-c", CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=full_env, cwd=ROOT, timeout=timeout)  # a hang fails the test
        measured = Path(peak.name).read_text()
    return done.returncode, done.stdout.decode(errors="replace"), int(measured) if measured else 0


def snapshot(db: Path) -> dict[str, list]:
    """Every table's rows (ingest_log: those not about a failed file), sorted."""
    with tracekit.open(db) as s:
        out = {t: sorted(map(repr, s.sql(f"SELECT * EXCLUDE (ingested_at) FROM {t}" if t == "runs"
                                          else f"SELECT * FROM {t}").rows())) for t in TABLES}
        out["ingest_log"] = sorted(map(repr, s.sql("SELECT run_id, path, format, rank, content_hash, status, rows "
                                                   "FROM ingest_log WHERE status <> 'failed'").rows()))
    return out


@pytest.fixture(scope="module")
def base_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding one good 2-rank run."""
    d = tmp_path_factory.mktemp("base")
    for r in range(2):
        write_trace(d / "good" / "traces" / f"rank{r}.json.gz", nccl_trace(r))
    db = d / "base.duckdb"
    assert not ingest([d / "good"], db).failed
    return db


@pytest.fixture(scope="module")
def base_rows(base_store: Path) -> dict[str, list]:
    return snapshot(base_store)


CASES = {  # name -> (writer, file name, the limit (or words) the error line must name)
    "header_string": (H.header_string, "rank0.json.gz", "max_header_bytes"),
    "event_string": (H.event_string, "rank0.json.gz", "max_event_bytes"),
    "whitespace_before_events": (H.whitespace_before, "rank0.json.gz", "max_header_bytes"),
    "whitespace_inside_events": (H.whitespace_inside, "rank0.json.gz", "max_inflate_ratio"),
    "ten_million_events": (H.many_events, "rank0.json.gz", "max_inflate_ratio"),
    "world_of_a_million": (H.world_of, "rank0.json", "max_world_size"),
    "negative_rank": (H.negative_rank, "rank0.json", "rank -1 is negative"),
    "shared_frames_pickle": (H.shared_frames_dump, "rank0.pickle", "max_expanded_bytes"),
    "bytearray_pickle": (H.bytearray_call, "rank0.pickle", "bytearray(int)"),
    "bytes8_pickle": (H.long_bytes, "rank0.pickle", "rank0.pickle"),
    "deep_pickle": (H.nested_lists, "rank0.pickle", "rank0.pickle"),
}


def _fails_alone(base_store: Path, base_rows: dict, tmp_path: Path, bad: Path, must_name: str,
                 env: dict[str, str] | None = None) -> int:
    db = tmp_path / "s.duckdb"
    shutil.copy(base_store, db)
    code, out, peak = run_cli("ingest", str(bad), "--store", str(db), "--run-id", "hostile", env=env)
    print(f"\n{os.environ.get('PYTEST_CURRENT_TEST', '').split('::')[-1].rsplit(' ', 1)[0]}: exit {code}, "
          f"peak RSS {peak / 1e6:.0f} MB")
    assert "Traceback" not in out, out
    failed = [line for line in out.splitlines() if line.startswith("failed:")]
    assert len(failed) == 1 and bad.name in failed[0] and must_name in failed[0], out
    assert code == 2, out
    assert 0 < peak < PEAK_RSS, f"peak RSS {peak / 1e6:.0f} MB"
    assert snapshot(db) == base_rows
    return peak


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_fails_alone_in_bounded_memory(case: str, base_store: Path, base_rows: dict,
                                                    tmp_path: Path) -> None:
    write, name, must_name = CASES[case]
    bad = write(tmp_path / name)
    assert bad.stat().st_size < 16 << 20  # small on disk
    _fails_alone(base_store, base_rows, tmp_path, bad, must_name)


KINETO_CASES = sorted(c for c, (_, name, _) in CASES.items() if ".json" in name)


@pytest.mark.parametrize("case", KINETO_CASES)
def test_duckdbs_reader_is_held_to_the_limits_too(case: str, base_store: Path, base_rows: dict,
                                                  tmp_path: Path) -> None:
    """Without the native scanner the array is copied out for DuckDB's reader: the same cases stop
    within the same bounds (a huge event may meet the gzip limit before DuckDB sees it)."""
    write, name, must_name = CASES[case]
    bad = write(tmp_path / name)
    _fails_alone(base_store, base_rows, tmp_path, bad, "over the limit" if "max_" in must_name else must_name,
                 env={"TRACEKIT_KINETO_READER": "duckdb"})


@pytest.mark.parametrize("machine", ["native", "python"])
@pytest.mark.parametrize("case,write,must_name", [
    ("call", H.streamed_call, "pickle uses STACK_GLOBAL"),
    ("bytes8", H.streamed_bytes8, "corrupt or truncated pickle"),
    # no limit stops this one: what lies outside the watched lists is kept, about 55x its bytes
    # (840 MB for 15 MB); 8 MB keeps it well under the bound (docs/ingest.md, "Limits")
    ("many_objects", lambda p: H.streamed_many_objects(p, mb=8), "not a memory snapshot")])
def test_streamed_snapshots_on_both_machines(machine: str, case: str, write, must_name: str,  # type: ignore[no-untyped-def]
                                             base_store: Path, base_rows: dict, tmp_path: Path) -> None:
    """Snapshots past 2 MiB are streamed by the pickle machine (C or Python): refused alike."""
    bad = write(tmp_path / "rank0.pickle")
    assert 2 << 20 < bad.stat().st_size < 16 << 20
    _fails_alone(base_store, base_rows, tmp_path, bad, must_name, env={"TRACEKIT_PICKLE_READER": machine})


def test_past_one_limit_the_next_holds(base_store: Path, base_rows: dict, tmp_path: Path) -> None:
    """Ten million tiny events with the gzip ratio limit raised: the event count stops them."""
    bad = H.many_events(tmp_path / "rank0.json.gz")
    _fails_alone(base_store, base_rows, tmp_path, bad, "max_events", env={"TRACEKIT_LIMIT_MAX_INFLATE_RATIO": "100000"})


def test_a_pickle_over_the_whole_load_limit_fails_alone(base_store: Path, base_rows: dict, tmp_path: Path) -> None:
    bad = H.shared_frames_dump(tmp_path / "rank0.pickle", entries=100, frames=10)
    _fails_alone(base_store, base_rows, tmp_path, bad, "max_loaded_bytes", env={"TRACEKIT_LIMIT_MAX_LOADED_BYTES": "100"})


def test_a_raised_limit_lets_the_file_in(tmp_path: Path) -> None:
    bad = H.header_string(tmp_path / "rank0.json.gz", mb=8)
    db = tmp_path / "s.duckdb"
    code, out, _ = run_cli("ingest", str(bad), "--store", str(db), env={"TRACEKIT_LIMIT_MAX_HEADER_BYTES": "4MiB"})
    assert code == 2 and "max_header_bytes = 4 MiB" in out, out
    code, out, _ = run_cli("ingest", str(bad), "--store", str(db), env={"TRACEKIT_LIMIT_MAX_HEADER_BYTES": "16MiB"})
    assert code == 0, out


def test_files_disagreeing_on_the_world_size_are_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    H.trace(run / "rank0.json", H._info(0, 2))
    H.trace(run / "rank1.json", H._info(1, 8))
    code, out, _ = run_cli("ingest", str(run), "--store", str(tmp_path / "s.duckdb"))
    assert code == 0, out
    assert "files disagree on the world size (2, 8); taken as 8" in out, out
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT count(*) FROM ingest_log WHERE status = 'warning' AND error LIKE '%disagree%'").item() == 1


@pytest.mark.parametrize("mb", [1, 2])
def test_a_store_write_out_of_memory_says_so(mb: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB's memory limit too small for a trace: at the insert (1 MB) or at the COMMIT (2 MB, where
    DuckDB reports a "TransactionContext Error"), the file's error says it ran out of memory."""
    from tracekit.ingest import pipeline

    monkeypatch.setattr(pipeline, "MEMORY_PER_WORKER_MB", mb)
    rep = ingest([ROOT / "tests" / "fixtures" / "real" / "hta" / "single_rank_nccl"], tmp_path / "s.duckdb", workers=1)
    (f,) = rep.files
    assert f.status == "failed" and "nccl_data.json.gz: out of memory while writing it to the store" in (f.error or "")


def test_the_other_files_go_on(tmp_path: Path) -> None:
    """A bomb among good files of one run: it fails alone, the good ones go in."""
    run = tmp_path / "run"
    for r in range(2):
        write_trace(run / "traces" / f"rank{r}.json.gz", nccl_trace(r, world=3))
    H.event_string(run / "traces" / "rank2.json.gz")
    db = tmp_path / "s.duckdb"
    code, out, peak = run_cli("ingest", str(run), "--store", str(db))
    assert code == 2 and peak < PEAK_RSS, out
    failed = [line for line in out.splitlines() if line.startswith("failed:")]
    assert len(failed) == 1 and "rank2.json.gz" in failed[0] and "max_event_bytes" in failed[0], out
    with tracekit.open(db) as s:
        assert s.sql("SELECT rank, status FROM ingest_log WHERE status <> 'warning' ORDER BY path").rows() == \
            [(0, "ok"), (1, "ok"), (None, "failed")]
        assert s.sql("SELECT DISTINCT rank FROM events ORDER BY rank")["rank"].to_list() == [0, 1]
