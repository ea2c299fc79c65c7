"""Ingest orchestration: parallel parsing, atomic commits, a log of what happened.

Worker threads hash, sniff and parse files, each with its own cursor on the store's database
(for DuckDB's JSON reader where the scanner is not built, and its TRY_CAST): files come back as
Arrow tables. The scanner, Arrow's kernels and DuckDB work outside the GIL, so the threads use
every core with no processes to start and no results to copy. This thread, the store's only writer, commits the parsed files (commit.py) while the workers parse the
next ones: a few files per transaction, enough rows for DuckDB to write them straight into the
store file rather than through its write-ahead log. A transaction holds whole files, so each file
is in the store entirely or not at all; if a batch's write fails, its files are redone one per
transaction so that only the bad one fails. A bad file is logged with its reason and the others
still go in. Re-ingesting content already in a run is skipped (content hash); a second file
claiming a rank that another file of the same format already holds is refused; ranks missing
from a run are reported. After the files, each touched run's ``runs``, ``ranks`` and
``groups.dim`` are recomputed from the store.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import duckdb

from tracekit import store
from tracekit.ingest import commit, rundir, topo
from tracekit.ingest import parse as parse_mod
from tracekit.ingest.commit import FileResult

__all__ = ["FileResult", "IngestReport", "ingest"]

Progress = Callable[[int, int, Path, str], None]  # (done, total, path, status)
# A transaction commits once it holds this many rows (DuckDB writes appends of two or more row
# groups, 122880 rows each, straight to the file) or this many files (bounded memory, steady progress).
BATCH_ROWS = 250_000
BATCH_FILES = 8
MEMORY_PER_WORKER_MB = 128


@dataclass
class IngestReport:
    files: list[FileResult] = field(default_factory=list)  # in the order the files were given
    missing: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (run, format) -> ranks
    runs: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "failed"]

    @property
    def ok(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "ok"]

    @property
    def skipped(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "skipped"]


def ingest(paths: list[str | Path], store_path: str | Path, run_id: str | None = None,
           workers: int | None = None, progress: Progress | None = None,
           optable_reader: parse_mod.OptableReader | None = None) -> IngestReport:
    """Ingest files and run directories into the store at ``store_path``; never raises for bad files."""
    jobs = rundir.collect([Path(p) for p in paths], run_id)
    n_workers = max(1, workers or min(len(jobs), os.cpu_count() or 1))
    con = store.connect(store_path)
    saved = _settings(con)
    report = IngestReport()
    try:
        # Parallelism comes from the worker threads, each query on its own thread. (With DuckDB's
        # own threads as well, a batch's appends were not written straight to the file: the final
        # checkpoint then compressed them again, +0.1 CPU-s per 150k-event trace.)
        con.execute("SET threads = 1")
        # A file's last, partial row group of events goes to the store file as it is; the
        # checkpoint's vacuum would rewrite each one to merge it with the next (about 0.1 CPU-s per
        # 150k-event trace, docs/ingest.md). A later checkpoint outside ingest still may.
        con.execute("SET max_vacuum_tasks = 0")
        # Bounded memory: DuckDB keeps what it wrote cached in memory only up to this, then evicts
        # or spills (to <store>.tmp). Each reading thread also holds about
        # 64 MiB of JSON buffers that cannot be spilled.
        if saved["memory_limit"] == _default_memory_limit():  # else someone in this process chose one
            con.execute(f"SET memory_limit = '{MEMORY_PER_WORKER_MB * (n_workers + 1)}MB'")
        known: dict[str, set[str]] = {}
        for rid, h in con.execute("SELECT run_id, content_hash FROM ingest_log WHERE status = 'ok'").fetchall():
            known.setdefault(rid, set()).add(h)
        stored = {rid: frozenset(hs) for rid, hs in known.items()}  # workers skip these unread
        runs: dict[str, topo.RunBatch] = {}
        batch: list[tuple[rundir.Job, parse_mod.Outcome]] = []
        done = 0

        def flush() -> None:
            nonlocal done
            for (job, out), applied in zip(batch, _commit_batch(con, batch)):
                rb = runs.setdefault(job.run_id, topo.RunBatch(job.run_id, job.manifest))
                res = applied.result
                if res is not None:
                    report.files.append(res)
                    if res.status == "skipped":
                        rb.touched = True  # the run's tables are recomputed; its content is in the store
                    elif res.status == "ok" and applied.parsed is not None:
                        rb.note(applied.parsed, res.rank)
                        known.setdefault(job.run_id, set()).add(out.content_hash or "")
                done += 1
                if progress is not None:
                    progress(done, len(jobs), job.path, res.status if res else "ignored")
            batch.clear()

        rows = 0
        # closing: should a commit or the progress callback raise, the workers stop before the
        # connection their cursors belong to closes
        with contextlib.closing(_outcomes(con, jobs, stored, n_workers, optable_reader)) as outcomes:
            for i, (job, out) in enumerate(outcomes):
                batch.append((job, _unless_known(job, out, known, batch)))
                rows += out.parsed.rows if out.parsed is not None else 0
                # Once fewer files are left than workers (all being parsed), commit each as it comes:
                # its commit then overlaps the others' parsing instead of running alone after the last.
                last_round = len(jobs) - (i + 1) < n_workers
                if rows >= BATCH_ROWS or len(batch) >= BATCH_FILES or last_round:
                    flush()
                    rows = 0
        flush()
        for rid, rb in runs.items():
            if rb.touched:
                report.missing.update(topo.finalize(con, rb))
                report.runs.append(rid)
    finally:
        _close(con, saved)
    order = {job.path: i for i, job in reversed(list(enumerate(jobs)))}
    report.files.sort(key=lambda f: order.get(f.path, len(order)))  # input order, not completion order
    return report


def _settings(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """The instance settings ingest changes, as they are now."""
    names = ("threads", "max_vacuum_tasks", "memory_limit")
    values = con.execute("SELECT " + ", ".join(f"current_setting('{n}')" for n in names)).fetchone()
    return {n: str(v) for n, v in zip(names, values or ())}


def _default_memory_limit() -> str:
    probe = duckdb.connect(":memory:")
    try:
        return str(probe.execute("SELECT current_setting('memory_limit')").fetchone()[0])  # type: ignore[index]
    finally:
        probe.close()


def _close(con: duckdb.DuckDBPyConnection, saved: dict[str, str]) -> None:
    """Close, first putting back the settings ingest changed:
    they belong to the database instance, which another connection of this process to the same
    store may share (and may have tuned)."""
    try:
        # The checkpoint that closing would run, but while the vacuum is still off: with it on,
        # the checkpoint merges every file's last partial row group of events into its neighbour
        # (0.25 CPU-s at 8 ranks of 157k events, at the very end, on one core).
        _checkpoint(con)
        con.execute(f"SET threads = {int(saved['threads'])}")
        con.execute(f"SET max_vacuum_tasks = {int(saved['max_vacuum_tasks'])}")
        # memory_limit reads back rounded ('2.7 GiB'), so it is only ever changed from the default
        if _settings(con)["memory_limit"] != saved["memory_limit"]:
            con.execute("RESET memory_limit")
    except duckdb.Error:
        pass  # a connection that cannot reset is closing anyway
    con.close()


def _checkpoint(con: duckdb.DuckDBPyConnection) -> None:
    try:
        con.execute("CHECKPOINT")
    except duckdb.Error:
        pass  # another connection's open transaction: the last connection to close checkpoints


def _unless_known(job: rundir.Job, out: parse_mod.Outcome, known: dict[str, set[str]],
                  batch: list[tuple[rundir.Job, parse_mod.Outcome]]) -> parse_mod.Outcome:
    """``out``, or 'skipped' when the same content of the same run is in the store or in the batch."""
    if out.status != "ok":
        return out
    dup = out.content_hash in known.get(job.run_id, ()) or any(
        o.status == "ok" and (j.run_id, o.content_hash) == (job.run_id, out.content_hash) for j, o in batch)
    if not dup:
        return out
    return parse_mod.Outcome(out.path, "skipped", None, out.content_hash, error="already ingested (same content)",
                             seconds=out.seconds)


def _commit_batch(con: duckdb.DuckDBPyConnection,
                  items: list[tuple[rundir.Job, parse_mod.Outcome]]) -> list[commit.Applied]:
    if len(items) > 1:
        con.execute("BEGIN TRANSACTION")
        try:
            applied = [commit.apply(con, job, out) for job, out in items]
            con.execute("COMMIT")
            return applied
        except (commit.StoreWriteError, duckdb.Error):
            commit.rollback(con)  # and again one file at a time, so that only the bad one fails
    return [commit.apply_alone(con, job, out) for job, out in items]


def _outcomes(con: duckdb.DuckDBPyConnection, jobs: list[rundir.Job], known: dict[str, frozenset[str]],
              n: int, reader: parse_mod.OptableReader | None) -> Iterator[tuple[rundir.Job, parse_mod.Outcome]]:
    """(job, its outcome) in completion order, parsed by ``n`` worker threads.

    Each worker takes its next file as soon as it is done with one, whether or not this generator's
    consumer (the committing thread) has come back for the outcomes: a worker that waited for the
    consumer idled through every commit (a quarter of its time at 8 ranks on 2 cores). Memory stays
    bounded: at most ``2 n`` files are parsed or being parsed and not yet taken (a parsed trace
    holds about 60 bytes per event)."""
    if len(jobs) <= 1 or n <= 1:
        for j in jobs:
            cur = con.cursor()
            try:
                yield j, parse_mod.run(j.path, j.explicit, known.get(j.run_id, frozenset()), cur, reader)
            finally:
                cur.close()
        return
    todo, todo_lock = iter(jobs), threading.Lock()
    slots = threading.Semaphore(2 * n)
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def work(cur: duckdb.DuckDBPyConnection) -> None:
        try:
            while True:
                slots.acquire()
                with todo_lock:
                    j = None if stop.is_set() else next(todo, None)
                if j is None:
                    return
                results.put((j, parse_mod.run(j.path, j.explicit, known.get(j.run_id, frozenset()), cur, reader)))
        finally:
            cur.close()
            results.put(None)  # this worker is done

    # cursors made here: the connection itself is not used across threads
    threads = [threading.Thread(target=work, args=(con.cursor(),), name=f"tk-ingest_{i}", daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    running = n
    try:
        while running:
            item = results.get()
            if item is None:
                running -= 1
                continue
            yield item
            slots.release()
    finally:  # the consumer stopped early: let the running parses end, start no new one
        stop.set()
        for _ in threads:
            slots.release()
        for t in threads:
            t.join()
