"""Crash consistency: `tracekit ingest` killed with SIGKILL before, during and after its commits and
in the run's topology, then run again, gives the store a clean one-shot ingest gives, table by
table (topology included: ranks.pid, group descriptions); a killed ingest's spool folder is
cleaned at the next start.

The kill points are the ingest's own (TRACEKIT_TEST_CRASH_AT, tracekit.ingest.common.crash_point),
so that each test kills at the same place every time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tracekit
from tracekit import schema

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_traces" / "slow_rank_8"  # traces, flight recorder and snapshots, with a manifest
CLI = "import sys; from tracekit.cli import main; sys.argv[0] = 'tracekit'; main()"
VOLATILE = {"ingested_at", "seconds"}


def ingest_cli(store: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, "ingest", str(SAMPLE), "--store", str(store), "--workers", "2",
                           *extra], env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=600)


def tables(store: Path) -> dict[str, list]:
    """Every table's rows, sorted, without times; ingest_log without the re-run's 'skipped' rows."""
    out = {}
    with tracekit.open(store) as s:
        for t in schema.TABLES:
            cols = [c for c in schema.columns(t) if c not in VOLATILE]
            where = " WHERE status <> 'skipped'" if t == "ingest_log" else ""
            out[t] = sorted(map(repr, s.sql(f"SELECT {', '.join(cols)} FROM {t}{where}").rows()))
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    store = tmp_path_factory.mktemp("clean") / "s.duckdb"
    done = ingest_cli(store)
    assert done.returncode == 0, done.stdout + done.stderr
    got = tables(store)
    assert got["ranks"] and all("None" not in r.split(", ")[7] for r in got["ranks"]), got["ranks"]  # pids known
    return got


@pytest.mark.parametrize("point", ["start", "commit:1", "committed:1", "commit:2", "committed:2", "finalize"])
def test_a_rerun_after_a_kill_gives_the_clean_store(point: str, clean: dict, tmp_path: Path) -> None:
    store = tmp_path / "s.duckdb"
    killed = ingest_cli(store, env={"TRACEKIT_TEST_CRASH_AT": point})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr  # the point was reached
    again = ingest_cli(store)
    assert again.returncode == 0, again.stdout + again.stderr
    got = tables(store)
    for t in schema.TABLES:
        assert got[t] == clean[t], t


def test_a_killed_ingests_spool_is_cleaned_at_the_next_start(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    killed = ingest_cli(tmp_path / "s.duckdb", "--processes", env={**env, "TRACEKIT_TEST_CRASH_AT": "committed:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    left = [p.name for p in tmp.iterdir() if p.name.startswith("tk-ingest-")]
    assert left  # else this test says nothing
    again = ingest_cli(tmp_path / "s.duckdb", "--processes", env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not [p for p in tmp.iterdir() if p.name.startswith("tk-ingest-")]
