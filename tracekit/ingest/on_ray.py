"""The ray engine of tracekit.ingest.to_dataset: its tasks on the Ray this process is connected
to, on the cluster at ``--address`` (or RAY_ADDRESS), or on a Ray started on this machine for the
command (``start_here``), which the command stops before it exits (``stop_ray``).
"""

from __future__ import annotations

import os
import sys
from typing import Iterator

from tracekit.ingest import rundir
from tracekit.ingest.to_dataset import Done, _stat, ingest_batch, part_name


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


def stop_ray() -> None:
    """Disconnect from the Ray that the ray engine connected to or started (stopping it if started
    here), if it did. A command calls this before it exits: left to the interpreter's exit, Ray
    first sleeps 0.5 s for its log messages (about 0.6 s of the command's wall in all). A Ray that
    was initialized before the engine ran is left as it is."""
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


def start_here() -> str | None:
    """Start Ray on this machine for the command (``ray_init_args``); None once started, else the
    first line of why it did not. Raises EngineUnavailable if Ray is not installed."""
    ray = _import_ray()
    try:
        ray.init(**ray_init_args(None, None))
    except Exception as e:  # noqa: BLE001 - no room for its object store, its folder not writable, ...
        return _first_line(e)
    _ray_connected_here.add(ray.get_runtime_context().get_job_id())
    return None


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
