"""Parsing in child processes, with the parsed Arrow tables handed back without a copy.

On many cores threads stop scaling: a file's parse has Python steps between the scanner's GIL-free
passes, and with 16 worker threads each parse took 3x its time with 2 (docs/ingest.md). So each
ingest worker thread may instead hand its files to a parser process of its own.

- The parser processes are forked from one "zygote", a fresh interpreter that imports the parsers
  once (about 0.5 CPU-s), so a parser starts in milliseconds, already holding them. The zygote is
  our own, not multiprocessing's fork server, which runs the caller's ``__main__`` script again in
  every child: a script without a ``__name__`` guard would ingest again from inside its parsers.
- A parser pickles the Outcome with protocol 5, which leaves every Arrow buffer out of band, and
  writes those buffers into one spool file; the ingest process maps the file and unlinks it at
  once, so the tables reach DuckDB straight from the pages the parser wrote.
- A parser that dies (a crash in the native scanner, the OOM killer) fails its file alone; the
  worker thread gets a new one for its next file.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

from tracekit.ingest import parse as parse_mod

# What the zygote imports before it forks, so that each parser starts holding it.
PRELOAD = ("tracekit.ingest.kineto", "tracekit.ingest.flight_recorder", "tracekit.ingest.memory_snapshot",
           "duckdb", "pyarrow.compute")
ALIGN = 64  # Arrow's buffer alignment

Reply = tuple[bytes, "str | None", "list[tuple[int, int]]"]  # pickle, spool file, (offset, size) per buffer


def available() -> bool:
    return hasattr(os, "fork") and hasattr(socket, "AF_UNIX")


OWNER_FILE = "owner.pid"  # in each temporary folder ingest makes: the pid of the ingest process
TEMP_PREFIXES = ("tk-ingest-", "tk-kineto-")


def temporary_folder(prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder that names its owner, so that the next ingest removes it should this
    process be killed before it can (``clean_stale_folders``)."""
    folder = tempfile.TemporaryDirectory(prefix=prefix)
    with open(os.path.join(folder.name, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return folder


def clean_stale_folders() -> list[str]:
    """Remove the temporary folders of ingests that were killed (their owner is gone); return them."""
    import shutil

    removed = []
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(TEMP_PREFIXES) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            with open(os.path.join(entry.path, OWNER_FILE)) as f:
                owner = int(f.read().strip())
        except (OSError, ValueError):
            continue  # not ours to judge (an older version's, or another user's)
        try:
            os.kill(owner, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


class Parsers:
    """The zygote, and the parser processes it forks on request; a context manager. ``spool``: a
    temporary folder where parsers leave their tables (a file per parsed file, unlinked as soon as
    it is mapped)."""

    def __init__(self) -> None:
        self._spool = temporary_folder("tk-ingest-")
        self.spool = spool = self._spool.name
        self._lock = threading.Lock()
        self._ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._log_path = os.path.join(spool, "zygote.log")
        env = dict(os.environ)
        # the same tracekit and dependencies as this process, however it found them
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
        with open(self._log_path, "wb") as log:
            self._zygote = subprocess.Popen(
                [sys.executable, "-m", "tracekit.ingest.procs", str(theirs.fileno()), spool],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True)  # Ctrl-C is the ingest process's to handle
        theirs.close()

    @property
    def zygote_pid(self) -> int:
        return self._zygote.pid

    def parser(self) -> "ParserProcess":
        return ParserProcess(self)

    def _fork(self) -> Connection:
        """A new parser process, connected to the returned end."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                reduction.sendfds(self._ctl, [theirs.fileno()])
        except OSError as e:
            mine.close()
            raise ParserUnavailable(self._why_gone() or f"the parsers' zygote did not take a request: {e}") from None
        finally:
            theirs.close()  # the parser holds its own copy: its death is our end's EOF
        return Connection(mine.detach())

    def _why_gone(self) -> str | None:
        """Why the zygote is gone, or None while it runs."""
        code = self._zygote.poll()
        if code is None:
            return None
        try:
            with open(self._log_path, "rb") as f:
                last = f.read().decode(errors="replace").strip().splitlines()[-1:]
        except OSError:
            last = []
        return f"the parsers' zygote exited with code {code}" + (f": {last[0]}" if last else "")

    def close(self) -> None:
        """The zygote exits once its parsers have (each when its ParserProcess is closed)."""
        self._ctl.close()
        try:
            self._zygote.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait()
        self._spool.cleanup()

    def __enter__(self) -> "Parsers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ParserUnavailable(Exception):
    """No parser process can be had (the zygote is gone); says why."""


class ParserProcess:
    """One parser process, used by one ingest worker thread for one file at a time."""

    def __init__(self, parsers: Parsers) -> None:
        self._parsers = parsers
        self._conn: Connection | None = None

    def run(self, path: Path, explicit: bool, known_hashes: frozenset[str]) -> parse_mod.Outcome:
        """``parse.run`` in the parser process; never raises for bad input, nor for a parser that dies."""
        t0 = time.perf_counter()
        try:
            if self._conn is None:
                self._conn = self._parsers._fork()
            self._conn.send((path, explicit, known_hashes))
            reply = self._conn.recv()
        except ParserUnavailable as e:
            why = f"no parser process could be started ({e})"
        except (EOFError, OSError):
            self.close()
            how = self._parsers._why_gone() or "crashed or was killed, e.g. by the OOM killer"
            why = f"the parser process died while reading it ({how})"
        else:
            try:
                return unpack(reply)
            except OSError as e:  # the spool file is gone (a temporary-folder cleaner) or unreadable
                why = f"its parsed tables could not be read back from the spool folder ({e})"
        return parse_mod.failed(path, None, None, f"{path}: {why}", time.perf_counter() - t0)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the parser's EOF: it exits once done with the file in hand
            self._conn = None


def pack(out: parse_mod.Outcome, spool: str) -> Reply:
    """The Outcome pickled, its out-of-band buffers written to one file in ``spool``."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(out, protocol=5, buffer_callback=buffers.append)
    except Exception as e:  # noqa: BLE001 - a parser returned something that cannot travel: a bug
        return _failed_reply(out, f"unexpected {type(e).__name__} handing the parsed file back: {e}")
    if not buffers:
        return data, None, []
    name = None
    try:
        fd, name = tempfile.mkstemp(dir=spool, suffix=".arrow")
        spans, pos = [], 0
        with open(fd, "wb") as f:
            for b in buffers:
                raw = b.raw()
                pad = -pos % ALIGN
                if pad:
                    f.write(bytes(pad))
                    pos += pad
                f.write(raw)
                spans.append((pos, raw.nbytes))
                pos += raw.nbytes
    except OSError as e:  # no room in the temporary folder, say
        if name is not None:
            os.unlink(name)
        return _failed_reply(out, f"no room to hand the parsed tables back through {spool} ({e})")
    return data, name, spans


def _failed_reply(out: parse_mod.Outcome, why: str) -> Reply:
    return pickle.dumps(parse_mod.failed(out.path, out.format, out.content_hash, f"{out.path}: {why}",
                                         out.seconds)), None, []


def unpack(reply: Reply) -> parse_mod.Outcome:
    """The Outcome, its buffers mapped from the spool file, which is unlinked at once: the pages
    live until the last table over them is dropped."""
    data, name, spans = reply
    if name is None:
        return pickle.loads(data)
    try:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            view = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b"")
    finally:
        os.unlink(name)
    return pickle.loads(data, buffers=[view[o:o + n] for o, n in spans])


def _serve(conn: Connection, spool: str) -> None:
    """A parser's loop: (path, explicit, known hashes) in, a packed Outcome out, until EOF."""
    import duckdb

    con = None
    while True:
        try:
            path, explicit, known = conn.recv()
        except EOFError:
            return
        if con is None:  # DuckDB's JSON reader where the scanner is not built, and TRY_CAST
            con = duckdb.connect(":memory:")
            con.execute("SET threads = 1")
        conn.send(pack(parse_mod.run(path, explicit, known, con), spool))


def _zygote(ctl_fd: int, spool: str) -> None:
    """Import the parsers, then fork a parser for each socket the ingest process sends, until it
    closes the control socket."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    ctl = socket.socket(fileno=ctl_fd)
    while True:
        try:
            fds = reduction.recvfds(ctl, 1)
        except (EOFError, OSError):
            break
        _reap(block=False)
        if os.fork() == 0:
            code = 0
            try:
                ctl.close()
                _serve(Connection(fds[0]), spool)
            except BaseException:  # noqa: BLE001 - the traceback goes to the zygote's log
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.close(fds[0])
    # Waited for, not left to the kernel, so that their CPU time counts in the zygote's children's
    # and so in the ingest process's (what `time` and the benchmark read).
    _reap(block=True)


def _reap(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    _zygote(int(sys.argv[1]), sys.argv[2])
