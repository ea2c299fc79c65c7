"""Ingest into a Parquet dataset (tracekit.dataset), one task per file or batch of small files, in
threads here or as Ray tasks on a cluster (``engine="ray"``).

A task parses its files with the local ingest's own code (parse.run, the rank rules of commit.py)
and writes each file's rows as one part of the dataset, named after the file's path: written again,
the part is replaced, so a task that is retried or a file ingested again never doubles rows. Only
then is the file's done record written (``_ingest/<part>.json``: path, size, mtime, content hash);
a later ingest skips a file whose record matches its path, size and mtime, so an interrupted ingest
resumes where it stopped. A file that fails gets a ``failed`` row in ``ingest_log`` with its reason
and no done record (it is tried again next time); the others go on. What spans files is decided by
the driver after the tasks, from the written parts: the same content under two paths (the later
one is skipped), two files for one rank (the later one fails), and each run's ``runs``, ``ranks``
and ``groups`` (topo.finalize, as the local ingest computes them, on in-memory copies).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import duckdb
import pyarrow as pa
import xxhash

from tracekit import dataset, schema
from tracekit.ingest import commit, rundir, topo
from tracekit.ingest import parse as parse_mod
from tracekit.ingest.commit import FileResult
from tracekit.ingest.common import IngestError, RankDependent
from tracekit.ingest.pipeline import IngestReport, Progress

DONE_DIR = "_ingest"
BATCH_BYTES = 32 << 20  # files smaller than this share a task, up to BATCH_FILES of them
BATCH_FILES = 16
RUN_PART = "run"  # the part holding what the driver computes for a run (runs, ranks, groups, warnings)


@dataclass
class Done:
    """What a task did with one file (the done record of an ingested one)."""

    path: str
    part: str
    run_id: str
    size: int
    mtime_ns: int
    status: str  # ok | failed | ignored
    format: str | None = None
    rank: int | None = None
    content_hash: str | None = None
    error: str | None = None
    rows: int = 0
    seconds: float = 0.0
    logged: bool = True  # its ingest_log row is written (False: its task died; the driver writes it)


def part_name(path: Path) -> str:
    """The part a file's rows are written as: a hash of its absolute path."""
    return "f" + xxhash.xxh3_64_hexdigest(str(path.absolute()).encode())


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return -1, -1


_local = threading.local()


def _cursor() -> duckdb.DuckDBPyConnection:
    """This thread's DuckDB connection, for parse.run's JSON reader where the scanner is not built
    (a connection costs 25 ms to open: once per worker thread, not once per file)."""
    con = getattr(_local, "con", None)
    if con is None:
        con = _local.con = duckdb.connect(":memory:")
    return con


def ingest_file(job: rundir.Job, out_dir: str) -> Done:
    """Parse one file and write its part; never raises for a bad file (the Done says why)."""
    size, mtime = _stat(job.path)
    part = part_name(job.path)
    out = parse_mod.run(job.path, job.explicit, frozenset(), _cursor(), None)
    done = Done(str(job.path), part, job.run_id, size, mtime, out.status, out.format, None, out.content_hash,
                out.error, 0, out.seconds)
    if out.status == "ignored":
        return done
    tables: dict[str, pa.Table] = {}
    if out.status == "ok" and out.parsed is not None:
        parsed = out.parsed
        try:
            done.rank = None if parsed.multi_rank else commit._resolve_rank(parsed, job)
            commit.check_ranks(job.path, parsed, done.rank)
            tables = {t: _with_rank(t, tbl, done.rank) for t, tbl in parsed.tables.items()}
            tables["file_meta"] = _file_meta(job, parsed, done.rank)
            done.rows = parsed.rows
        except IngestError as e:
            done.status, done.error, tables = "failed", str(e), {}
    if done.status != "ok" and done.error is None:
        done.error = f"{job.path}: failed"
    tables["ingest_log"] = _log_row(done)
    # an ingested file: every table it could have written, so that a new version of it leaves none of
    # the old version's rows; a failed one: its log row only (rows of an earlier version stay)
    written = {t: tables.get(t, pa.table({})) for t in schema.TABLES if t not in ("runs", "ranks", "groups")} \
        if done.status == "ok" else {"ingest_log": tables["ingest_log"]}
    try:
        dataset.write_tables(out_dir, written, part, job.run_id)
        if done.status == "ok":
            _write_done(Path(out_dir), done)
    except (OSError, pa.ArrowException, ValueError) as e:
        done.status, done.error = "failed", f"{job.path}: writing its part of {out_dir} failed ({e})"
    return done


def _log_row(done: Done) -> pa.Table:
    return pa.table({"path": [done.path], "format": [done.format], "rank": pa.array([done.rank], pa.int32()),
                     "content_hash": [done.content_hash], "status": [done.status], "error": [done.error],
                     "rows": [done.rows], "seconds": [done.seconds],
                     "ingested_at": pa.array([time.time_ns() // 1000], pa.timestamp("us"))})


def ingest_batch(jobs: list[rundir.Job], out_dir: str) -> list[Done]:
    """The task: each file of a batch in turn (a Ray remote function's body)."""
    return [ingest_file(job, out_dir) for job in jobs]


def _with_rank(table: str, src: pa.Table | RankDependent, rank: int | None) -> pa.Table:
    """A parsed table with its rank filled in, as commit._insert does (run_id comes with the write)."""
    if isinstance(src, RankDependent):
        src = src.build(rank)
    if "rank" in schema.columns(table) and "rank" not in src.column_names:
        src = src.append_column("rank", pa.repeat(pa.scalar(rank, pa.int32()), src.num_rows))
    return src


def _file_meta(job: rundir.Job, parsed, rank: int | None) -> pa.Table:
    groups = [{"pg_name": g.get("pg_name"), "pg_desc": g.get("pg_desc"), "ranks": [int(r) for r in g["ranks"]]}
              for g in parsed.groups]
    return pa.table({"path": [str(job.path)], "rank": pa.array([rank], pa.int32()),
                     "world_size": pa.array([parsed.world_size], pa.int32()), "backend": [parsed.backend],
                     "pid": pa.array([parsed.pids[0] if rank is not None and parsed.pids else None], pa.int64()),
                     "groups": [json.dumps(groups)]})


def _write_done(out: Path, done: Done) -> None:
    d = out / DONE_DIR
    d.mkdir(exist_ok=True)
    tmp = d / f".{done.part}.json.tmp"
    tmp.write_text(json.dumps(done.__dict__))
    os.replace(tmp, d / f"{done.part}.json")


def _read_done(out: Path, part: str) -> Done | None:
    try:
        return Done(**json.loads((out / DONE_DIR / f"{part}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None  # none, or damaged: the file is ingested again


def batches(jobs: list[rundir.Job]) -> list[list[rundir.Job]]:
    """Jobs in tasks: a large file alone, small ones together (a task costs a scheduling round)."""
    left = deque(jobs)
    out: list[list[rundir.Job]] = []
    while left:
        out.append(take_batch(left))
    return out


def take_batch(left: deque[rundir.Job]) -> list[rundir.Job]:
    """The next task's jobs, taken from the front of ``left``: files up to BATCH_BYTES together, at
    most BATCH_FILES of them, and a larger file alone."""
    out: list[rundir.Job] = []
    size = 0
    while left:
        s = max(_stat(left[0].path)[0], 0)
        if out and (size + s > BATCH_BYTES or len(out) >= BATCH_FILES):
            break
        out.append(left.popleft())
        size += s
    return out


def _run_local(work: list[list[rundir.Job]], out_dir: str, workers: int) -> Iterator[list[Done]]:
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tk-dataset") as pool:
        futures = [pool.submit(ingest_batch, b, out_dir) for b in work]
        try:
            for f in as_completed(futures):
                yield f.result()
        finally:
            for f in futures:
                f.cancel()


def ingest(paths: list[str | Path], out_dir: str | Path, run_id: str | None = None, engine: str = "local",
           workers: int | None = None, address: str | None = None, progress: Progress | None = None) -> IngestReport:
    """Ingest files and run directories into the dataset at ``out_dir`` (created if new); never
    raises for bad files. ``engine``: "local" (threads) or "ray" (one Ray task per file or batch of
    small files, on the cluster at ``address`` or RAY_ADDRESS, else on a Ray started on this machine for the
    command: ``_ray_stream``)."""
    t0 = time.perf_counter()
    out = dataset.create(out_dir)
    jobs = rundir.collect([Path(p) for p in paths], run_id)
    jobs = [j for j in jobs if not _inside_dataset(j.path, out)]
    report = IngestReport()
    todo: list[rundir.Job] = []
    results: dict[str, FileResult | None] = {}
    for job in jobs:
        prev = _read_done(out, part_name(job.path))
        if prev is not None and prev.status in ("ok", "skipped") and prev.run_id == job.run_id \
                and (prev.size, prev.mtime_ns) == _stat(job.path):
            why = "already ingested (same path, size and time)" if prev.status == "ok" else \
                "already ingested (same content)"
            results[str(job.path)] = FileResult(job.path, job.run_id, prev.format, prev.rank, "skipped", why, 0, 0.0)
        else:
            todo.append(job)
    note = None
    if engine == "ray":
        stream, note = _ray_stream(todo, str(out), address, workers)
    elif engine == "local":
        work = batches(todo)
        stream = _run_local(work, str(out), max(1, workers or min(len(work), os.cpu_count() or 1)))
    else:
        raise ValueError(f"unknown engine {engine!r} (local or ray)")
    by_path = {str(j.path): j for j in jobs}
    done_n = len(results)
    for finished in stream:
        for d in finished:
            job = by_path[d.path]
            if not d.logged:
                dataset.write_tables(out, {"ingest_log": _log_row(d)}, d.part, d.run_id)
            results[d.path] = None if d.status == "ignored" else FileResult(
                job.path, d.run_id, d.format, d.rank, d.status, d.error, d.rows, d.seconds)
            done_n += 1
            if progress is not None:
                progress(done_n, len(jobs), job.path, d.status)
    if note is not None:
        report.warnings.append(note)
    _settle_duplicates(out, jobs, results)
    # the runs that hold a file of this ingest (as the local ingest: a run of failed files only is not one)
    held = [r for r in results.values() if r is not None and r.status in ("ok", "skipped")]
    for rid in dict.fromkeys(r.run_id for r in held):
        manifest = next((j.manifest for j in jobs if j.run_id == rid and j.manifest is not None), None)
        rb = topo.RunBatch(rid, manifest, touched=True)
        report.missing.update(finalize(out, rb))
        report.warnings.extend(f"{rid}: {w}" for w in rb.warnings)
        report.runs.append(rid)
    for job in jobs:
        res = results.get(str(job.path))
        if res is None:
            report.ignored.append(job.path)
        else:
            report.files.append(res)
    report.bytes_ingested = sum(max(_stat(f.path)[0], 0) for f in report.ok)
    report.seconds = time.perf_counter() - t0
    return report


def _ray_stream(todo: list[rundir.Job], out_dir: str, address: str | None,
                workers: int | None) -> tuple[Iterator[list[Done]], str | None]:
    """The ray engine's stream, and a line to report: tasks on the Ray this process is connected
    to or the cluster at ``address`` (or RAY_ADDRESS), else on a Ray started here for the command;
    if that Ray cannot start, this process's threads ingest every file, and the line says so. With
    nothing to do (a re-run), no Ray is started."""
    import sys

    from tracekit.ingest import on_ray

    if not todo:
        return iter(()), None
    ray = sys.modules.get("ray")
    if not ((ray is not None and ray.is_initialized()) or address is not None or os.environ.get("RAY_ADDRESS")):
        why = on_ray.start_here()
        if why is not None:
            work = batches(todo)
            return (_run_local(work, out_dir, max(1, workers or min(len(work), os.cpu_count() or 1))),
                    f"Ray did not start ({why}): all files were ingested by this process")
    return on_ray.run_ray(batches(todo), out_dir, address), None


def _inside_dataset(path: Path, out: Path) -> bool:
    try:
        path.absolute().relative_to(out.absolute())
        return True
    except ValueError:
        return False


def _settle_duplicates(out: Path, jobs: list[rundir.Job], results: dict[str, FileResult | None]) -> None:
    """The checks the local ingest's ledger makes, here after the tasks: per run, content already
    held by another file is skipped, and a rank whose format another file already holds fails;
    the earlier file (in input order, after those of earlier ingests) keeps its rows."""
    con = dataset.connect(out)
    try:
        rows = con.execute("SELECT run_id, path, format, rank, content_hash FROM ingest_log "
                           "WHERE status = 'ok'").fetchall()
    finally:
        con.close()
    order = {str(j.path): i for i, j in enumerate(jobs)}
    rows.sort(key=lambda r: (r[1] in order, order.get(r[1], 0), r[1]))  # earlier ingests' files first
    content: set[tuple] = set()
    holders: dict[tuple, str] = {}
    for rid, path, fmt, rank, digest in rows:
        why = status = None
        if digest is not None and (rid, digest) in content:
            status, why = "skipped", "already ingested (same content)"
        elif rank is not None and (rid, fmt, rank) in holders:
            status = "failed"
            why = (f"{path}: duplicate rank {rank} in run {rid!r}: {fmt} data for it was already ingested "
                   f"from {holders[(rid, fmt, rank)]}")
        if status is None:
            if digest is not None:
                content.add((rid, digest))
            if rank is not None:
                holders[(rid, fmt, rank)] = path
            continue
        part = part_name(Path(path))
        dataset.remove_part(out, part, rid)
        record = _read_done(out, part)
        if status == "skipped" and record is not None:  # a re-run skips it again, unread
            record.status = "skipped"
            _write_done(out, record)
        else:  # a duplicate rank: tried again next time (the other file may be gone by then)
            (out / DONE_DIR / f"{part}.json").unlink(missing_ok=True)
        log = _log_row(Done(path, part, rid, 0, 0, status, fmt, rank, digest, why))
        dataset.write_tables(out, {"ingest_log": log}, part, rid)
        prev = results.get(path)
        if prev is not None:
            prev.status, prev.error, prev.rows = status, why, 0


def finalize(out: Path, rb: topo.RunBatch) -> dict[tuple[str, str], list[int]]:
    """topo.finalize for one run of the dataset: on in-memory copies of the run's small tables (and
    a view of its p2p), then written back as the run's part ``run`` of runs, ranks, groups and the
    run's warnings in ingest_log."""
    con = duckdb.connect(":memory:")
    try:
        for t in ("runs", "ranks", "groups", "file_meta", "ingest_log"):
            con.execute(schema.create_sql(t))
            src = dataset.table_sql(out, t)
            con.execute(f"INSERT INTO {t} SELECT * FROM ({src}) WHERE run_id = ?", [rb.run_id])
        con.execute(f"CREATE VIEW p2p AS {dataset.table_sql(out, 'p2p')}")
        missing = topo.finalize(con, rb)
        for t in ("runs", "ranks", "groups"):
            rows = con.sql(f"SELECT * FROM {t} WHERE run_id = $r", params={"r": rb.run_id}).to_arrow_table()
            dataset.replace_run_table(out, t, rb.run_id, rows, RUN_PART)
        warnings = con.sql("SELECT * FROM ingest_log WHERE run_id = $r AND status = 'warning'",
                           params={"r": rb.run_id}).to_arrow_table()
        dataset.write_tables(out, {"ingest_log": warnings}, RUN_PART, rb.run_id)
    finally:
        con.close()
    return missing
