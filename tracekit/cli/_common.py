"""What every command shares: the exit codes, the one-line error, Ctrl-C, the ingest progress bar and
the store behind a store-or-run-directory argument."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn

EXIT_OK, EXIT_FINDING, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it

Progress = Callable[[int, int, Path, str], None]  # (done, total, file, status), as ingest() calls it


def interrupted() -> NoReturn:
    """Ctrl-C: one line, exit code 130 (what a shell reports), no traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    if _threads_left():
        os._exit(EXIT_INTERRUPTED)
    sys.exit(EXIT_INTERRUPTED)


def _threads_left() -> bool:
    """Threads other than this one still running (a server's): exit without waiting for them."""
    import threading

    return any(t is not threading.current_thread() and t.is_alive() and not t.daemon for t in threading.enumerate())


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr and exit with EXIT_BAD_INPUT."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}", highlight=False)
    sys.exit(EXIT_BAD_INPUT)


@contextmanager
def ingest_progress(quiet: bool = False) -> Iterator[Progress | None]:
    """A transient progress bar on stderr (only on a terminal, never when ``quiet``); yields the
    callback to hand to :func:`tracekit.ingest.ingest` (None when ``quiet``: rich is not even
    imported, 20 ms of a command's start)."""
    if quiet:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    err = Console(stderr=True)
    with Bar(TextColumn("ingest"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
             TextColumn("{task.description}"), console=err, transient=True,
             disable=quiet or not err.is_terminal) as bar:
        task = bar.add_task("", total=None)
        yield lambda done, total, path, status: bar.update(task, completed=done, total=total,
                                                           description=path.name)


def store_of(source: Path, run_id: str | None = None, quiet: bool = False, store: Path | None = None,
             warn: Callable[[str], None] | None = None) -> tuple[Path, str | None]:
    """(store, run id) for what a command was given: a store file or dataset directory as it is, or a run directory
    ingested (progress bar unless ``quiet``) into ``store``, by default the one
    tracekit.ingest.cached.store_for names. A store that cannot be written (a read-only ``--store``
    or a read-only cached one) gives way to a temporary store, said through ``warn``. Files that
    failed are said through ``warn``; nothing ingested at all is an error (exit 2)."""
    from tracekit.ingest import ingest
    from tracekit.ingest.cached import is_store, outdated, store_for, temporary_store
    from tracekit.ingest.common import IngestError
    from tracekit.store import StoreError

    if not source.exists():
        fail(f"{source}: no such file or directory")
    if is_store(source):  # a DuckDB file or a Parquet dataset directory
        return source, run_id
    store_path = store_for(source, store)
    with ingest_progress(quiet) as progress:
        try:
            try:
                report = ingest([source], store_path, run_id=run_id, progress=progress)
            except StoreError as e:  # read-only or held by another process: read a fresh copy instead
                fallback = temporary_store(source)
                if warn is not None:
                    warn(f"{e}; using a temporary store, {fallback}")
                store_path = fallback
                report = ingest([source], store_path, run_id=run_id, progress=progress)
            if store is None and store_path.exists() and outdated(store_path, report):
                # the directory lost or broke files since its store was made: make it again
                if warn is not None:
                    warn(f"{source}: files ingested before are gone or now fail; making {store_path.name} again")
                for stale in (store_path, store_path.with_name(store_path.name + ".wal")):
                    stale.unlink(missing_ok=True)
                report = ingest([source], store_path, run_id=run_id, progress=progress)
        except (IngestError, StoreError) as e:
            fail(str(e))
    ok = [f for f in report.files if f.status in ("ok", "skipped")]
    if not ok:
        errors = "; ".join(f.error or f.status for f in report.failed) or "no traces, dumps or snapshots found"
        fail(f"{source}: nothing could be ingested ({errors})")
    if warn is not None:
        for f in report.failed:
            warn(f"not ingested: {f.error}")
    return store_path, run_id or ok[0].run_id
