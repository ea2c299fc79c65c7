"""Parsing in parser processes (tracekit/ingest/procs.py): the same store as threads, the same
failures, a dead parser failing its file alone, nothing left behind."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import pytest

import tracekit
from tracekit import schema
from tracekit.ingest import pipeline, procs, rundir
from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
from _traces import kineto_bytes, nccl_trace, write_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_traces" / "slow_rank_8"
REAL = ROOT / "tests" / "fixtures" / "real"
VOLATILE = {"ingest_log": ("seconds", "ingested_at"), "runs": ("ingested_at",)}


def _dump(db: Path) -> dict[str, list]:
    """Every table, every column but the clocks' ones, in a fixed order."""
    with tracekit.open(db) as s:
        out = {}
        for t in schema.TABLES:
            drop = VOLATILE.get(t)
            cols = f"* EXCLUDE ({', '.join(drop)})" if drop else "*"
            out[t] = s.sql(f"SELECT {cols} FROM {t} ORDER BY ALL").rows()
        return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def test_processes_give_the_store_that_threads_give(tmp_path: Path) -> None:
    """Every format travels back from a parser process: Kineto (with its rank-dependent p2p), flight
    recorder, memory snapshots, and the real HTA and what-if fixtures."""
    inputs = [SAMPLE, REAL / "hta" / "two_rank_train", REAL / "wia" / "ST"]
    threads = ingest(inputs, tmp_path / "threads.duckdb", workers=2, processes=False)
    procs_rep = ingest(inputs, tmp_path / "procs.duckdb", workers=2, processes=True)
    assert not threads.failed and not procs_rep.failed
    assert [(f.path, f.status, f.rank, f.rows) for f in procs_rep.files] == \
        [(f.path, f.status, f.rank, f.rows) for f in threads.files]
    a, b = _dump(tmp_path / "threads.duckdb"), _dump(tmp_path / "procs.duckdb")
    for t in schema.TABLES:
        assert a[t] == b[t], t
    for t in ("events", "collectives", "p2p", "fr_entries", "memory_events", "memory_segments", "groups"):
        assert b[t], f"{t} is empty: the comparison says nothing about it"


def test_cli_processes_flag(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tracekit.cli import main

    res = CliRunner().invoke(main, ["ingest", str(SAMPLE / "traces"), "--store", str(tmp_path / "s.duckdb"),
                                    "--processes", "--workers", "2", "--json"])
    assert res.exit_code == 0, res.output
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT count(DISTINCT rank) FROM events").item() == 8


def _bad_inputs(tmp: Path) -> list[Path]:
    run = tmp / "run"
    for r in range(2):
        write_trace(run / f"rank{r}.json.gz", nccl_trace(r, world=4))
    data = kineto_bytes(nccl_trace(2, world=4))
    (run / "rank2.json").write_bytes(data[: len(data) // 2])  # truncated
    (run / "rank3.json").write_bytes(b"")  # empty
    other = nccl_trace(1, world=4)
    other["traceEvents"][2]["dur"] = 51.5
    write_trace(tmp / "again" / "rank1.json.gz", other)  # rank 1 a second time, other content
    (tmp / "notes.json").write_text('{"hello": 1}')  # named, but no trace

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp / 'pwned'}",))

    (tmp / "snap.pickle").write_bytes(pickle.dumps(Payload()))
    return [run, tmp / "again" / "rank1.json.gz", tmp / "notes.json", tmp / "snap.pickle"]


def test_bad_files_fail_in_processes_as_in_threads(tmp_path: Path) -> None:
    """One worker, so that which rank-1 file comes first (the other is the duplicate) is fixed."""
    inputs = _bad_inputs(tmp_path)
    rid = {"run_id": "r"}
    threads = ingest(inputs, tmp_path / "t.duckdb", workers=1, processes=False, **rid)
    in_procs = ingest(inputs, tmp_path / "p.duckdb", workers=1, processes=True, **rid)
    got = [(f.path.name, f.status, f.error) for f in in_procs.files]
    assert got == [(f.path.name, f.status, f.error) for f in threads.files]
    assert [s for _, s, _ in got] == ["ok", "ok", "failed", "failed", "failed", "failed"]
    assert in_procs.ignored == threads.ignored == [tmp_path / "run" / "rank3.json"]  # empty, in a walk
    assert not (tmp_path / "pwned").exists()
    assert _dump(tmp_path / "t.duckdb")["events"] == _dump(tmp_path / "p.duckdb")["events"]


def test_parsers_read_the_ingests_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader choice set after an earlier ingest started its parsers still reaches new ones."""
    run = tmp_path / "run"
    write_trace(run / "rank0.json.gz", nccl_trace(0))
    ingest([run], tmp_path / "a.duckdb", processes=True)
    monkeypatch.setenv("TRACEKIT_KINETO_READER", "bogus")
    rep = ingest([run], tmp_path / "b.duckdb", processes=True)
    assert rep.files[0].status == "failed" and "TRACEKIT_KINETO_READER='bogus'" in (rep.files[0].error or "")


def _job_files(tmp: Path, n: int) -> list[Path]:
    return [write_trace(tmp / "run" / f"rank{r}.json.gz", nccl_trace(r, world=n)) for r in range(n)]


def test_a_parser_that_dies_fails_one_file_and_is_replaced(tmp_path: Path) -> None:
    files = _job_files(tmp_path, 3)
    with procs.Parsers() as parsers:
        parser = parsers.parser()
        assert parser.run(files[0], True, frozenset()).status == "ok"
        (pid,) = _children(parsers.zygote_pid)
        os.kill(pid, signal.SIGKILL)
        died = parser.run(files[1], True, frozenset())
        assert died.status == "failed" and "the parser process died while reading it" in (died.error or "")
        assert died.content_hash is not None  # logged like any failed file
        again = parser.run(files[2], True, frozenset())
        assert again.status == "ok" and again.parsed is not None and again.parsed.rank == 2
        assert _children(parsers.zygote_pid) not in ([], [pid])  # a new parser took over
        parser.close()
        assert sorted(os.listdir(parsers.spool)) == ["owner.pid", "zygote.log"]  # every spool file was unlinked once mapped
    assert not os.path.exists(parsers.spool)


def test_a_parser_killed_mid_ingest_fails_its_file_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker; once the first file is in, its parser is killed while the second file's commit
    is held back, so the kill lands on a later file (the parser may be on file 2, 3 or, where the
    machine is loaded, already 4): that file fails, every other file goes in."""
    files = _job_files(tmp_path, 4)
    killed = threading.Event()
    commits = []
    real_commit = pipeline._commit_batch

    def held_commit(*a, **k):  # type: ignore[no-untyped-def]
        commits.append(1)
        if len(commits) > 1:
            assert killed.wait(30)
        return real_commit(*a, **k)

    monkeypatch.setattr(pipeline, "_commit_batch", held_commit)
    monkeypatch.setattr(pipeline, "BATCH_FILES", 1)  # a commit, and so a progress call, per file
    zygotes: list[int] = []
    real_init = procs.Parsers.__init__

    def init(self):  # type: ignore[no-untyped-def]
        real_init(self)
        zygotes.append(self.zygote_pid)

    monkeypatch.setattr(procs.Parsers, "__init__", init)

    def on_progress(done: int, total: int, path: Path, status: str) -> None:
        if done == 1:
            # the parser of file 2 is forked once the worker takes it; on a loaded machine that
            # took over the 2 s this loop once allowed
            deadline = time.monotonic() + 60
            while not (kids := _children(zygotes[0])) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert kids, "no parser was forked for the second file within 60 s"
            os.kill(kids[0], signal.SIGKILL)
            killed.set()

    rep = ingest([tmp_path / "run"], tmp_path / "s.duckdb", workers=1, processes=True, progress=on_progress)
    failed = rep.failed
    assert len(failed) == 1 and "the parser process died" in (failed[0].error or "")
    assert failed[0].path in files[1:] and len(rep.ok) == 3
    with tracekit.open(tmp_path / "s.duckdb") as s:
        ranks = s.sql("SELECT DISTINCT rank FROM events ORDER BY rank").rows()
    assert [r[0] for r in ranks] == sorted(files.index(f.path) for f in rep.ok)


def test_no_parser_outlives_the_ingest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spools = tmp_path / "tmp"
    spools.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spools))
    _job_files(tmp_path, 3)
    rep = ingest([tmp_path / "run"], tmp_path / "s.duckdb", workers=2, processes=True)
    assert len(rep.ok) == 3
    assert list(spools.iterdir()) == []  # the spool folder is gone
    deadline = time.monotonic() + 10
    while True:  # parsers exit on their own once their worker closes; none is left running
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(spools).encode() in cmd:
                left.append(pid)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == []


def test_a_script_without_a_main_guard_can_parse_in_processes(tmp_path: Path) -> None:
    """multiprocessing's fork server would run this script again in every parser (and ingest from
    there); the zygote does not."""
    _job_files(tmp_path, 2)
    script = tmp_path / "script.py"
    script.write_text("from tracekit.ingest.pipeline import ingest\n"
                      f"rep = ingest([{str(tmp_path / 'run')!r}], {str(tmp_path / 's.duckdb')!r}, processes=True)\n"
                      "print(sorted(f.status for f in rep.files))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['ok', 'ok']"


def test_a_gone_zygote_fails_the_files_with_its_reason(tmp_path: Path) -> None:
    files = _job_files(tmp_path, 1)
    with procs.Parsers() as parsers:
        os.kill(parsers.zygote_pid, signal.SIGKILL)
        time.sleep(0.2)
        out = parsers.parser().run(files[0], True, frozenset())
    assert out.status == "failed" and "zygote exited with code -9" in (out.error or "")


def test_when_processes_are_used(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(pipeline.PROCESSES_FROM_BYTES)
    small = write_trace(tmp_path / "small.json.gz", nccl_trace(0))
    jobs = rundir.collect([big], None)
    many = pipeline.PROCESSES_FROM_WORKERS
    assert pipeline.parse_in_processes(jobs, many, None, None) is True
    assert pipeline.parse_in_processes(jobs, many - 1, None, None) is False
    assert pipeline.parse_in_processes(rundir.collect([small], None), many, None, None) is False
    assert pipeline.parse_in_processes(jobs, many, lambda p: {}, None) is False  # a caller's reader
    assert pipeline.parse_in_processes(jobs, 1, None, True) is True
    with pytest.raises(ValueError, match="optable_reader"):
        pipeline.parse_in_processes(jobs, many, lambda p: {}, True)


def test_spool_files_keep_arrow_buffers_aligned(tmp_path: Path) -> None:
    """The handover is zero-copy only if each buffer sits on Arrow's alignment in the mapped file."""
    path = write_trace(tmp_path / "rank0.json.gz", nccl_trace(0))
    con = duckdb.connect()
    out = pipeline.parse_mod.run(path, True, frozenset(), con)
    reply = procs.pack(out, str(tmp_path))
    _, name, spans = reply
    assert name is not None and spans and all(o % procs.ALIGN == 0 for o, _ in spans)
    back = procs.unpack(reply)
    assert not Path(name).exists()
    assert back.parsed is not None and out.parsed is not None
    assert back.parsed.tables["events"].equals(out.parsed.tables["events"])
    addr = back.parsed.tables["events"].column("ts_ns").chunk(0).buffers()[1].address
    assert addr % procs.ALIGN == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_the_zygote_waits_for_its_parsers(tmp_path: Path) -> None:
    """The zygote reaps its parsers, so that their CPU reaches the ingest process's children's (what
    `time` and benchmarks/ingest_vs_hta.py read; the CPU figure itself is a benchmark's, not a
    test's). Checked without a clock: the ingest process makes itself a child subreaper, so a parser
    the zygote left unreaped would be handed to it when the zygote exits; after the ingest it must
    have no child left to wait for."""
    code = f"""
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
from pathlib import Path
from gen_traces import write_rank
from tracekit.ingest.pipeline import ingest
tmp = Path({str(tmp_path)!r})
files = [tmp / "run" / f"rank{{r}}.json" for r in range(3)]
files[0].parent.mkdir()
for r, f in enumerate(files):
    write_rank(f, r, 3, 2_000)
rep = ingest([tmp / "run"], tmp / "s.duckdb", workers=2, processes=True)
assert len(rep.ok) == 3, rep.files
try:
    pid, status = os.waitpid(-1, 0)
    print("left", pid, status)
except ChildProcessError:
    print("none")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none"], out.stdout


def test_a_spool_that_cannot_take_the_tables_fails_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No room (here: no folder) to write the tables fails the file with the reason; a spool file
    gone before it is read back fails it too. Neither kills the parser or the ingest."""
    path = write_trace(tmp_path / "rank0.json.gz", nccl_trace(0))
    out = pipeline.parse_mod.run(path, True, frozenset(), duckdb.connect())
    back = procs.unpack(procs.pack(out, str(tmp_path / "gone")))
    assert back.status == "failed" and back.parsed is None
    assert f"no room to hand the parsed tables back through {tmp_path / 'gone'}" in (back.error or "")
    with procs.Parsers() as parsers:
        parser = parsers.parser()
        real_unpack = procs.unpack

        def unpack_after_cleaner(reply):  # type: ignore[no-untyped-def]
            os.unlink(reply[1])
            return real_unpack(reply)

        monkeypatch.setattr(procs, "unpack", unpack_after_cleaner)
        lost = parser.run(path, True, frozenset())
        monkeypatch.setattr(procs, "unpack", real_unpack)
        assert lost.status == "failed" and "could not be read back from the spool folder" in (lost.error or "")
        assert parser.run(path, True, frozenset()).status == "ok"  # the same parser goes on
        parser.close()
