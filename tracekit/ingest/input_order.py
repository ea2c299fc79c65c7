"""Input order decides between files of one ingest that exclude each other, whichever worker
finishes first, as in the dataset engine: of two files with one content the first is ingested and
the other skipped; of two files for one rank the first is ingested and the later one fails.
``repeats`` finds the repeated contents before the workers start (pipeline.py leaves them out of
the queue); the two ``settle_`` steps run after the workers."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import duckdb

from tracekit.ingest import commit, rundir
from tracekit.ingest import parse as parse_mod
from tracekit.ingest.ledger import Ledger

CommitBatch = Callable[[duckdb.DuckDBPyConnection, list, Ledger], list]


def settle_rank_conflicts(con: duckdb.DuckDBPyConnection, jobs: list[rundir.Job],
                           conflicts: list[tuple[rundir.Job, str]], status: dict[str, str], ledger: Ledger,
                           reader: parse_mod.OptableReader | None) -> Iterator[tuple[rundir.Job, commit.Applied]]:
    """Of two files of this ingest for one rank, the first in input order is the one ingested, as in
    the dataset engine, whichever worker committed first: where the later one took the rank, its
    rows go out again (it is logged as failed) and the earlier one goes in, in one transaction.
    Yields the new outcome of both."""
    order = {str(j.path): i for i, j in reversed(list(enumerate(jobs)))}
    for job, holder in sorted(conflicts, key=lambda c: order.get(str(c[0].path), len(order))):
        mine = order.get(str(job.path), len(order))
        if status.get(holder) != "ok" or order.get(holder, -1) <= mine:
            continue  # held from before this ingest, or by an earlier file: the failure stands
        cur = con.cursor()
        try:
            out = parse_mod.run(job.path, job.explicit, ledger.stored(job.run_id), cur, reader)
            if out.parsed is None or out.parsed.multi_rank:
                continue
            fmt = out.parsed.format
            rank = ledger.rank_of(job.run_id, fmt, holder)
            if rank is None:
                continue
            why = (f"{holder}: duplicate rank {rank} in run {job.run_id!r}: {fmt} data for it was already "
                   f"ingested from {job.path}")
            cur.execute("BEGIN TRANSACTION")
            evicted = ledger.evict(job.run_id, fmt, rank, holder)
            try:
                commit.evict(cur, job.run_id, fmt, rank, Path(holder), why)
                cur.execute("DELETE FROM ingest_log WHERE run_id = ? AND path = ? AND status = 'failed'",
                            [job.run_id, str(job.path)])
                applied = commit.apply(cur, job, out, ledger)
                if applied.result is None or applied.result.status != "ok":
                    raise commit.StoreWriteError("not ingested on its own either", rank)
                cur.execute("COMMIT")
            except (commit.StoreWriteError, duckdb.Error):
                commit.rollback(cur)  # both stay as they were
                ledger.unevict(evicted)
                continue
            status[holder], status[str(job.path)] = "failed", "ok"
            gone = dataclasses.replace(applied.result, path=Path(holder), status="failed", error=why, rows=0,
                                       seconds=0.0)
            yield job, applied
            yield next(j for j in jobs if str(j.path) == holder), commit.Applied(gone)
        finally:
            cur.close()


def repeats(jobs: list[rundir.Job]) -> dict[int, str]:
    """id(job) -> content hash, for each job whose file has the content of an earlier job's in the
    same run. Only files that share their size and their first 64 KiB with another are read whole
    for it (by parse.content_hash): equal sizes are common (flight-recorder dumps of one job), equal
    beginnings of other content are not, and this runs before the workers start."""
    def head(path: Path) -> str | None:  # a digest, so that 16k heads held at once stay small
        try:
            with open(path, "rb") as f:
                h = parse_mod.new_hasher()
                h.update(f.read(64 << 10))
                return h.hexdigest()
        except OSError:
            return None  # a file that is gone or unreadable says so when it is parsed

    by_size: dict[tuple[str, int], list[rundir.Job]] = {}
    for job in jobs:
        try:
            by_size.setdefault((job.run_id, job.path.stat().st_size), []).append(job)
        except OSError:
            continue
    found: dict[int, str] = {}
    for same_size in (s for s in by_size.values() if len(s) >= 2):
        by_head: dict[str, list[rundir.Job]] = {}
        for job in same_size:  # in input order
            h = head(job.path)
            if h is not None:
                by_head.setdefault(h, []).append(job)
        for same in (s for s in by_head.values() if len(s) >= 2):
            seen: set[str] = set()
            for job in same:
                try:
                    digest = parse_mod.content_hash(job.path)
                except OSError:
                    continue
                if digest in seen:
                    found[id(job)] = digest
                seen.add(digest)
    return found


def settle_repeats(con: duckdb.DuckDBPyConnection, jobs: list[rundir.Job], found: dict[int, str], ledger: Ledger,
                   reader: parse_mod.OptableReader | None,
                   commit_batch: CommitBatch) -> Iterator[tuple[rundir.Job, commit.Applied]]:
    """Each repeat (``repeats``' result) after the workers: skipped unread where the earlier copy
    went in, else read as any other file."""
    if not found:
        return
    cur = con.cursor()
    try:
        for job in (j for j in jobs if id(j) in found):
            digest = found[id(job)]
            if ledger.holds(job.run_id, digest):
                out = parse_mod.Outcome(job.path, "skipped", None, digest, error="already ingested (same content)")
            else:  # the earlier copy did not go in
                out = parse_mod.run(job.path, job.explicit, ledger.stored(job.run_id), cur, reader)
            [applied] = commit_batch(cur, [(job, out)], ledger)
            yield job, applied
    finally:
        cur.close()
