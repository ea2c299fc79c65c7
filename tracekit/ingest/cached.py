"""Where a run directory's store lives when a command is given the directory instead of a store.

A Parquet dataset directory (tracekit.dataset: it holds ``_tracekit_dataset.json``) is a store, not
a run directory: :func:`is_store` says which paths are read as they are.

Every command that takes a run directory (``report``, ``stragglers``, ``steps``, ``cp-wait``,
``hangs``, ``demo``, ``dashboard``) ingests it into the store :func:`store_for` names and reads
that; files already ingested are skipped, so a second command on the same directory is fast. A
directory that lost a file, or whose file now fails, since its store was made gets its store made
again (:func:`outdated`): an ingest never drops a file's rows on its own.

The place: ``<dir>.tracekit.duckdb`` beside the directory, so that the run directory itself is
never written to (it may be a read-only copy of a job's output, and a store inside it would be
one more file for the next ingest to pass over). Where the parent cannot be written, a fresh
temporary store is used (ingested again by every command). ``--store PATH`` names any other.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

STORE_SUFFIX = ".tracekit.duckdb"


def is_store(path: Path) -> bool:
    """A store to read as it is: a file (a DuckDB store) or a dataset directory (its marker present,
    even damaged, or its layout without the marker: opening it then says what is wrong); any other
    directory is a run to ingest."""
    from tracekit.dataset import is_dataset, looks_like_dataset

    return not path.is_dir() or is_dataset(path) or looks_like_dataset(path)


def store_for(run_dir: Path, store: Path | None = None) -> Path:
    """The store ``run_dir`` is ingested into: ``store`` when given, else ``<dir>.tracekit.duckdb``
    beside it, else (a read-only parent) a temporary one."""
    if store is not None:
        return store
    run_dir = run_dir.absolute()  # "." has no name; its absolute path does
    probe = run_dir.parent / f".{run_dir.name}.tracekit.probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
        return run_dir.parent / f"{run_dir.name}{STORE_SUFFIX}"
    except OSError:
        return temporary_store(run_dir)


def temporary_store(run_dir: Path) -> Path:
    """A fresh store in a new temporary folder, for a run directory whose store cannot be written."""
    return Path(tempfile.mkdtemp(prefix="tracekit-")) / f"{run_dir.absolute().name}.duckdb"


def outdated(store_path: Path, report) -> bool:
    """Whether the cached store holds rows that the directory no longer gives: a file of a (format,
    rank) ingested before is gone, or now fails (``report``: the ingest just made of the whole
    directory, whose unchanged files were skipped). An ingest adds and replaces files but never
    drops one; a run directory's own store must then be made again, or a rank whose trace was
    removed (or cut short) would still be analysed from its old rows."""
    import duckdb

    if not report.files:
        return False
    current: dict[str, set[tuple[str, int]]] = {}
    for f in report.files:
        if f.status in ("ok", "skipped") and f.rank is not None and f.format is not None:
            current.setdefault(f.run_id, set()).add((f.format, int(f.rank)))
    con = duckdb.connect(str(store_path), read_only=True)
    try:
        for rid in {f.run_id for f in report.files}:
            held = con.execute("SELECT DISTINCT format, rank FROM ingest_log WHERE run_id = ? AND status = 'ok' "
                               "AND rank IS NOT NULL AND format IS NOT NULL", [rid]).fetchall()
            if {(fmt, int(r)) for fmt, r in held} - current.get(rid, set()):
                return True
    finally:
        con.close()
    return False
