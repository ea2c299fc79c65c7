"""The trainer's own flight recorder: every comm op, collectives and p2p, in torch's FR schema.

gloo's built-in recorder (torch 2.13) misses p2p ops and all timing and writes a broken
``pg_config`` (FORMATS.md section 2), so ``FlightRecorder`` is a ``CommHook`` that keeps one entry
per op of ``reference_trainer/comm.py`` and writes ``<run>/fr/rank<R>`` as a pickle that torch's
``torchfrtrace`` reads. It dumps

- at the end of the run (``dump("end")``),
- when the rank made no progress (no op created or completed) for ``watchdog_s`` seconds, from a
  watchdog thread, once per stall (``dump("timeout")``),
- on demand: ``kill -USR1 <pid>`` (the watchdog thread is woken through a signal wakeup fd, so the
  dump happens even while the main thread is blocked inside a gloo wait).

Entry fields follow torch's recorder. Conventions of this recorder (docs/trace_conventions.md):
``collective_seq_id`` of a collective is the comm layer's per-group ``seq`` (as in the ``tk.comm``
span). A p2p entry carries, as both ``collective_seq_id`` and ``p2p_seq_id``, the negative key
``-(1 + 2*seq + (0 if src < dst else 1))`` (group-local src/dst), unique to (pair, direction, seq):
the analyzer matches every entry by (group, collective_seq_id) and treats consecutive entries of a
group that share an id as one coalesced op, so ids must be unique within a group. Every entry
also carries the comm layer's own ``seq`` (p2p: per (group, peer, direction)) and ``step``.
A p2p op in a group of more than two ranks is recorded on a two-rank pseudo group
``<pg>:<lo>-<hi>`` (``desc`` = ``<dim>_p2p``), listed in ``pg_config``: the analyzer expects every
member of an op's group to take part. Each entry also carries ``step`` (the trainer's step).
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .comm import CommRecord, Group

FR_VERSION = "2.10"  # torch 2.13's format version; torchfrtrace checks it
DEFAULT_BUFFER = 50_000

# torch's c10 ScalarType names, as its recorder writes input_dtypes/output_dtypes
_SCALAR_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
                 "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
                 "bool": "Bool"}
_FR_OP_NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather",
                "reduce_scatter": "reduce_scatter", "broadcast": "broadcast", "barrier": "barrier",
                "send": "send", "recv": "recv"}


def scalar_name(dtype: str) -> str:
    return _SCALAR_NAMES.get(dtype, dtype)


def fr_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "fr" / f"rank{rank}"


def load_dump(path: str | Path) -> dict[str, Any]:
    """Read one dump; raises ValueError naming the file if it is not a flight-recorder pickle."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            d = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise ValueError(f"{path}: not a readable flight-recorder pickle: {e}") from None
    missing = {"version", "pg_config", "entries"} - set(d) if isinstance(d, dict) else {"a dict"}
    if missing:
        raise ValueError(f"{path}: flight-recorder dump lacks {sorted(missing)}")
    return d


class FlightRecorder:
    """CommHook recording every op of one rank; see the module docstring for dump triggers."""

    def __init__(self, rank: int, groups: list[Group], out_dir: Path | None, backend: str = "gloo",
                 timeout_ms: int = 300_000, buffer_size: int = DEFAULT_BUFFER,
                 step_of: Callable[[], int] | None = None):
        self.rank, self.out_dir, self.backend = rank, out_dir, backend
        self.timeout_ms = timeout_ms
        self.step_of = step_of or (lambda: -1)
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=buffer_size)
        self.pg_config: dict[str, dict[str, str]] = {}
        self._pg_ids: dict[str, int] = {}
        for g in groups:
            self._add_group(g.name, g.dim, g.ranks)
        self._lock = threading.Lock()
        self._record_id = 0
        self._op_id = 0
        self._by_record: dict[int, dict[str, Any]] = {}
        self.last_progress_ns = time.time_ns()
        self.dumps: list[str] = []  # reasons of the dumps written, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1

    def _add_group(self, name: str, desc: str, ranks: tuple[int, ...]) -> None:
        if name not in self.pg_config:
            self.pg_config[name] = {"name": name, "desc": desc, "ranks": str(list(ranks))}
            self._pg_ids[name] = len(self._pg_ids)

    # -- the hook ------------------------------------------------------------------------------
    def _fr_group(self, record: CommRecord) -> tuple[str, str, tuple[int, ...]]:
        g = record.group
        peer = record.annotation.peer
        if peer is None or g.size == 2:
            return g.name, g.dim, g.ranks
        pair = tuple(sorted((g.rank, peer)))
        name = f"{g.name}:{pair[0]}-{pair[1]}"
        return name, f"{g.dim}_p2p", pair

    def before(self, record: CommRecord) -> None:
        ann = record.annotation
        name, desc, ranks = self._fr_group(record)
        self._add_group(name, desc, ranks)
        op = _FR_OP_NAMES.get(ann.op, ann.op)
        if ann.peer is None:
            profiling = f"{self.backend}:{op}"
            coll_seq, p2p_seq = ann.seq, 0
        else:
            me, other = ranks.index(self.rank), ranks.index(ann.peer)
            src, dst = (me, other) if op == "send" else (other, me)
            profiling = f"{self.backend}:send {src}->{dst}" if op == "send" else \
                f"{self.backend}:recv {dst}<-{src}"
            coll_seq = p2p_seq = -(1 + 2 * ann.seq + (0 if src < dst else 1))
        now = time.time_ns()
        dtype = scalar_name(record.dtype)
        with self._lock:
            entry = {
                "record_id": self._record_id, "pg_id": self._pg_ids[name], "process_group": (name, desc),
                "collective_seq_id": coll_seq, "p2p_seq_id": p2p_seq, "op_id": self._op_id,
                "profiling_name": profiling, "is_p2p": ann.peer is not None,
                "input_sizes": record.input_sizes, "input_dtypes": [dtype] * len(record.input_sizes),
                "output_sizes": record.output_sizes, "output_dtypes": [dtype] * len(record.output_sizes),
                "time_created_ns": now, "time_discovered_started_ns": now,
                "time_discovered_completed_ns": None, "duration_ms": None, "state": "started",
                "retired": False, "timeout_ms": self.timeout_ms, "frames": [],
                "thread_id": str(threading.get_ident()), "thread_name": threading.current_thread().name,
                "step": self.step_of(), "seq": ann.seq, "nbytes": ann.nbytes,
            }
            record.extra["fr_record_id"] = self._record_id
            self._by_record[self._record_id] = entry
            self.entries.append(entry)
            self._record_id += 1
            self._op_id += 1
            self.last_progress_ns = now

    def after(self, record: CommRecord) -> None:
        now = time.time_ns()
        with self._lock:
            entry = self._by_record.pop(record.extra.get("fr_record_id", -1), None)
            if entry is None:
                return
            entry["time_discovered_completed_ns"] = now
            entry["duration_ms"] = (now - entry["time_discovered_started_ns"]) / 1e6
            entry["state"] = "completed"
            entry["retired"] = True
            self.last_progress_ns = now

    # -- dumps ---------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The dump as a dict, in torch's layout (a consistent copy, safe from any thread)."""
        with self._lock:
            entries = [dict(e) for e in self.entries]
            pg_config = {k: dict(v) for k, v in self.pg_config.items()}
        last = {"last_enqueued_collective": -1, "last_started_collective": -1,
                "last_completed_collective": -1}
        pg_status: dict[str, dict[str, int]] = {}
        for e in entries:
            st = pg_status.setdefault(str(e["pg_id"]), dict(last))
            if e["is_p2p"]:
                continue
            st["last_enqueued_collective"] = e["collective_seq_id"]
            st["last_started_collective"] = e["collective_seq_id"]
            if e["state"] == "completed":
                st["last_completed_collective"] = e["collective_seq_id"]
        return {"version": FR_VERSION, "pg_config": pg_config, "pg_status": pg_status,
                "comm_lib_version": self.backend, "entries": entries, "rank": self.rank}

    def dump(self, reason: str) -> Path | None:
        """Write ``<out>/fr/rank<R>`` atomically (a later dump replaces an earlier one)."""
        if self.out_dir is None:
            return None
        path = fr_path(self.out_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.snapshot()
        data["dump_reason"] = reason
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            pickle.dump(data, f)
        os.replace(tmp, path)
        self.dumps.append(reason)
        return path

    # -- watchdog and signal -------------------------------------------------------------------
    def start_watchdog(self, watchdog_s: float, dump_signal: int | None = signal.SIGUSR1) -> None:
        """Dump when no op was created or completed for ``watchdog_s`` seconds (once per stall),
        and on ``dump_signal``. Call from the main thread (signal handlers live there)."""
        if dump_signal is not None and threading.current_thread() is threading.main_thread():
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            signal.signal(dump_signal, lambda *_: None)  # Python's C handler writes to the fd
            signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(watchdog_s,), name="tk-fr-watchdog",
                                        daemon=True)
        self._thread.start()

    def _watch(self, watchdog_s: float) -> None:
        import select

        dumped_at = -1
        tick = min(1.0, watchdog_s / 4) if watchdog_s > 0 else 1.0
        while not self._stop.is_set():
            if self._wake_r >= 0:
                ready, _, _ = select.select([self._wake_r], [], [], tick)
                if ready:
                    os.read(self._wake_r, 64)
                    if not self._stop.is_set():
                        self.dump("signal")
                    continue
            else:
                self._stop.wait(tick)
            last = self.last_progress_ns
            if watchdog_s > 0 and last != dumped_at and time.time_ns() - last > watchdog_s * 1e9:
                self.dump("timeout")
                dumped_at = last

    def stop(self) -> None:
        self._stop.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
        if self._wake_r >= 0 and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
