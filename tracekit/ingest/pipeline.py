"""Ingest orchestration: parallel parsing, parallel atomic commits, a log of what happened.

Worker threads hash, sniff and parse files, each with its own cursor on the store's database (for
DuckDB's JSON reader where the scanner is not built, and its TRY_CAST), and each hands what it
parsed to a writer thread of its own, which commits it in its own transaction while the worker
parses on: a few files per transaction, enough rows for DuckDB to write them straight into the
store file rather than through its write-ahead log. DuckDB runs these transactions side by side
(the scanner, Arrow's kernels and DuckDB work outside the GIL), so neither parsing nor writing
waits for one thread; a single committing thread was the limit on many cores, and on two it left
the last files' commits to run one after the other. On many cores and large inputs each worker
parses in a parser process of its own instead (procs.py), since the parse's Python steps contend
for the GIL; the writers still commit here. A transaction holds
whole files, so each file is in the store entirely or not at all; if a batch's write fails, its
files are redone one per transaction so that only the bad one fails. A bad file is logged with its
reason and the others still go in. Where two files exclude each other (one content, one rank),
the first in input order is the one ingested, settled after the workers (input_order.py). The
checks that span files (same content already in the run, a rank that another file already
holds, groups already recorded) are decided in one ledger under a
lock, since concurrent transactions do not see each other (ledger.py). This thread collects the
outcomes, reports progress, and after the files recomputes each touched run's ``runs``, ``ranks``
and ``groups.dim`` from the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import duckdb

from tracekit import store
from tracekit.ingest import commit, input_order, procs, rundir, topo
from tracekit.ingest import parse as parse_mod
from tracekit.ingest.commit import FileResult
from tracekit.ingest.common import crash_point
from tracekit.ingest.ledger import Ledger

__all__ = ["FileResult", "IngestReport", "ingest"]

Progress = Callable[[int, int, Path, str], None]  # (done, total, path, status)
# A worker commits once its transaction holds this many rows (DuckDB writes an append of at least a
# row group, 122880 rows, straight to the file) or this many files (bounded memory, steady
# progress), or when no file is left to take. Two row groups rather than one: each commit costs
# on its own (a partial row group per table, a WAL write), and at one row group the 64 sim-profiler
# traces took 0.25 CPU-s more to write (1.55 against 1.29; 4.2-4.4 CPU-s against 3.9-4.2 in all).
BATCH_ROWS = 2 * 122_880
BATCH_FILES = 8
MEMORY_PER_WORKER_MB = 128
PROCESSES_FROM_WORKERS = 4
PROCESSES_FROM_BYTES = 1 << 30


@dataclass
class IngestReport:
    files: list[FileResult] = field(default_factory=list)  # in the order the files were given
    missing: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (run, format) -> ranks
    warnings: list[str] = field(default_factory=list)  # "<run>: what is wrong with it" (world sizes disagree)
    runs: list[str] = field(default_factory=list)
    # files of a directory walk passed over as not traces (a README, a result.json), as given
    ignored: list[Path] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the whole ingest
    bytes_ingested: int = 0  # size on disk of the files ingested (status ok)

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
           optable_reader: parse_mod.OptableReader | None = None,
           processes: bool | None = None) -> IngestReport:
    """Ingest files and run directories into the store at ``store_path``; never raises for bad files.

    ``processes``: parse in a child process per worker (True), in the worker threads (False), or
    decide by the number of workers and the input's size (None, see ``parse_in_processes``)."""
    t0 = time.perf_counter()
    procs.clean_stale_folders()  # left by an ingest that was killed
    jobs = rundir.collect([Path(p) for p in paths], run_id)
    n_workers = max(1, workers or min(len(jobs), os.cpu_count() or 1))
    in_processes = parse_in_processes(jobs, n_workers, optable_reader, processes)
    # The parsers' zygote starts before the store opens, so that its imports overlap the opening.
    with procs.Parsers() if in_processes else contextlib.nullcontext() as parsers:
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
            # or spills (to <store>.tmp). Each worker also holds, outside DuckDB and so never
            # spilled, a piece of JSON (4 MiB), a batch of scanned rows, its file's parsed tables and
            # the batch its writer is committing.
            if saved["memory_limit"] == _default_memory_limit():  # else someone in this process chose one
                con.execute(f"SET memory_limit = '{MEMORY_PER_WORKER_MB * (n_workers + 1)}MB'")
            ledger = Ledger(con)
            crash_point("start")
            runs: dict[str, topo.RunBatch] = {}
            # closing: should the progress callback raise, the workers stop before the connection
            # their cursors belong to closes
            with contextlib.closing(_committed(con, jobs, ledger, n_workers, optable_reader, parsers)) as committed:
                at: dict[Path, int] = {}  # path -> its place in report.files (a settled conflict comes again)
                for job, applied in committed:
                    rb = runs.setdefault(job.run_id, topo.RunBatch(job.run_id, job.manifest))
                    res = applied.result
                    again = res is not None and res.path in at
                    if res is None:
                        report.ignored.append(job.path)
                    elif again:
                        report.files[at[res.path]] = res
                    else:
                        at[res.path] = len(report.files)
                        report.files.append(res)
                        if res.status == "skipped":
                            rb.touched = True  # the run's tables are recomputed; its content is in the store
                        elif res.status == "ok" and applied.parsed is not None:
                            rb.note(applied.parsed, res.rank)
                    if progress is not None and not again:
                        progress(len(at) + len(report.ignored), len(jobs), job.path, res.status if res else "ignored")
            for rid, rb in runs.items():
                if rb.touched:
                    report.missing.update(topo.finalize(con, rb))
                    report.warnings.extend(f"{rid}: {w}" for w in rb.warnings)
                    report.runs.append(rid)
        finally:
            _close(con, saved)
    order = {job.path: i for i, job in reversed(list(enumerate(jobs)))}
    report.files.sort(key=lambda f: order.get(f.path, len(order)))  # input order, not completion order
    report.ignored.sort(key=lambda p: order.get(p, len(order)))
    report.bytes_ingested = sum(_size(f.path) for f in report.ok)
    report.seconds = time.perf_counter() - t0
    return report


def parse_in_processes(jobs: list[rundir.Job], n_workers: int, reader: parse_mod.OptableReader | None,
                       processes: bool | None) -> bool:
    """Whether the workers parse in child processes (procs.py) rather than in their own threads.

    Threads contend for the GIL between the scanner's passes: that cost little at 2 workers and
    tripled a file's parse at 16. Processes cost the zygote's start (imports, about 0.5 s on the
    way to the first parse), a fork per worker and a spool file per parsed file. On 16 cores they
    took 64 traces of 61 MB (3.9 GB) from 7.1 s to 4.0-4.2 s, and 8 of them (0.5 GB) from 1.9 s
    to 2.2-2.6 s (docs/ingest.md); so by default they are used from PROCESSES_FROM_WORKERS
    workers on inputs of at least PROCESSES_FROM_BYTES. A caller's op-table reader runs in this
    process, so it rules them out."""
    if processes:
        if reader is not None:
            raise ValueError("an optable_reader is called in this process; it cannot be used with processes=True")
        if not procs.available():
            raise ValueError("parsing in processes needs os.fork and Unix sockets, which this platform lacks")
    if processes is not None:
        return processes
    if reader is not None or n_workers < PROCESSES_FROM_WORKERS or not procs.available():
        return False
    return sum(_size(j.path) for j in jobs) >= PROCESSES_FROM_BYTES


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # gone since it was read
        return 0


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


def _commit_batch(cur: duckdb.DuckDBPyConnection, items: list[tuple[rundir.Job, parse_mod.Outcome]],
                  ledger: Ledger) -> list[commit.Applied]:
    if len(items) > 1:
        cur.execute("BEGIN TRANSACTION")
        applied: list[commit.Applied] = []
        staged = commit.Staged()
        try:
            for job, out in items:
                applied.append(commit.apply(cur, job, out, ledger, staged))
            staged.write(cur)
            crash_point("commit")
            cur.execute("COMMIT")
            crash_point("committed")
            return applied
        except (commit.StoreWriteError, duckdb.Error):
            commit.rollback(cur)  # and again one file at a time, so that only the bad one fails
            for a in applied:
                ledger.release(a.claim)
    return [commit.apply_alone(cur, job, out, ledger) for job, out in items]


def _committed(con: duckdb.DuckDBPyConnection, jobs: list[rundir.Job], ledger: Ledger, n: int,
               reader: parse_mod.OptableReader | None,
               parsers: procs.Parsers | None = None) -> Iterator[tuple[rundir.Job, commit.Applied]]:
    """(job, what its commit did) in completion order; ``n`` worker threads parse (each in a parser
    process of its own, if given ``parsers``), each with a writer thread that commits its batches.

    Each worker takes the next file as soon as it is done with one, and hands what it holds to its
    writer once that is ``BATCH_ROWS`` rows or ``BATCH_FILES`` files, or once no file is
    left to take; it parses on while the writer commits, and waits only if the writer still holds
    the batch before. A worker's own commit left its core idle whenever the commit waited (on
    DuckDB's commit lock, on the other worker's transaction) and left the other worker's parse
    alone with the GIL; with a writer beside it, one of them runs there instead. Memory per
    worker stays bounded by two batches. An error that is not about a file (a bug, an interrupt)
    stops every worker and reaches the caller."""
    # A file that repeats an earlier one's content is left out of the workers' queue and settled
    # after them, so that the first in input order is the one ingested and the other skipped
    # (unread) whichever worker finishes first, as in the dataset engine.
    repeats = input_order.repeats(jobs)
    todo, todo_lock = iter([j for j in jobs if id(j) not in repeats]), threading.Lock()
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def take() -> rundir.Job | None:
        with todo_lock:
            return None if stop.is_set() else next(todo, None)

    def write(cur: duckdb.DuckDBPyConnection, batch: list[tuple[rundir.Job, parse_mod.Outcome]]) -> None:
        if stop.is_set():  # the consumer stopped, or another worker failed: commit nothing more
            return
        for (j, _), applied in zip(batch, _commit_batch(cur, batch, ledger)):
            if applied.parsed is not None:  # the tables are in the store: let them go
                applied.parsed = dataclasses.replace(applied.parsed, tables={})
            results.put((j, applied))

    def work(cur: duckdb.DuckDBPyConnection, write_cur: duckdb.DuckDBPyConnection, i: int) -> None:
        parser = parsers.parser() if parsers is not None else None
        writer = ThreadPoolExecutor(1, thread_name_prefix=f"tk-ingest-write_{i}")
        try:
            batch: list[tuple[rundir.Job, parse_mod.Outcome]] = []
            rows = 0
            writing: Future | None = None  # the batch the writer holds
            while True:
                job = take()
                if job is not None:
                    known = ledger.stored(job.run_id)
                    out = parser.run(job.path, job.explicit, known) if parser is not None \
                        else parse_mod.run(job.path, job.explicit, known, cur, reader)
                    batch.append((job, out))
                    rows += out.parsed.rows if out.parsed is not None else 0
                if batch and (job is None or rows >= BATCH_ROWS or len(batch) >= BATCH_FILES) \
                        and not stop.is_set():
                    if job is None:  # the last batch: committed here, beside the writer's, not after it
                        write(cur, batch)
                    else:
                        if writing is not None:
                            writing.result()  # raises what the writer raised
                        writing = writer.submit(write, write_cur, batch)
                    batch, rows = [], 0
                if job is None:
                    if writing is not None:
                        writing.result()
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            results.put(e)
        finally:
            if parser is not None:
                parser.close()
            writer.shutdown(wait=True)  # its batch committed (or failed) before its cursor closes
            cur.close()
            write_cur.close()
            results.put(None)  # this worker is done

    # cursors made here: the connection itself is not used across threads
    threads = [threading.Thread(target=work, args=(con.cursor(), con.cursor(), i), name=f"tk-ingest_{i}",
                                daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    running = n
    status: dict[str, str] = {}  # path -> status of its commit
    conflicts: list[tuple[rundir.Job, str]] = []  # (a file that failed on its rank, the file holding it)
    try:
        while running:
            item = results.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                job, applied = item
                if applied.result is not None:
                    status[str(job.path)] = applied.result.status
                if applied.rank_holder is not None:
                    conflicts.append((job, applied.rank_holder))
                yield item
    finally:  # the consumer stopped early, or a worker failed: start no new file, commit nothing more
        stop.set()
        for t in threads:
            t.join()
    yield from input_order.settle_rank_conflicts(con, jobs, conflicts, status, ledger, reader)
    yield from input_order.settle_repeats(con, jobs, repeats, ledger, reader, _commit_batch)
