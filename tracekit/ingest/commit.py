"""Writing one parsed file into the store: its rows, its groups and its ``ingest_log`` row.

``apply`` does the checks (which rank, is it a duplicate, does the file replace its own earlier
version) before writing anything, so a file that fails them leaves only its ``failed`` log row; it
runs inside the caller's transaction (several files may share one, pipeline.py). The checks that
span files are made in the ledger, not in SQL: other workers' transactions run at the same time and
their rows are invisible to this one until they commit. ``apply_alone`` wraps one file in its own
transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from tracekit import schema
from tracekit.ingest import parse as parse_mod
from tracekit.ingest import limits, rundir, topo
from tracekit.ingest.common import IngestError, Parsed, RankDependent, crash_point
from tracekit.ingest.ledger import Claim, Ledger, SameContent

# What a re-ingest of a changed file replaces, per format: table -> extra row filter.
OWNED: dict[str, dict[str, str]] = {
    "kineto": {"events": "", "steps": "", "collectives": "AND source IN ('kernel', 'annotation', 'gloo')",
               "p2p": "AND source IN ('kernel', 'annotation', 'gloo')"},
    "fr": {"fr_entries": "", "collectives": "AND source = 'fr'", "p2p": "AND source = 'fr'"},
    "memory": {"memory_events": "", "memory_segments": "", "memory_blocks": ""},
}


@dataclass
class FileResult:
    path: Path
    run_id: str
    format: str | None
    rank: int | None
    status: str  # ok | failed | skipped
    error: str | None
    rows: int
    seconds: float


class StoreWriteError(Exception):
    """Writing a file's rows failed in DuckDB; the enclosing transaction can only be rolled back."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class Applied:
    """What ``apply`` did with one file: its result, and for an ingested file what was parsed."""

    result: FileResult | None  # None: the file was passed over (not a trace)
    parsed: Parsed | None = None
    claim: Claim | None = None  # what it holds in the ledger, to take back if its transaction fails


def _log(con: duckdb.DuckDBPyConnection, run_id: str, path: Path, fmt: str | None, rank: int | None,
         digest: str | None, status: str, error: str | None, rows: int, seconds: float) -> None:
    con.execute("INSERT INTO ingest_log VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, now())",
                [run_id, str(path), fmt, rank, digest, status, error, rows, seconds])


def failed(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome, msg: str,
           rank: int | None = None) -> Applied:
    _log(con, job.run_id, job.path, out.format, rank, out.content_hash, "failed", msg, 0, out.seconds)
    return Applied(FileResult(job.path, job.run_id, out.format, rank, "failed", msg, 0, out.seconds))


def _skipped(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome, fmt: str | None,
             rank: int | None, why: str) -> Applied:
    _log(con, job.run_id, job.path, fmt, rank, out.content_hash, "skipped", why, 0, out.seconds)
    return Applied(FileResult(job.path, job.run_id, fmt, rank, "skipped", why, 0, out.seconds))


def apply(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome, ledger: Ledger) -> Applied:
    """Write one file's outcome. Raises StoreWriteError only for a failed store write, which leaves
    the caller's transaction unusable (the file's ledger claim is already taken back); a bad file is
    logged and returned as failed."""
    if out.status == "ignored":
        return Applied(None)
    if out.status == "skipped":
        fmt, rank = ledger.previous(job.run_id, out.content_hash)
        return _skipped(con, job, out, fmt, rank, out.error or "already ingested (same content)")
    if out.status != "ok" or out.parsed is None:
        return failed(con, job, out, out.error or f"{job.path}: failed")
    parsed, rank = out.parsed, None
    try:
        unknown = [t for t in parsed.tables if t not in schema.TABLES]
        if unknown:
            raise IngestError(f"{job.path}: parser produced unknown table {unknown[0]!r}")
        rank = None if parsed.multi_rank else _resolve_rank(parsed, job)
        check_ranks(job.path, parsed, rank)
        claim = ledger.claim(job.run_id, job.path, parsed.format, rank, out.content_hash, parsed.groups)
    except SameContent as e:
        return _skipped(con, job, out, e.format, e.rank, str(e))
    except IngestError as e:
        return failed(con, job, out, str(e), rank)
    replace = claim.replace
    try:
        if replace:
            for t, extra in OWNED[parsed.format].items():
                con.execute(f"DELETE FROM {t} WHERE run_id = ? AND rank = ? {extra}", [job.run_id, rank])
            con.execute("DELETE FROM ingest_log WHERE run_id = ? AND path = ? AND status = 'ok'",
                        [job.run_id, str(job.path)])
            con.execute("DELETE FROM file_meta WHERE run_id = ? AND path = ?", [job.run_id, str(job.path)])
        if parsed.multi_rank:
            for t in parsed.tables:
                con.execute(f"DELETE FROM {t} WHERE run_id = ?", [job.run_id])
        for t, tbl in parsed.tables.items():
            _insert(con, t, tbl, job.run_id, rank)
        for g in claim.new_groups:
            topo.insert_group(con, job.run_id, g)
        topo.insert_file_meta(con, job.run_id, job.path, parsed, rank)
        _log(con, job.run_id, job.path, parsed.format, rank, out.content_hash, "ok", None, parsed.rows,
             out.seconds)
    except (duckdb.Error, pa.ArrowException) as e:
        ledger.release(claim)
        raise StoreWriteError(write_failed(job.path, e), rank) from e
    except BaseException:
        ledger.release(claim)
        raise
    return Applied(FileResult(job.path, job.run_id, parsed.format, rank, "ok", None, parsed.rows, out.seconds),
                   parsed, claim)


def apply_alone(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome, ledger: Ledger) -> Applied:
    """``apply`` in a transaction of its own; a failed store write is logged as the file's failure."""
    con.execute("BEGIN TRANSACTION")
    done = None
    try:
        done = apply(con, job, out, ledger)
        crash_point("commit")
        con.execute("COMMIT")
        crash_point("committed")
        return done
    except StoreWriteError as e:
        rollback(con)
        return failed(con, job, out, str(e), e.rank)
    except duckdb.Error as e:  # the COMMIT itself
        rollback(con)
        ledger.release(done.claim if done else None)
        return failed(con, job, out, write_failed(job.path, e))


def write_failed(path: Path, e: BaseException) -> str:
    """The message for a failed store write, saying what ran out where DuckDB's own words hide it."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, (duckdb.OutOfMemoryException, MemoryError, pa.ArrowMemoryError)) or \
            any(w in str(e) for w in ("Out of Memory", "failed to pin block", "could not allocate block")):
        return (f"{path}: out of memory while writing it to the store ({first}); ingest it with fewer "
                "--workers, or on a machine with more memory")
    return f"{path}: store write failed ({first})"


def rollback(con: duckdb.DuckDBPyConnection) -> None:
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass  # a failed COMMIT has already rolled back


def _insert(con: duckdb.DuckDBPyConnection, table: str, src: pa.Table | RankDependent, run_id: str,
            rank: int | None) -> None:
    """Append a parsed table with its run (and rank, unless it has its own)."""
    if isinstance(src, RankDependent):
        src = src.build(rank)
    cols = [c for c in schema.columns(table) if c in src.column_names]
    fill = ["run_id"] + (["rank"] if "rank" in schema.columns(table) and "rank" not in cols else [])
    params = {"run_id": run_id} | ({"rank": rank} if "rank" in fill else {})
    select = ", ".join([f"${c}" for c in fill] + [f'"{c}"' for c in cols])
    con.register("_tk_incoming", src)
    try:
        con.execute(f"INSERT INTO main.{table} ({', '.join(fill + cols)}) SELECT {select} FROM _tk_incoming", params)
    finally:
        try:
            con.unregister("_tk_incoming")
        except duckdb.Error:  # the failed insert aborted the transaction; its error is the one to report
            pass


def check_ranks(path: Path, parsed: Parsed, rank: int | None) -> None:
    """A file's rank, world size and group members: never negative, and within the limit
    max_world_size (a claimed world of a million ranks would make the run's topology a million
    rows). A group member past the file's own world size is left to the run's warnings."""
    if rank is not None and rank < 0:
        raise IngestError(f"{path}: rank {rank} is negative")
    world = parsed.world_size
    if world is not None:
        if world <= 0:
            raise IngestError(f"{path}: world size {world} is not positive")
        limits.check(path, "max_world_size", world, f"the file claims a world of {world:,} ranks")
    for g in parsed.groups:
        members = [int(r) for r in g["ranks"]]
        if members and min(members) < 0:
            raise IngestError(f"{path}: process group {g.get('pg_name')!r} names rank {min(members)}, negative")
        if members:
            limits.check(path, "max_world_size", max(members) + 1,
                         f"process group {g.get('pg_name')!r} names rank {max(members):,}")


def _resolve_rank(parsed: Parsed, job: rundir.Job) -> int:
    """distributedInfo, else the manifest (by pid), else the file name, in that order."""
    if parsed.rank is not None:
        return parsed.rank
    if job.manifest is not None:
        for pid in parsed.pids:
            if pid in job.manifest.pid_rank:
                return job.manifest.pid_rank[pid]
    r = rundir.rank_from_name(job.path)
    if r is None:
        raise IngestError(f"{job.path}: cannot tell which rank this {parsed.format} file belongs to "
                          "(no distributedInfo, no manifest pid, no rank in the file name)")
    return r
