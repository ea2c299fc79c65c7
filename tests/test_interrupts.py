"""Ctrl-C (SIGINT) in ingest, the analyses, the dashboard and training: exit code 130, one line, no
traceback, and a store that a re-run completes to the clean one (a training run: none of its ranks left).

Inside ingest the signal comes at the ingest's own points (TRACEKIT_TEST_CRASH_AT with
TRACEKIT_TEST_CRASH_SIGNAL=INT: a worker thread signals the process, as a terminal would), so each
case interrupts the same place every time; the analyses and the dashboard are signalled from here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_ingest_crash import SAMPLE, ingest_cli, tables  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from tracekit.cli import main; sys.argv[0] = 'tracekit'; main()"


def _interrupted(out: str) -> None:
    assert "Traceback" not in out and "Aborted" not in out, out
    assert out.strip().splitlines()[-1] == "interrupted", out


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    store = tmp_path_factory.mktemp("clean") / "s.duckdb"
    assert ingest_cli(store).returncode == 0
    return tables(store)


@pytest.mark.parametrize("point,mode", [("start", "--threads"), ("commit:1", "--threads"), ("committed:2", "--threads"),
                                        ("finalize", "--threads"), ("commit:1", "--processes"),
                                        ("committed:1", "--processes")])
def test_ctrl_c_in_ingest(point: str, mode: str, clean: dict, tmp_path: Path) -> None:
    store = tmp_path / "s.duckdb"
    done = ingest_cli(store, mode, env={"TRACEKIT_TEST_CRASH_AT": point, "TRACEKIT_TEST_CRASH_SIGNAL": "INT",
                                        "TMPDIR": str(tmp_path)})
    assert done.returncode == 130, done.stdout + done.stderr
    _interrupted(done.stderr)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tk-")]  # its parsers' spool removed
    again = ingest_cli(store)
    assert again.returncode == 0, again.stdout + again.stderr
    assert tables(store) == clean


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _signal_when(args: list[str], ready: str, tmp_path: Path, timeout: float = 120,
                 until=None) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """Run `tracekit *args`, send SIGINT once ``ready`` appears in its stderr (and ``until()`` holds), and wait."""
    log = tmp_path / "err.txt"
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=subprocess.PIPE, stderr=err,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while ready not in log.read_text(errors="replace") or (until is not None and not until()):
            assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    return subprocess.CompletedProcess(args, p.returncode, out.decode(), log.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ctrl_c_in_the_dashboard(clean: dict, tmp_path: Path) -> None:
    """Once its server answers (Panel's server handles the signal itself, and returns)."""
    store = tmp_path / "s.duckdb"
    assert ingest_cli(store).returncode == 0
    port = _free_port()
    done = _signal_when(["dashboard", str(store), "--port", str(port), "--address", "127.0.0.1"],
                        "tracekit dashboard: http://", tmp_path, until=lambda: _answers(port))
    assert done.returncode == 130, done.stdout + done.stderr
    _interrupted(done.stderr)
    assert tables(store) == clean


def _session(sid: int) -> list[str]:
    return subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()


def test_ctrl_c_in_training_leaves_no_process_behind(tmp_path: Path) -> None:
    """`train` signalled once a step is done: 130, one line, and nothing of its world left running
    (its ranks, the forkserver they forked from)."""
    out, log = tmp_path / "run", tmp_path / "err.txt"
    with open(log, "wb") as err:
        p = subprocess.Popen([sys.executable, "-c", CLI, "train", "--tp", "2", "--dp", "2", "--steps", "500",
                              "--out", str(out)], stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        deadline = time.monotonic() + 120
        while not (out / "steps.jsonl").exists() or not (out / "steps.jsonl").read_text().strip():
            assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert len(_session(p.pid)) >= 5  # the command, and its 4 ranks at least
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    assert p.returncode == 130, log.read_text()
    _interrupted(log.read_text())
    deadline = time.monotonic() + 10
    while _session(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session(p.pid) == []


def test_ctrl_c_while_the_dashboard_ingests(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CLI, "dashboard", str(SAMPLE), "--store", str(tmp_path / "s.duckdb"),
                           "--port", str(_free_port())], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TRACEKIT_TEST_CRASH_AT": "committed:1",
                               "TRACEKIT_TEST_CRASH_SIGNAL": "INT"})
    assert done.returncode == 130, done.stdout + done.stderr
    _interrupted(done.stderr)


def test_ctrl_c_in_an_analysis(tmp_path: Path) -> None:
    """`report` over a run directory, interrupted while it ingests it."""
    store = tmp_path / "s.duckdb"
    p = subprocess.Popen([sys.executable, "-c", CLI, "report", str(SAMPLE), "--store", str(store)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                                             "TRACEKIT_TEST_CRASH_AT": "committed:1",
                                                                             "TRACEKIT_TEST_CRASH_SIGNAL": "INT"})
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, out.decode() + err.decode()
    _interrupted(err.decode())


SPIN = """
import sys, threading, click, duckdb
import tracekit.cli as cli

@click.command()
def spin():
    con = duckdb.connect()
    done = threading.Event()

    def interrupt():  # what DuckDB does on a Ctrl-C inside a query, without the signal's timing
        while not done.wait(0.2):
            con.interrupt()

    t = threading.Thread(target=interrupt)
    t.start()
    try:
        con.sql("SELECT count(*) FROM range(100000000000) a WHERE a.range % 7 = 3").pl()
    finally:
        done.set()
        t.join()  # before the interpreter exits: a thread cut off inside DuckDB aborts the process

sys.modules["spin_module"] = sys.modules[__name__]
cli.COMMANDS["spin"] = ("spin_module", "spin", "a long DuckDB query")
sys.argv[0] = "tracekit"
cli.main()
"""


def test_an_interrupted_duckdb_query_exits_130(tmp_path: Path) -> None:
    """DuckDB turns a Ctrl-C inside a query into its own error ('Query interrupted'); it exits 130 all
    the same (the dashboard's first page build, interrupted under load, printed a traceback and exit
    1). The query is interrupted the way DuckDB's signal handling does it (connection.interrupt), so
    no signal timing enters the test."""
    done = subprocess.run([sys.executable, "-c", SPIN, "spin"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 130, done.stderr
    _interrupted(done.stderr)
