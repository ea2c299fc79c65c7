"""The ingest pipeline's own guarantees: content hashes taken while streaming, duplicates within one
ingest, batched commits that fall back to one file per transaction, workers committing side by side
with the cross-file checks still holding, and threads changing nothing."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest
import xxhash

import tracekit
from tracekit.ingest import commit, pipeline
from tracekit.ingest.ledger import Ledger
from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
from _traces import nccl_trace, write_trace  # noqa: E402

TABLES = ("events", "steps", "collectives", "p2p", "groups")


def _run(tmp: Path, ranks: int = 3, gz: bool = True) -> Path:
    for r in range(ranks):
        write_trace(tmp / "run" / f"rank{r}.json{'.gz' if gz else ''}", nccl_trace(r, world=ranks), gz=gz)
    return tmp / "run"


def _one_file_each(monkeypatch: pytest.MonkeyPatch, workers: int = 2) -> None:
    """Each worker parses one file, all at once: else one worker could take a second file while
    its writer holds the first, and a test whose commits wait for each other would wait in vain."""
    parsing = threading.Barrier(workers, timeout=30)
    real = pipeline.parse_mod.run

    def parse(*a, **k):  # type: ignore[no-untyped-def]
        parsing.wait()
        return real(*a, **k)

    monkeypatch.setattr(pipeline.parse_mod, "run", parse)


def _dump(db: Path) -> dict[str, list]:
    with tracekit.open(db) as s:
        return {t: s.sql(f"SELECT * EXCLUDE (run_id) FROM {t} ORDER BY ALL").rows() for t in TABLES}


@pytest.mark.parametrize("gz", [False, True])
def test_content_hash_is_the_files_xxh3_128(tmp_path: Path, gz: bool) -> None:
    run = _run(tmp_path, ranks=2, gz=gz)
    ingest([run], tmp_path / "s.duckdb")
    with tracekit.open(tmp_path / "s.duckdb") as s:
        logged = dict(s.sql("SELECT path, content_hash FROM ingest_log WHERE status = 'ok'").rows())
    assert logged == {str(p): "xxh3_128:" + xxhash.xxh3_128(p.read_bytes()).hexdigest() for p in run.iterdir()}


@pytest.mark.parametrize("slow_first", [False, True])
def test_same_content_twice_in_one_ingest_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     slow_first: bool) -> None:
    """The first copy in input order is the one ingested, even when its parse ends last (else the
    store's paths would depend on which worker finished first)."""
    run = _run(tmp_path, ranks=2)
    shutil.copy(run / "rank1.json.gz", run / "rank1_copy.json.gz")
    if slow_first:
        real = pipeline.parse_mod.run

        def parse(path, *a, **k):  # type: ignore[no-untyped-def]
            if path.name == "rank1.json.gz":
                time.sleep(0.5)
            return real(path, *a, **k)

        monkeypatch.setattr(pipeline.parse_mod, "run", parse)
    rep = ingest([run], tmp_path / "s.duckdb", workers=3, processes=False)
    status = {f.path.name: f.status for f in rep.files}
    assert status == {"rank0.json.gz": "ok", "rank1.json.gz": "ok", "rank1_copy.json.gz": "skipped"}
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT count(*) FROM events WHERE rank = 1").item() == 2 * 7


@pytest.mark.parametrize("slow_first", [False, True])
def test_of_two_files_for_one_rank_the_first_is_ingested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         slow_first: bool) -> None:
    """Two traces of rank 1 with other content: the first in input order goes in and the later one
    fails, as in the dataset engine, even when the later one committed first (its rows then go out
    again); the store holds the first one's steps and nothing of the other."""
    run = tmp_path / "run"
    write_trace(run / "a" / "rank0.json.gz", nccl_trace(0, world=2, steps=2))
    first = write_trace(run / "a" / "rank1.json.gz", nccl_trace(1, world=2, steps=2))
    later = write_trace(run / "b" / "rank1.json.gz", nccl_trace(1, world=2, steps=3))
    if slow_first:
        real = pipeline.parse_mod.run

        def parse(path, *a, **k):  # type: ignore[no-untyped-def]
            if path == first:
                time.sleep(0.5)
            return real(path, *a, **k)

        monkeypatch.setattr(pipeline.parse_mod, "run", parse)
    seen: list[tuple[int, int]] = []
    rep = ingest([run], tmp_path / "s.duckdb", run_id="run", workers=3, processes=False,
                 progress=lambda done, total, path, status: seen.append((done, total)))
    status = {f.path: f.status for f in rep.files}
    assert status == {run / "a" / "rank0.json.gz": "ok", first: "ok", later: "failed"}
    (bad,) = rep.failed
    assert bad.error == f"{later}: duplicate rank 1 in run 'run': kineto data for it was already ingested from {first}"
    assert seen == [(1, 3), (2, 3), (3, 3)]
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT rank, count(*) FROM steps GROUP BY rank ORDER BY rank").rows() == [(0, 2), (1, 2)]
        assert s.sql("SELECT path, status, error FROM ingest_log WHERE rank = 1 ORDER BY path").rows() == \
            [(str(first), "ok", None), (str(later), "failed", bad.error)]
        assert s.sql("SELECT path FROM file_meta WHERE rank = 1").rows() == [(str(first),)]


def test_failed_batch_write_is_redone_file_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All three files share a transaction; the store write of rank 1 fails, so the batch is rolled
    back and redone one file per transaction: ranks 0 and 2 go in, rank 1 is logged as failed."""
    run = _run(tmp_path)
    monkeypatch.setattr(pipeline, "BATCH_ROWS", 10**9)
    real = commit._insert
    calls: list[tuple[str, int | None]] = []

    def insert(con, table, src, run_id, rank):  # type: ignore[no-untyped-def]
        calls.append((table, rank))
        if rank == 1 and table == "collectives":
            raise duckdb.IOException("disk full (injected)")
        real(con, table, src, run_id, rank)

    monkeypatch.setattr(commit, "_insert", insert)
    rep = ingest([run], tmp_path / "s.duckdb", workers=1)
    assert {(f.rank, f.status) for f in rep.files} == {(0, "ok"), (1, "failed"), (2, "ok")}
    (bad,) = rep.failed
    assert str(run / "rank1.json.gz") in bad.error and "disk full (injected)" in bad.error
    assert calls.count(("events", 0)) == 2  # once in the batch, once alone
    with tracekit.open(tmp_path / "s.duckdb") as s:
        per_rank = s.sql("SELECT rank, count(*) FROM events GROUP BY rank ORDER BY rank").rows()
        log = s.sql("SELECT rank, status FROM ingest_log WHERE path IS NOT NULL ORDER BY rank").rows()
    assert per_rank == [(0, 14), (2, 14)]  # nothing of rank 1, not even its events
    assert log == [(0, "ok"), (1, "failed"), (2, "ok")]


def test_a_worker_commits_its_batch_once_no_file_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches fill up to BATCH_ROWS, except once no file is left to take: then each worker
    commits what it holds at once, beside the others, instead of after them."""
    run = _run(tmp_path, ranks=5)
    monkeypatch.setattr(pipeline, "BATCH_ROWS", 10**9)
    sizes: list[int] = []
    real = pipeline._commit_batch

    def commit_batch(cur, items, ledger):  # type: ignore[no-untyped-def]
        sizes.append(len(items))
        return real(cur, items, ledger)

    monkeypatch.setattr(pipeline, "_commit_batch", commit_batch)
    rep = ingest([run], tmp_path / "s.duckdb", workers=2)
    assert [f.status for f in rep.files] == ["ok"] * 5
    assert sum(sizes) == 5 and len(sizes) <= 2  # one batch per worker, committed when the files ran out


def test_workers_commit_side_by_side_and_record_each_group_once(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Both files wait, between their ledger claim and their writes, until the other has claimed:
    their transactions are open at the same time (a serial committer would break the barrier),
    and the group both traces list is recorded once."""
    run = _run(tmp_path, ranks=2)
    ingest([run], tmp_path / "one.duckdb", workers=1)
    barrier = threading.Barrier(2, timeout=30)
    real = Ledger.claim

    def claim(self, run_id, path, fmt, rank, digest, groups):  # type: ignore[no-untyped-def]
        try:
            return real(self, run_id, path, fmt, rank, digest, groups)
        finally:
            barrier.wait()

    monkeypatch.setattr(Ledger, "claim", claim)
    _one_file_each(monkeypatch)
    monkeypatch.setattr(pipeline, "BATCH_FILES", 1)
    rep = ingest([run], tmp_path / "two.duckdb", workers=2)
    assert [f.status for f in rep.files] == ["ok", "ok"]
    one, two = _dump(tmp_path / "one.duckdb"), _dump(tmp_path / "two.duckdb")
    assert one == two and one["groups"] == [("0", "default_pg", "world", [0, 1], 2)]


def test_a_worker_parses_on_while_its_writer_commits_and_holds_at_most_two_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker, a file per batch: the first batch's commit waits until the second file's parse
    has begun (a worker that committed its batch itself would never get there), then for a third
    parse, which must not begin while the writer still holds a batch (memory stays bounded)."""
    run = _run(tmp_path, ranks=4)
    monkeypatch.setattr(pipeline, "BATCH_FILES", 1)
    started: list[threading.Event] = [threading.Event() for _ in range(4)]
    order: list[str] = []
    real_parse, real_commit = pipeline.parse_mod.run, pipeline._commit_batch

    def parse(path, *a, **k):  # type: ignore[no-untyped-def]
        n = sum(e.is_set() for e in started)
        order.append(f"parse {n + 1}")
        started[n].set()
        return real_parse(path, *a, **k)

    def commit_batch(cur, items, ledger):  # type: ignore[no-untyped-def]
        if not order.count("commit 1 done"):
            assert started[1].wait(30), "the second file was not parsed while the first batch was written"
            started[2].wait(1)  # a third parse, were there one now, would start here
            order.append("commit 1 done")
        return real_commit(cur, items, ledger)

    monkeypatch.setattr(pipeline.parse_mod, "run", parse)
    monkeypatch.setattr(pipeline, "_commit_batch", commit_batch)
    rep = ingest([run], tmp_path / "s.duckdb", workers=1)
    assert [f.status for f in rep.files] == ["ok"] * 4
    assert order.index("parse 2") < order.index("commit 1 done") < order.index("parse 3")


def test_two_files_claiming_one_rank_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two traces of rank 0 with different content, committed side by side: neither transaction
    sees the other's rows, yet one goes in (the first in input order, whichever claimed first) and
    the other fails as a duplicate rank."""
    other = nccl_trace(0, world=2)
    other["traceEvents"][3]["dur"] = 51.5
    write_trace(tmp_path / "run" / "rank0.json.gz", nccl_trace(0, world=2))
    write_trace(tmp_path / "run" / "rank0_again.json.gz", other)
    barrier = threading.Barrier(2, timeout=30)
    real = pipeline.parse_mod.run
    calls = iter(range(10))

    def parse(*a, **k):  # type: ignore[no-untyped-def]
        out = real(*a, **k)
        if next(calls) < 2:  # the workers' parses (not the re-parse of a settled conflict)
            barrier.wait()  # both parsed: both claims come at the same time
        return out

    monkeypatch.setattr(pipeline.parse_mod, "run", parse)
    monkeypatch.setattr(pipeline, "BATCH_FILES", 1)
    rep = ingest([tmp_path / "run"], tmp_path / "s.duckdb", workers=2)
    assert sorted(f.status for f in rep.files) == ["failed", "ok"]
    (bad,) = rep.failed
    (good,) = rep.ok
    assert good.path.name == "rank0.json.gz"
    assert "duplicate rank 0 in run 'run'" in bad.error and str(good.path) in bad.error
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT count(*) FROM events").item() == 14
        assert s.sql("SELECT status, count(*) FROM ingest_log WHERE path IS NOT NULL "
                     "GROUP BY ALL ORDER BY 1").rows() == [("failed", 1), ("ok", 1)]


def test_a_group_claimed_by_a_failed_file_is_still_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 claims the run's group, rank 1 (committed meanwhile) leaves it to rank 0, then rank 0's
    write fails: the group must not be lost with it."""
    run = _run(tmp_path, ranks=2)
    claimed, committed = threading.Event(), threading.Event()
    real_claim, real_insert, real_alone = Ledger.claim, commit._insert, commit.apply_alone

    def claim(self, run_id, path, fmt, rank, digest, groups):  # type: ignore[no-untyped-def]
        if rank == 1:
            assert claimed.wait(30)
        got = real_claim(self, run_id, path, fmt, rank, digest, groups)
        if rank == 0:
            claimed.set()
        return got

    def insert(con, table, src, run_id, rank):  # type: ignore[no-untyped-def]
        if rank == 0 and table == "collectives":
            committed.wait(30)
            raise duckdb.IOException("disk full (injected)")
        real_insert(con, table, src, run_id, rank)

    def alone(con, job, out, ledger):  # type: ignore[no-untyped-def]
        done = real_alone(con, job, out, ledger)
        if done.result is not None and done.result.rank == 1:
            committed.set()
        return done

    monkeypatch.setattr(Ledger, "claim", claim)
    monkeypatch.setattr(commit, "_insert", insert)
    monkeypatch.setattr(commit, "apply_alone", alone)
    _one_file_each(monkeypatch)
    monkeypatch.setattr(pipeline, "BATCH_FILES", 1)
    rep = ingest([run], tmp_path / "s.duckdb", workers=2)
    assert {(f.rank, f.status) for f in rep.files} == {(0, "failed"), (1, "ok")}
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.sql("SELECT pg_name, ranks FROM groups").rows() == [("0", [0, 1])]


def test_a_failing_consumer_stops_the_workers_and_keeps_the_store(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress callback raising at the first commit: the error reaches the caller, no worker
    thread is left running, no new file is started, and the store holds whole files only."""
    run = _run(tmp_path, ranks=8)
    monkeypatch.setattr(pipeline, "BATCH_FILES", 1)
    real, calls = pipeline.parse_mod.run, []

    def parse(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 1:
            time.sleep(0.3)  # the others take long enough for the consumer to stop first, even on a busy machine
        return real(*a, **k)

    def progress(done: int, total: int, path: Path, status: str) -> None:
        raise KeyboardInterrupt  # what Ctrl-C in a progress bar looks like

    monkeypatch.setattr(pipeline.parse_mod, "run", parse)
    with pytest.raises(KeyboardInterrupt):
        ingest([run], tmp_path / "s.duckdb", workers=2, progress=progress)
    assert not [t for t in threading.enumerate() if t.name.startswith("tk-ingest")]
    assert len(calls) <= 3  # the first file, and at most one more per worker: no new file started
    monkeypatch.setattr(pipeline.parse_mod, "run", real)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        kept, low, high = s.sql("SELECT count(*), min(status), max(status) FROM ingest_log").rows()[0]
        events = s.sql("SELECT count(*) FROM events").item()
        per_rank = set(s.sql("SELECT count(*) FROM events GROUP BY rank").rows())
    # the first file, and at most what the other worker had in hand when the consumer stopped
    assert 1 <= kept <= 3 and (low, high) == ("ok", "ok")
    assert events == 14 * kept and per_rank == {(14,)}
    rep = ingest([run], tmp_path / "s.duckdb", workers=2)  # and the rest goes in afterwards
    assert sorted(f.status for f in rep.files) == ["ok"] * (8 - kept) + ["skipped"] * kept


def test_an_error_in_a_worker_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a bad file but a fault of the program: it stops the ingest and is raised, rather than
    leaving a file out of the report without a word."""
    run = _run(tmp_path, ranks=4)

    def broken(*a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("bug (injected)")

    monkeypatch.setattr(pipeline.parse_mod, "run", broken)
    with pytest.raises(RuntimeError, match="bug"):
        ingest([run], tmp_path / "s.duckdb", workers=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("tk-ingest")]


def test_threads_and_batches_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path, ranks=4)
    ingest([run], tmp_path / "one.duckdb", workers=1)
    monkeypatch.setattr(pipeline, "BATCH_FILES", 1)
    ingest([run], tmp_path / "threads.duckdb", workers=2)
    one, threads = _dump(tmp_path / "one.duckdb"), _dump(tmp_path / "threads.duckdb")
    assert one == threads and len(one["events"]) == 4 * 14 and len(one["collectives"]) == 4 * 2


def test_report_lists_files_in_the_order_given(tmp_path: Path) -> None:
    """A large trace given first finishes parsing after a small one given second; the report still
    lists them as given (it used to follow completion order)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gen_traces import write_rank

    big, small = tmp_path / "a" / "rank0.json", tmp_path / "b" / "rank1.json.gz"
    big.parent.mkdir()
    write_rank(big, 0, 2, 40_000)
    write_trace(small, nccl_trace(1, world=2))
    rep = ingest([big, small], tmp_path / "s.duckdb", workers=2)
    assert not rep.failed and [f.path for f in rep.files] == [big, small]


def test_a_batch_writes_its_files_in_order_around_a_multi_rank_files_deletes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A transaction's files are written per table at its end (commit.Staged), yet in the order they
    came: an op table (multi-rank) replaces its run's rows of its tables, so the Kineto trace
    before it in the same transaction loses its events, as it does one file per transaction."""
    import polars as pl

    run = _run(tmp_path, ranks=2, gz=False)
    pl.DataFrame({"x": [1]}).write_parquet(run / "zz_ops.parquet")  # after the traces, by name

    def reader(path: Path) -> dict[str, pl.DataFrame]:
        return {"events": pl.DataFrame({"rank": [5, 6], "ts_ns": [1, 2], "name": ["op", "op"]})}

    monkeypatch.setattr(pipeline, "BATCH_ROWS", 10**9)
    stores = {}
    for files in (8, 1):
        monkeypatch.setattr(pipeline, "BATCH_FILES", files)
        rep = ingest([run], tmp_path / f"b{files}.duckdb", workers=1, optable_reader=reader)
        assert [f.status for f in rep.files] == ["ok"] * 3
        stores[files] = _dump(tmp_path / f"b{files}.duckdb")
    assert stores[8]["events"] == stores[1]["events"]
    assert sorted({row[0] for row in stores[8]["events"]}) == [5, 6]  # rank: only the op table's
    assert stores[8] == stores[1]
