"""The ray engine of tracekit.ingest.to_dataset: its tasks on a Ray that is running, or, when the
command starts Ray itself, the driver ingesting files while Ray starts.

Started here, Ray takes 3-8 s to come up on a small machine (GCS, raylet, their agents), as long as
a few dozen files take to ingest. So ``ColdStart`` does not wait for it: a thread starts Ray while
the driver's own threads ingest files with the tasks' own code (to_dataset.ingest_file); once Ray
is up it is handed the files not yet taken, and once its first task is back the driver takes no
more (it finishes those it holds). Each file is taken once, under a lock (``Claims``). If Ray
cannot start, the driver ingests every file and says so (``ColdStart.note``).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections import deque
from typing import Iterator

from tracekit.ingest import rundir
from tracekit.ingest.to_dataset import Done, _stat, ingest_batch, ingest_file, part_name, take_batch


class EngineUnavailable(RuntimeError):
    """The engine asked for is not installed, or its cluster cannot be reached."""


def ray_init_args(address: str | None, env_address: str | None) -> dict:
    """``ray.init``'s arguments: the cluster at ``address`` (or RAY_ADDRESS), else a Ray started on
    this machine for this command alone.

    Started here, its workers run at the command's own priority (``worker_niceness`` 0; Ray's
    default, 15, lets every other process on the machine go first: on a shared 2-core machine that
    made each task 5-10x slower in wall time for the same CPU), and without the dashboard, which a
    batch command has no use for (benchmarks/ingest_ray.py, docs/dataset.md). A cluster that is
    already running keeps its own settings."""
    quiet = {"logging_level": "ERROR", "log_to_driver": False}
    if address is not None or env_address:
        return {"address": address, **quiet}
    return {"address": "local", "include_dashboard": False, "_system_config": {"worker_niceness": 0}, **quiet}


_ray_connected_here: set[str] = set()  # the Ray jobs (connections) this module's ray.init made
_starting: list = []  # ColdStart's Ray processes (subprocess.Popen), maybe still stopping


def stop_ray() -> None:
    """Disconnect from the Ray that the ray engine connected to or started (stopping it if started
    here), if it did. A command calls this before it exits: left to the interpreter's exit, Ray
    first sleeps 0.5 s for its log messages (about 0.6 s of the command's wall in all). A Ray that
    was initialized before the engine ran is left as it is."""
    while _starting:
        _starting.pop().wait()  # its Ray stopped
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_job_id() in _ray_connected_here:
        _ray_connected_here.clear()
        ray.shutdown()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise EngineUnavailable("the ray engine needs Ray: pip install 'tracekit[cluster]'") from None
    return ray


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _task_failed(batch: list[rundir.Job], e: Exception) -> list[Done]:
    why = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    return [Done(str(j.path), part_name(j.path), j.run_id, *_stat(j.path), "failed",
                 error=f"{j.path}: its Ray task failed ({why})", logged=False) for j in batch]


def run_ray(work: list[list[rundir.Job]], out_dir: str, address: str | None) -> Iterator[list[Done]]:
    """Every batch as a Ray task, on the Ray this process is connected to, else the one at
    ``address`` (or RAY_ADDRESS), else one started here (waited for)."""
    ray = _import_ray()
    if not ray.is_initialized():
        try:
            ray.init(**ray_init_args(address, os.environ.get("RAY_ADDRESS")))
        except Exception as e:  # noqa: BLE001 - no cluster at the address, a version mismatch, ...
            raise EngineUnavailable(f"cannot start or reach Ray{f' at {address}' if address else ''}: "
                                    f"{_first_line(e)}") from None
        _ray_connected_here.add(ray.get_runtime_context().get_job_id())
    # A task that dies (its worker killed, out of memory) is retried by Ray; its part is replaced,
    # so a retry never doubles rows. One that still fails fails its files, and the others go on.
    task = ray.remote(max_retries=2)(ingest_batch)
    batch_of = {task.remote(b, out_dir): b for b in work}
    pending = list(batch_of)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                yield ray.get(ready[0])
            except ray.exceptions.RayError as e:
                yield _task_failed(batch_of[ready[0]], e)
    finally:
        for ref in pending:
            ray.cancel(ref)


class Claims:
    """The files not yet taken, by the driver one at a time or by Ray a batch at a time
    (to_dataset.take_batch); each file is taken exactly once. ``taken`` lists (path, by whom) in
    the order taken."""

    def __init__(self, jobs: list[rundir.Job]) -> None:
        self._left = deque(jobs)
        self._lock = threading.Lock()
        self.taken: list[tuple[str, str]] = []

    def one(self, by: str) -> rundir.Job | None:
        with self._lock:
            if not self._left:
                return None
            job = self._left.popleft()
            self.taken.append((str(job.path), by))
            return job

    def empty(self) -> bool:
        with self._lock:
            return not self._left

    def batch(self, by: str) -> list[rundir.Job]:
        with self._lock:
            out = take_batch(self._left)
            self.taken.extend((str(j.path), by) for j in out)
            return out


class ColdStart:
    """Iterate for each finished file's (or task's) Done records: the driver's threads ingest while
    Ray starts, then Ray the files left (see the module's docstring). ``note``: one line when Ray did
    not start or went away (the driver ingested the files Ray did not).

    Ray is started, and its tasks submitted, by a child process (``_ray_process``, a fresh
    interpreter), not by a thread of this one: ``ray.init`` forks its daemons with Python code
    run between fork and exec, which crashed them while this process's threads were parsing."""

    def __init__(self, jobs: list[rundir.Job], out_dir: str, workers: int) -> None:
        self.claims = Claims(jobs)
        self.note: str | None = None
        self._out = out_dir
        self._workers = workers
        self._results: queue.Queue = queue.Queue()
        self._ray_working = threading.Event()  # Ray's first task is back: the driver takes no more
        self._stop = threading.Event()  # the consumer went away (an error, Ctrl-C)

    def _drive(self) -> None:
        try:
            while not self._ray_working.is_set() and not self._stop.is_set():
                job = self.claims.one("driver")
                if job is None:
                    break
                self._results.put([ingest_file(job, self._out)])
        finally:
            self._results.put(None)

    def _link(self, conn) -> None:
        """This process's side of the Ray process: hand it batches as it has room (at most two per
        CPU in flight, each taken when sent, so that the driver keeps the rest until Ray's first
        task is back), pass on what comes back; tell it to stop when nothing is left."""
        in_flight: dict[int, list[rundir.Job]] = {}
        window, sent = 0, 0
        try:
            while not self._stop.is_set():
                if window:
                    while len(in_flight) < window:
                        batch = self.claims.batch("ray")
                        if not batch:
                            break
                        in_flight[sent] = batch
                        conn.send(("batch", sent, batch))
                        sent += 1
                if window and not in_flight and self.claims.empty():
                    break  # (the driver done first: Ray's start is still waited for, to say if it failed)
                if not conn.poll(0.2):
                    continue
                msg = conn.recv()
                if msg[0] == "up":
                    window = 2 * msg[1]
                elif msg[0] == "error":
                    self.note = f"Ray did not start ({msg[1]}): all files were ingested by this process"
                    break
                else:  # ("done", id, [Done] or the task's error)
                    batch = in_flight.pop(msg[1])
                    self._results.put(msg[2] if isinstance(msg[2], list) else _task_failed(batch, msg[2]))
                    self._ray_working.set()
        except (EOFError, OSError):  # the Ray process died: what it held fails, the rest is the driver's
            self.note = "the Ray process exited: the files it had not finished failed, the driver ingested the rest"
            for batch in in_flight.values():
                self._results.put(_task_failed(batch, RuntimeError("the Ray process exited")))
        finally:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self._ray_working.clear()  # a driver that stopped for Ray is not restarted; this thread drives
            self._drive()

    def __iter__(self) -> Iterator[list[Done]]:
        import socket
        import subprocess
        from multiprocessing.connection import Connection

        mine, theirs = socket.socketpair()
        # `python -m` this module, not multiprocessing's spawn, which imports the caller's __main__ again
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), self._out],
                                pass_fds=[theirs.fileno()])
        theirs.close()
        conn = Connection(mine.detach())
        _starting.append(proc)
        threads = [threading.Thread(target=self._drive, name=f"tk-driver-{i}") for i in range(self._workers)]
        threads.append(threading.Thread(target=self._link, args=(conn,), name="tk-ray-link"))
        for t in threads:
            t.start()
        running = len(threads)
        try:
            while running:
                item = self._results.get()
                if item is None:
                    running -= 1
                else:
                    yield item
        finally:
            self._stop.set()
            for t in threads:
                t.join()
            conn.close()


def _ray_process(conn, out_dir: str) -> None:
    """The child that starts Ray and runs the batches it is sent as tasks (ColdStart)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it sends "stop"
    try:
        import ray

        ray.init(**ray_init_args(None, None))
    except Exception as e:  # noqa: BLE001 - any failure to start: the driver does the work
        conn.send(("error", _first_line(e)))
        return
    try:
        task = ray.remote(max_retries=2)(ingest_batch)
        conn.send(("up", max(1, int(ray.cluster_resources().get("CPU", 1)))))
        pending: dict = {}
        while True:
            while conn.poll(0 if pending else 0.2):
                msg = conn.recv()
                if msg[0] == "stop":
                    for ref in pending:
                        ray.cancel(ref)
                    return
                pending[task.remote(msg[2], out_dir)] = msg[1]
            if not pending:
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            for ref in ready:
                batch_id = pending.pop(ref)
                try:
                    conn.send(("done", batch_id, ray.get(ref)))
                except ray.exceptions.RayError as e:
                    conn.send(("done", batch_id, RuntimeError(str(e)[-2000:])))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the driver is gone
    finally:
        ray.shutdown()


if __name__ == "__main__":  # ColdStart's child: the socket to the driver, the dataset
    from multiprocessing.connection import Connection

    _ray_process(Connection(int(sys.argv[1])), sys.argv[2])
