"""Bad input never corrupts the store: every case fails alone, with a clear error naming the file."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracekit
from tracekit import store
from tracekit.ingest import unpickle
from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
from _traces import kineto_bytes, nccl_trace, write_trace  # noqa: E402

TABLES = ("events", "collectives", "p2p", "steps", "fr_entries", "memory_events", "groups", "runs")


def counts(db: Path) -> dict[str, int]:
    with tracekit.open(db) as s:
        return {t: s.sql(f"SELECT count(*) FROM {t}").item() for t in TABLES}


@pytest.fixture
def good_store(tmp_path: Path) -> Path:
    """A store holding one good 2-rank run 'good'."""
    run = tmp_path / "good"
    for r in range(2):
        write_trace(run / "traces" / f"rank{r}.json.gz", nccl_trace(r))
    db = tmp_path / "store.duckdb"
    rep = ingest([run], db)
    assert len(rep.ok) == 2 and not rep.failed
    return db


def test_synthetic_nccl_trace_values(good_store: Path) -> None:
    with tracekit.open(good_store) as s:
        c = s.sql("SELECT rank, seq, op, end_ns - start_ns AS d, nbytes, step FROM collectives "
                  "ORDER BY rank, seq").rows()
        assert c == [(0, 0, "all_reduce", 500000, 4096, 0), (0, 1, "all_reduce", 500000, 4096, 1),
                     (1, 0, "all_reduce", 400000, 4096, 0), (1, 1, "all_reduce", 400000, 4096, 1)]
        k = s.sql("SELECT dur_ns, step FROM events WHERE name = 'ampere_sgemm_128x64_nn' AND rank = 0 "
                  "ORDER BY ts_ns").rows()
        assert k == [(1234567, 0), (1234567, 1)]  # GPU kernels take the step of their launch
        assert s.sql("SELECT count(*) FROM events").item() == 2 * 2 * 7  # 7 X events a step, Trace span dropped


@pytest.mark.parametrize("case", ["empty", "truncated_gz", "truncated_json", "garbage", "not_json_object",
                                  "bad_events", "wrong_format", "corrupt_pickle", "empty_gz"])
def test_bad_file_fails_alone(good_store: Path, tmp_path: Path, case: str) -> None:
    before = counts(good_store)
    full = kineto_bytes(nccl_trace(0))
    d = tmp_path / "bad"
    d.mkdir()
    f = d / f"rank0_{case}.json"
    if case == "empty":
        f.write_bytes(b"")
    elif case == "truncated_gz":
        f = f.with_suffix(".json.gz")
        f.write_bytes(gzip.compress(full)[:-40])
    elif case == "truncated_json":
        f.write_bytes(full[: len(full) // 2])
    elif case == "garbage":
        f.write_bytes(os.urandom(3000))
    elif case == "not_json_object":
        f.write_bytes(b'{"traceEvents": 5}')
    elif case == "bad_events":
        f.write_bytes(full.replace(b'"dur": 50.5', b'"dur": [1, 2'))
    elif case == "wrong_format":
        f = f.with_suffix(".csv")
        f.write_text("a,b\n1,2\n")
    elif case == "corrupt_pickle":
        f = f.with_suffix(".pickle")
        f.write_bytes(pickle.dumps({"entries": [1, 2, 3]})[:-5])
    elif case == "empty_gz":
        f = f.with_suffix(".json.gz")
        f.write_bytes(gzip.compress(b""))
    other = tmp_path / "other" / "traces" / "rank1.json.gz"
    write_trace(other, nccl_trace(1))
    rep = ingest([f, other], good_store, run_id="bad")
    assert len(rep.failed) == 1 and len(rep.ok) == 1  # the good file still went in
    err = rep.failed[0].error
    assert str(f) in err, err
    with tracekit.open(good_store) as s:
        log = s.sql("SELECT status, error FROM ingest_log WHERE path = ?", [str(f)]).rows()
        assert log == [("failed", err)]
        assert s.sql("SELECT count(*) FROM events WHERE run_id = 'bad' AND rank = 0").item() == 0
        assert s.sql("SELECT count(*) FROM events WHERE run_id = 'good'").item() == \
            before["events"]


def test_duplicate_rank_refused(good_store: Path, tmp_path: Path) -> None:
    before = counts(good_store)
    dup = write_trace(tmp_path / "elsewhere" / "rank1.json.gz", nccl_trace(1, steps=3))
    rep = ingest([dup], good_store, run_id="good")
    assert len(rep.failed) == 1
    assert "duplicate rank 1" in rep.failed[0].error and str(dup) in rep.failed[0].error
    assert counts(good_store) == before


def test_changed_file_replaces_its_own_rows(good_store: Path, tmp_path: Path) -> None:
    path = tmp_path / "good" / "traces" / "rank1.json.gz"
    write_trace(path, nccl_trace(1, steps=3))
    rep = ingest([tmp_path / "good"], good_store)
    assert [f.status for f in sorted(rep.files, key=lambda f: str(f.path))] == ["skipped", "ok"]
    with tracekit.open(good_store) as s:
        assert s.sql("SELECT rank, count(*) FROM steps GROUP BY rank ORDER BY rank").rows() == [(0, 2), (1, 3)]


def test_missing_rank_reported(tmp_path: Path) -> None:
    run = tmp_path / "r"
    for r in (0, 2):
        write_trace(run / f"rank{r}.json.gz", nccl_trace(r, world=4))
    rep = ingest([run], tmp_path / "s.duckdb")
    assert rep.missing == {("r", "kineto"): [1, 3]}
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT error FROM ingest_log WHERE status = 'warning'").item() == \
            "ranks missing from kineto data: 1, 3 (2 of 4)"


def test_rank_from_file_name_when_no_distributed_info(tmp_path: Path) -> None:
    write_trace(tmp_path / "job" / "worker_rank-3.json.gz", nccl_trace(3, world=4, with_info=False))
    nameless = write_trace(tmp_path / "job" / "trace.json.gz", nccl_trace(0, with_info=False))
    rep = ingest([tmp_path / "job"], tmp_path / "s.duckdb")
    assert [(f.path.name, f.rank) for f in rep.ok] == [("worker_rank-3.json.gz", 3)]
    assert "cannot tell which rank" in rep.failed[0].error and str(nameless) in rep.failed[0].error


def test_rank_from_manifest_pid(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_trace(run / "traces" / "a.json.gz", nccl_trace(1, with_info=False))  # pid 101
    (run / "manifest.json").write_text(json.dumps({"run_id": "m1", "world_size": 2, "pids": {"0": 100, "1": 101}}))
    rep = ingest([run], tmp_path / "s.duckdb")
    assert [(f.run_id, f.rank) for f in rep.ok] == [("m1", 1)]


class _Boom:
    def __reduce__(self):  # the classic payload: calls os.system on load
        return (os.system, (f"touch {self.marker}",))

    marker = ""


def test_malicious_pickle_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _Boom.marker = str(marker)
    evil = tmp_path / "fr" / "rank0"
    evil.parent.mkdir()
    evil.write_bytes(pickle.dumps({"version": "2.10", "entries": [_Boom()]}))
    with pytest.raises(unpickle.UnsafePickleError, match="posix.system|os.system"):
        unpickle.load(evil)
    rep = ingest([evil], tmp_path / "s.duckdb")
    assert rep.failed and "system" in rep.failed[0].error and str(evil) in rep.failed[0].error
    assert not marker.exists()


def test_safe_pickle_admits_plain_data() -> None:
    data = {"a": [1, 2.5, None, True], "b": ("x", b"y"), "c": {1, 2}, "d": {"nested": [{"k": -1}]}}
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert unpickle.loads(pickle.dumps(data, protocol=proto)) == data


def test_safe_pickle_refuses_a_bytearray_of_a_size(tmp_path: Path) -> None:
    """bytearray(n) from a few bytes of file would allocate n bytes; bytearray(bytes), what every
    protocol writes, still loads."""
    sized = b"\x80\x02c__builtin__\nbytearray\nJ\x40\x42\x0f\x00\x85R."  # bytearray(1_000_000)
    with pytest.raises(unpickle.UnsafePickleError, match=r"x.pickle: pickle calls bytearray\(int\)"):
        unpickle.loads(sized, "x.pickle")
    evil = tmp_path / "fr" / "rank0"
    evil.parent.mkdir()
    evil.write_bytes(sized)
    rep = ingest([evil], tmp_path / "s.duckdb")
    assert rep.failed and str(evil) in rep.failed[0].error and "bytearray(int)" in rep.failed[0].error
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        assert unpickle.loads(pickle.dumps({"b": bytearray(b"\x00ab")}, protocol=proto)) == {"b": bytearray(b"\x00ab")}


def _mangle(data: bytes, how: str, pos: float, blob: bytes) -> bytes:
    i = int(pos * len(data))
    if how == "truncate":
        return data[:i]
    if how == "insert":
        return data[:i] + blob + data[i:]
    if how == "overwrite":
        return data[:i] + blob + data[i + len(blob):]
    return data[:i] + data[i + max(1, len(blob)):]  # delete


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(["truncate", "insert", "overwrite", "delete"]),
       pos=st.floats(0.0, 1.0), blob=st.binary(min_size=1, max_size=8), gz=st.booleans())
def test_mangled_traces_fail_clearly_and_store_stays_intact(good_store: Path, tmp_path: Path, how: str,
                                                            pos: float, blob: bytes, gz: bool) -> None:
    before = counts(good_store)
    raw = kineto_bytes(nccl_trace(0))
    data = _mangle(gzip.compress(raw) if gz else raw, how, pos, blob)
    f = tmp_path / ("mangled_rank0.json.gz" if gz else "mangled_rank0.json")
    f.write_bytes(data)
    rep = ingest([f], good_store, run_id="mangled")
    (res,) = rep.files
    with tracekit.open(good_store) as s:
        n = s.sql("SELECT count(*) FROM events WHERE run_id = 'mangled'").item()
    if res.status == "failed":
        assert str(f) in res.error and n == 0
        after = counts(good_store)
        assert {t: after[t] for t in TABLES if t != "runs"} == {t: before[t] for t in TABLES if t != "runs"}
    else:  # a mangling that left a valid trace (e.g. inside a name) ingests whole
        assert res.status == "ok" and n > 0
    # clean up so every example starts from the same store
    con = store.connect(good_store)
    for t in ("events", "collectives", "p2p", "steps", "groups", "runs", "ranks", "ingest_log"):
        con.execute(f"DELETE FROM {t} WHERE run_id = 'mangled'")
    con.close()


def test_missing_path_fails_alone(tmp_path: Path) -> None:
    good = write_trace(tmp_path / "run" / "rank0.json.gz", nccl_trace(0, world=1))
    rep = ingest([tmp_path / "nope.json", good], tmp_path / "s.duckdb")
    assert [f.status for f in rep.files] == ["failed", "ok"]
    assert rep.failed[0].error == f"{tmp_path / 'nope.json'}: no such file"


def _fr_dump() -> bytes:
    entry = {"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1,
             "p2p_seq_id": 0, "op_id": 1, "profiling_name": "nccl:all_reduce", "input_sizes": [[4]],
             "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
             "time_created_ns": 10, "time_discovered_started_ns": 20, "time_discovered_completed_ns": 30,
             "duration_ms": 0.01, "state": "completed", "retired": True, "timeout_ms": 1000, "is_p2p": False,
             "frames": []}
    return pickle.dumps({"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                               "ranks": "[0, 1]"}}, "entries": [entry] * 3})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(["truncate", "insert", "overwrite", "delete"]), pos=st.floats(0.0, 1.0),
       blob=st.binary(min_size=1, max_size=8))
def test_mangled_pickles_fail_clearly_and_store_stays_intact(good_store: Path, tmp_path: Path, how: str,
                                                             pos: float, blob: bytes) -> None:
    before = counts(good_store)
    f = tmp_path / "fr" / "rank0"
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(_mangle(_fr_dump(), how, pos, blob))
    (res,) = ingest([f], good_store, run_id="mangled").files
    if res.status == "failed":
        assert str(f) in res.error
        assert counts(good_store)["fr_entries"] == before["fr_entries"]
    else:
        assert res.status == "ok" and res.format == "fr"
    con = store.connect(good_store)
    for t in ("fr_entries", "collectives", "p2p", "groups", "runs", "ranks", "ingest_log"):
        con.execute(f"DELETE FROM {t} WHERE run_id = 'mangled'")
    con.close()


def test_rank_outside_world_is_reported(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "manifest.json").write_text(json.dumps({"run_id": "w2", "world_size": 2}))
    for r in (0, 1, 5):
        write_trace(tmp_path / "r" / "traces" / f"rank{r}.json.gz", nccl_trace(r, world=2, with_info=False))
    rep = ingest([tmp_path / "r"], tmp_path / "s.duckdb")
    assert len(rep.ok) == 3
    with tracekit.open(tmp_path / "s.duckdb") as s:
        w = s.sql("SELECT error FROM ingest_log WHERE status = 'warning'")["error"].to_list()
    assert w == ["ranks 5 lie outside the world size 2"]


def _big_job_trace(rank: int) -> dict:
    """A trace whose distributedInfo lists a large job's process groups before the events: the
    preamble alone is larger than what the sniffer reads (64 KiB)."""
    t = nccl_trace(rank, world=2)
    info = t.pop("distributedInfo")
    info["pg_config"] += [{"pg_name": str(i), "pg_desc": f"dp_{i}", "ranks": list(range(i, 16384, 128))}
                          for i in range(1, 129)]
    return {"schemaVersion": t.pop("schemaVersion"), "deviceProperties": t.pop("deviceProperties"),
            "distributedInfo": info, **t}


@pytest.mark.parametrize("gz", [False, True])
def test_trace_with_a_large_preamble_is_recognized(tmp_path: Path, gz: bool) -> None:
    run = tmp_path / "big"
    for r in range(2):
        path = write_trace(run / f"rank{r}.json{'.gz' if gz else ''}", _big_job_trace(r), gz=gz)
    raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    assert raw.index(b'"traceEvents"') > 1 << 16  # else the test says nothing
    rep = ingest([run], tmp_path / "s.duckdb")  # a directory walk used to pass these over silently
    assert [(f.rank, f.status) for f in rep.files] == [(0, "ok"), (1, "ok")] and not rep.ignored
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT count(*) FROM groups").item() == 129
        assert s.sql("SELECT count(*) FROM events").item() == 2 * 14


def test_files_passed_over_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory walk passes over what is not a trace, and says so: in the report, in --json and
    in the CLI's summary."""
    from click.testing import CliRunner

    from tracekit.cli import main

    run = tmp_path / "r"
    write_trace(run / "rank0.json.gz", nccl_trace(0, world=1))
    (run / "result.json").write_text(json.dumps({"loss": [2.5, 2.1]}))
    (run / "notes[i].txt").write_text("lr 3e-4\n")  # brackets: rich markup, unless escaped
    rep = ingest([run], tmp_path / "s.duckdb")
    assert [f.status for f in rep.files] == ["ok"]
    assert sorted(p.name for p in rep.ignored) == ["notes[i].txt", "result.json"]
    assert rep.bytes_ingested == (run / "rank0.json.gz").stat().st_size and rep.seconds > 0
    out = CliRunner().invoke(main, ["ingest", str(run), "--store", str(tmp_path / "t.duckdb"), "--json"])
    assert out.exit_code == 0, out.output
    as_json = json.loads(out.output)
    assert sorted(Path(p).name for p in as_json["ignored"]) == ["notes[i].txt", "result.json"]
    assert as_json["bytes"] == rep.bytes_ingested and as_json["seconds"] > 0
    out = CliRunner().invoke(main, ["ingest", str(run), "--store", str(tmp_path / "u.duckdb")])
    assert out.exit_code == 0, out.output
    assert f"passed over 2 files not recognized as traces: {run}: notes[i].txt, result.json" in out.output
    for i in range(3):  # several of one folder are counted, not listed
        (run / "device" / f"rank{i}.json").parent.mkdir(exist_ok=True)
        (run / "device" / f"rank{i}.json").write_text("{}")
    out = CliRunner().invoke(main, ["ingest", str(run), "--store", str(tmp_path / "v.duckdb")])
    assert f"passed over 5 files not recognized as traces: {run}: device/ (3 files), notes[i].txt, result.json" \
        in out.output
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "README").write_text("x")
    monkeypatch.chdir(tmp_path)  # a relative input beside an absolute one
    out = CliRunner().invoke(main, ["ingest", "r", str(other), "--store", str(tmp_path / "w.duckdb")])
    assert out.exit_code == 0, out.output
    assert f"passed over 6 files not recognized as traces: {tmp_path}: r/ (5 files), elsewhere/README" in out.output


def test_a_store_that_cannot_be_opened_is_a_clear_error(tmp_path: Path) -> None:
    """Another process holding the store, or a --store that is not a database: one line naming the
    store and why, exit code 2, no traceback, and the file left as it was."""
    import subprocess

    from click.testing import CliRunner

    from tracekit.cli import main

    trace = write_trace(tmp_path / "r" / "rank0.json.gz", nccl_trace(0, world=1))
    not_db = tmp_path / "notes.duckdb"
    not_db.write_text("not a database\n")
    out = CliRunner().invoke(main, ["ingest", str(trace), "--store", str(not_db)])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert f"{not_db}: cannot open store" in out.output and not_db.read_text() == "not a database\n"

    held = tmp_path / "held.duckdb"
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys; c = duckdb.connect(sys.argv[1]); "
                               "print('ready', flush=True); sys.stdin.read()", str(held)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        out = CliRunner().invoke(main, ["ingest", str(trace), "--store", str(held)])
    finally:
        holder.communicate("")
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert f"{held}: cannot open store" in out.output and "lock" in out.output
