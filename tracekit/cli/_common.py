"""What every command shares: the exit codes, the one-line error, and the ingest progress bar."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn

EXIT_OK, EXIT_FINDING, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it

Progress = Callable[[int, int, Path, str], None]  # (done, total, file, status), as ingest() calls it


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr and exit with EXIT_BAD_INPUT."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}", highlight=False)
    sys.exit(EXIT_BAD_INPUT)


@contextmanager
def ingest_progress(quiet: bool = False) -> Iterator[Progress]:
    """A transient progress bar on stderr (only on a terminal, never when ``quiet``); yields the
    callback to hand to :func:`tracekit.ingest.ingest`."""
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
