"""Every command takes a store or a run directory alike; a run directory's store falls back to a
temporary one when it cannot be written; the dashboard finds a free port when the default is busy;
a folder with nothing to ingest is an error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_traces" / "slow_rank_8"
CLI = "import sys; from tracekit.cli import main; sys.argv[0] = 'tracekit'; main()"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def tk(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("store") / "s.duckdb"
    assert tk("ingest", str(SAMPLE), "--store", str(db)).returncode == 0
    return db


def test_memory_takes_a_run_directory_as_it_takes_its_store(store: Path, tmp_path: Path) -> None:
    from_store = tk("memory", str(store), "--json")
    from_dir = tk("memory", str(SAMPLE), "--store", str(tmp_path / "other.duckdb"), "--json")
    assert from_store.returncode == from_dir.returncode == 0, from_store.stderr + from_dir.stderr
    assert from_dir.stdout == from_store.stdout


def test_a_locked_cached_store_gives_way_to_a_temporary_one(tmp_path: Path) -> None:
    """Another process writing the store named by --store: the command reads a temporary copy and says so."""
    held = tmp_path / "held.duckdb"
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys; c = duckdb.connect(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()", str(held)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        done = tk("steps", str(SAMPLE), "--store", str(held))
    finally:
        holder.communicate("")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "using a temporary store" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "step" in done.stdout


def test_ingest_of_an_empty_folder_says_it_found_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = tk("ingest", str(tmp_path / "empty"), "--store", str(tmp_path / "s.duckdb"))
    assert done.returncode == 2 and "nothing to ingest" in done.stderr, done.stdout + done.stderr


def _dashboard(store: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """Start the dashboard; (the process, stderr up to its URL line)."""
    p = subprocess.Popen([sys.executable, "-c", CLI, "dashboard", str(store), *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    seen = ""
    deadline = time.monotonic() + 120
    while "http://" not in seen and time.monotonic() < deadline:
        line = p.stderr.readline()  # type: ignore[union-attr]
        if not line:
            break
        seen += line
    return p, seen


def test_the_dashboard_takes_a_free_port_when_the_default_is_busy(store: Path) -> None:
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", 5006))
            busy.listen()
        except OSError:
            pass  # someone else holds it: busy all the same
        p, seen = _dashboard(store)
        try:
            assert "port 5006 is in use; serving on port" in seen, seen
            port = int(seen.split("serving on port ")[1].split()[0])
            assert f"http://127.0.0.1:{port}/dashboard" in seen and port != 5006, seen
        finally:
            p.send_signal(signal.SIGINT)
            _, rest = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in rest, rest


def test_the_dashboard_refuses_a_busy_port_that_was_asked_for(store: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = tk("dashboard", str(store), "--port", str(port))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"error: port {port} on 127.0.0.1 is in use; choose another with --port"
