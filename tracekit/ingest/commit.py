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
import numpy as np
import pyarrow as pa

from tracekit import schema
from tracekit.ingest import parse as parse_mod
from tracekit.ingest import columns, limits, rundir, topo
from tracekit.ingest.common import IngestError, Parsed, RankDependent, crash_point
from tracekit.ingest.ledger import Claim, Ledger, RankTaken, SameContent

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
    rank_holder: str | None = None  # failed because this file holds its rank


LOG_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, now())"


def _log(con: "duckdb.DuckDBPyConnection | Staged", run_id: str, path: Path, fmt: str | None, rank: int | None,
         digest: str | None, status: str, error: str | None, rows: int, seconds: float) -> None:
    _values(con, "ingest_log", LOG_ROW, [run_id, str(path), fmt, rank, digest, status, error, rows, seconds])


def _values(con: "duckdb.DuckDBPyConnection | Staged", table: str, row: str, params: list) -> None:
    """One row of ``table`` (``row``: its VALUES tuple with parameters), now or staged."""
    if isinstance(con, Staged):
        con.add_values(table, row, params)
    else:
        con.execute(f"INSERT INTO {table} VALUES {row}", params)


def failed(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome, msg: str,
           rank: int | None = None) -> Applied:
    _log(con, job.run_id, job.path, out.format, rank, out.content_hash, "failed", msg, 0, out.seconds)
    return Applied(FileResult(job.path, job.run_id, out.format, rank, "failed", msg, 0, out.seconds))


def _skipped(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome, fmt: str | None,
             rank: int | None, why: str) -> Applied:
    _log(con, job.run_id, job.path, fmt, rank, out.content_hash, "skipped", why, 0, out.seconds)
    return Applied(FileResult(job.path, job.run_id, fmt, rank, "skipped", why, 0, out.seconds))


def apply(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome, ledger: Ledger,
          staged: "Staged | None" = None) -> Applied:
    """Write one file's outcome. Raises StoreWriteError only for a failed store write, which leaves
    the caller's transaction unusable (the file's ledger claim is already taken back); a bad file is
    logged and returned as failed. With ``staged``, the file's parsed tables are staged there, to be
    written with the other files of the transaction (``Staged.write``), rather than now."""
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
    except RankTaken as e:
        done = failed(con, job, out, str(e), rank)
        done.rank_holder = e.holder
        return done
    except IngestError as e:
        return failed(con, job, out, str(e), rank)
    replace = claim.replace
    try:
        if staged is not None and (replace or parsed.multi_rank):
            staged.write(con)  # the staged files' rows go in before this file's deletes, as they came
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
            _insert(con if staged is None else staged, t, tbl, job.run_id, rank)
        target = con if staged is None else staged
        for g in claim.new_groups:
            _values(target, "groups", topo.GROUP_ROW, topo.group_values(job.run_id, g))
        _values(target, "file_meta", topo.FILE_META_ROW, topo.file_meta_values(job.run_id, job.path, parsed, rank))
        _log(target, job.run_id, job.path, parsed.format, rank, out.content_hash, "ok", None, parsed.rows,
             out.seconds)
    except (duckdb.Error, pa.ArrowException) as e:
        ledger.release(claim)
        raise StoreWriteError(write_failed(job.path, e), rank) from e
    except BaseException:
        ledger.release(claim)
        raise
    return Applied(FileResult(job.path, job.run_id, parsed.format, rank, "ok", None, parsed.rows, out.seconds),
                   parsed, claim)


def evict(con: duckdb.DuckDBPyConnection, run_id: str, fmt: str, rank: int, path: Path, why: str) -> None:
    """Take an ingested file's rows out again and log it as failed (in the caller's transaction)."""
    for t, extra in OWNED[fmt].items():
        con.execute(f"DELETE FROM {t} WHERE run_id = ? AND rank = ? {extra}", [run_id, rank])
    con.execute("DELETE FROM file_meta WHERE run_id = ? AND path = ?", [run_id, str(path)])
    con.execute("UPDATE ingest_log SET status = 'failed', error = ?, rows = 0 "
                "WHERE run_id = ? AND path = ? AND status = 'ok'", [why, run_id, str(path)])


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


class Staged:
    """Parsed tables of several files of one transaction, written per table in one INSERT each:
    an INSERT of Arrow rows costs about 0.7 ms whatever its size, four a trace. The rows carry
    their run and rank as columns, and keep the order in which they were staged."""

    def __init__(self) -> None:
        self.tables: dict[str, list[pa.Table]] = {}
        self.values: dict[tuple[str, str], list[list]] = {}  # (table, VALUES tuple) -> parameters of each row

    def add(self, table: str, rows: pa.Table) -> None:
        self.tables.setdefault(table, []).append(rows)

    def add_values(self, table: str, row: str, params: list) -> None:
        self.values.setdefault((table, row), []).append(params)

    def write(self, con: duckdb.DuckDBPyConnection) -> None:
        """Insert what is staged (then nothing is). Raises StoreWriteError naming no one file: the
        caller redoes the files one by one to find which."""
        tables, self.tables = self.tables, {}
        values, self.values = self.values, {}
        try:
            for (table, row), rows in values.items():  # the files' small rows, one INSERT a table
                con.execute(f"INSERT INTO {table} VALUES {', '.join([row] * len(rows))}", [p for r in rows for p in r])
            for table, parts in tables.items():
                start = 0
                for i in range(1, len(parts) + 1):  # runs of parts with one schema, each one INSERT
                    if i == len(parts) or parts[i].schema != parts[start].schema:
                        _write(con, table, pa.concat_tables(parts[start:i]) if i - start > 1 else parts[start])
                        start = i
        except (duckdb.Error, pa.ArrowException) as e:
            raise StoreWriteError(f"store write of a batch of files failed ({str(e).splitlines()[0]})", None) from e


def _insert(con: "duckdb.DuckDBPyConnection | Staged", table: str, src: pa.Table | RankDependent, run_id: str,
            rank: int | None) -> None:
    """Append a parsed table with its run (and rank, unless it has its own), now or to ``con``'s
    staged rows."""
    if isinstance(src, RankDependent):
        src = src.build(rank)
    names = schema.columns(table)
    cols = [c for c in names if c in src.column_names]
    n = src.num_rows
    rows = src.select(cols).append_column("run_id", _constant_text(run_id, n))
    if "rank" in names and "rank" not in cols:
        rows = rows.append_column("rank", pa.nulls(n, pa.int32()) if rank is None
                                  else columns.from_numpy(np.full(n, rank, dtype=np.int32)))
    if isinstance(con, Staged):
        con.add(table, rows)
    else:
        _write(con, table, rows)


def _constant_text(value: str, n: int) -> pa.Array:
    """``value`` in ``n`` rows, as a dictionary of one value (no copy of the text per row)."""
    return pa.DictionaryArray.from_arrays(columns.from_numpy(np.zeros(n, dtype=np.int32)),
                                          columns.from_values([value], pa.string()))


def _write(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
    names = ", ".join(f'"{c}"' for c in rows.column_names)
    con.register("_tk_incoming", rows)
    try:
        con.execute(f"INSERT INTO main.{table} ({names}) SELECT {names} FROM _tk_incoming")
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
