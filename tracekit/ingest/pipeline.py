"""Ingest orchestration: parallel parsing, one transaction per file, a log of what happened.

Workers (a process pool) hash, sniff and parse files into Arrow tables; this process, the store's
only writer, commits each file atomically (its rows, its groups and its ``ingest_log`` row, or
nothing). A failure is logged with its reason and the other files still go in. Re-ingesting
content already in a run is skipped (content hash); a second file claiming a rank that another file
of the same format already holds is refused; ranks missing from a run are reported. After the
files, each touched run's ``runs``, ``ranks`` and ``groups.dim`` are recomputed from the store.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import duckdb
import pyarrow as pa

from tracekit import schema, store
from tracekit.ingest import parse as parse_mod
from tracekit.ingest import rundir, topo
from tracekit.ingest.common import IngestError, Parsed

POOL_MIN_BYTES = 32 << 20  # below this, starting worker processes costs more than it saves
Progress = Callable[[int, int, Path, str], None]  # (done, total, path, status)

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


@dataclass
class IngestReport:
    files: list[FileResult] = field(default_factory=list)
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
    con = store.connect(store_path)
    report = IngestReport()
    try:
        known: dict[str, set[str]] = {}
        for rid, h in con.execute("SELECT run_id, content_hash FROM ingest_log WHERE status = 'ok'").fetchall():
            known.setdefault(rid, set()).add(h)
        batch: dict[str, topo.RunBatch] = {}
        for done, (job, out) in enumerate(_outcomes(jobs, known, workers, optable_reader), 1):
            rb = batch.setdefault(job.run_id, topo.RunBatch(job.run_id, job.manifest))
            res = _commit(con, job, out, rb)
            if res is not None:
                report.files.append(res)
                if res.status == "ok":
                    known.setdefault(job.run_id, set()).add(out.content_hash or "")
            if progress is not None:
                progress(done, len(jobs), job.path, res.status if res else "ignored")
        for rid, rb in batch.items():
            if rb.touched:
                report.missing.update(topo.finalize(con, rb))
                report.runs.append(rid)
    finally:
        con.close()
    return report


def _outcomes(jobs: list[rundir.Job], known: dict[str, set[str]], workers: int | None,
              reader: parse_mod.OptableReader | None) -> Iterator[tuple[rundir.Job, parse_mod.Outcome]]:
    """Parse results in completion order, at most ``2 * workers`` in flight (bounded memory)."""
    n = workers or min(len(jobs), os.cpu_count() or 1)

    def args(j: rundir.Job) -> tuple:
        return (j.path, j.explicit, frozenset(known.get(j.run_id, ())), reader)

    small = sum(j.path.stat().st_size for j in jobs if j.path.is_file()) < POOL_MIN_BYTES
    if n <= 1 or len(jobs) <= 1 or (workers is None and small):
        for j in jobs:
            yield j, parse_mod.run(*args(j))
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a process holding a DuckDB connection
    left = list(jobs)
    try:
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            pending: dict[Future, rundir.Job] = {}
            queue = iter(jobs)
            for j in queue:
                pending[pool.submit(parse_mod.run, *args(j))] = j
                if len(pending) >= 2 * n:
                    break
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    j = pending.pop(fut)
                    out = fut.result()
                    nxt = next(queue, None)
                    if nxt is not None:
                        pending[pool.submit(parse_mod.run, *args(nxt))] = nxt
                    left.remove(j)
                    yield j, out
    except BrokenProcessPool:
        # A worker died (killed for memory, crashed): parse what is left here, one at a time.
        for j in left:
            yield j, parse_mod.run(*args(j))


def _log(con: duckdb.DuckDBPyConnection, run_id: str, path: Path, fmt: str | None, rank: int | None,
         digest: str | None, status: str, error: str | None, rows: int, seconds: float) -> None:
    con.execute("INSERT INTO ingest_log VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, now())",
                [run_id, str(path), fmt, rank, digest, status, error, rows, seconds])


def _commit(con: duckdb.DuckDBPyConnection, job: rundir.Job, out: parse_mod.Outcome,
            rb: topo.RunBatch) -> FileResult | None:
    if out.status == "ignored":
        return None
    if out.status == "skipped":
        rb.touched = True  # the run's tables are recomputed; its content is already in the store
        prev = con.execute("SELECT format, rank FROM ingest_log WHERE run_id = ? AND content_hash = ? "
                           "AND status = 'ok' LIMIT 1", [job.run_id, out.content_hash]).fetchall()
        fmt, rank = prev[0] if prev else (None, None)
        _log(con, job.run_id, job.path, fmt, rank, out.content_hash, "skipped", out.error, 0, out.seconds)
        return FileResult(job.path, job.run_id, fmt, rank, "skipped", out.error, 0, out.seconds)
    rank = None
    try:
        if out.status != "ok":
            raise IngestError(out.error or f"{job.path}: failed")
        parsed = out.parsed
        assert parsed is not None
        rank = None if parsed.multi_rank else _resolve_rank(parsed, job)
        replace = _check_duplicate(con, job, parsed.format, rank)
        con.execute("BEGIN TRANSACTION")
        try:
            if replace:
                for t, extra in OWNED[parsed.format].items():
                    con.execute(f"DELETE FROM {t} WHERE run_id = ? AND rank = ? {extra}", [job.run_id, rank])
                con.execute("DELETE FROM ingest_log WHERE run_id = ? AND path = ? AND status = 'ok'",
                            [job.run_id, str(job.path)])
            if parsed.multi_rank:
                for t in parsed.tables:
                    con.execute(f"DELETE FROM {t} WHERE run_id = ?", [job.run_id])
            for t, tbl in parsed.tables.items():
                _insert(con, t, tbl, job.run_id, rank)
            topo.add_groups(con, job.run_id, parsed.groups)
            _log(con, job.run_id, job.path, parsed.format, rank, out.content_hash, "ok", None,
                 parsed.rows, out.seconds)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        rb.note(parsed, rank)
        return FileResult(job.path, job.run_id, parsed.format, rank, "ok", None, parsed.rows, out.seconds)
    except (IngestError, duckdb.Error, pa.ArrowException) as e:
        msg = str(e) if isinstance(e, IngestError) else f"{job.path}: store write failed ({e})"
        _log(con, job.run_id, job.path, out.format, rank, out.content_hash, "failed", msg, 0, out.seconds)
        return FileResult(job.path, job.run_id, out.format, rank, "failed", msg, 0, out.seconds)


def _insert(con: duckdb.DuckDBPyConnection, table: str, tbl: pa.Table, run_id: str, rank: int | None) -> None:
    if table not in schema.TABLES:
        raise IngestError(f"parser produced unknown table {table!r}")
    cols = [c for c in schema.columns(table) if c in tbl.column_names]
    fill = ["run_id"] + (["rank"] if "rank" in schema.columns(table) and "rank" not in tbl.column_names else [])
    con.register("_tk_incoming", tbl)
    try:
        select = ", ".join(["?"] * len(fill) + [f'"{c}"' for c in cols])
        params = [run_id] + ([rank] if len(fill) == 2 else [])
        con.execute(f"INSERT INTO {table} ({', '.join(fill + cols)}) SELECT {select} FROM _tk_incoming", params)
    finally:
        con.unregister("_tk_incoming")


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


def _check_duplicate(con: duckdb.DuckDBPyConnection, job: rundir.Job, fmt: str, rank: int | None) -> bool:
    """True if this path replaces its own earlier version; raises if another file holds the rank."""
    if rank is None:
        return False
    rows = con.execute("SELECT DISTINCT path FROM ingest_log WHERE run_id = ? AND format = ? AND rank = ? "
                       "AND status = 'ok'", [job.run_id, fmt, rank]).fetchall()
    others = [p for (p,) in rows if p != str(job.path)]
    if others:
        raise IngestError(f"{job.path}: duplicate rank {rank} in run {job.run_id!r}: "
                          f"{fmt} data for it was already ingested from {others[0]}")
    return bool(rows)
