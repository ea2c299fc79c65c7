"""Spawn a world of ranks on this machine: gloo on CPU, NCCL when every rank can have its own GPU.

Writes ``<out>/manifest.json`` (config, layout, world size, backend, versions, host, pids, faults)
before training starts, so a run that hangs or dies still says what it was.
"""

from __future__ import annotations

import json
import multiprocessing
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from .config import ConfigError, TrainConfig
from .model import stage_layers
from .observe import check_observability, manifest_fields
from .pipeline import build_schedule
from .train import rank_main


class LaunchError(RuntimeError):
    """A rank failed or the world did not finish in time; names the rank and its error."""


@dataclass
class RunResult:
    out: Path
    manifest: dict
    metrics: dict


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(cfg: TrainConfig) -> str:
    if cfg.backend != "auto":
        if cfg.backend == "nccl" and torch.cuda.device_count() < cfg.world_size:
            raise ConfigError(f"backend nccl needs one GPU per rank: {cfg.world_size} ranks, "
                              f"{torch.cuda.device_count()} GPUs")
        return cfg.backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world_size else "gloo"


# Modules a CPU world's ranks fork with already imported. torch._inductor is the profiler's: its
# first start asks hasattr(torch, "_inductor"), which imports it (3.8 CPU-s a rank here).
FORKSERVER_PRELOAD = ("torch", "torch._inductor", "reference_trainer.train")


def start_method(backend: str) -> str:
    """How a world's ranks start: a gloo world on a host that has it forks each rank from one
    forkserver that imported ``FORKSERVER_PRELOAD`` once (a 4-rank run on 2 cores: 15.2 -> 10.6 s,
    and a later world in the same process 21.5 -> 14.5 s, as the forkserver stays), instead of
    each rank importing them again. A rank sees the environment the forkserver started with: ranks
    read nothing of it but what they set themselves. NCCL worlds spawn, as CUDA state does not
    survive a fork."""
    if backend == "gloo" and "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        return "forkserver"
    return "spawn"


def run_world(fn: Callable[..., None], world_size: int, args: Sequence[Any], timeout_s: float,
              on_start: Callable[[list[int]], None] | None = None,
              poll: Callable[[], None] | None = None, method: str = "spawn") -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes started by ``method``
    (``start_method``) and wait.

    If a rank raises, the others are terminated and LaunchError carries that rank's traceback;
    if the world does not finish within ``timeout_s`` seconds, all ranks are terminated.
    ``poll`` is called about once a second while the world runs (e.g. to show progress).
    """
    ctx = mp.start_processes(fn, args=(world_size, *args), nprocs=world_size, join=False,
                             start_method=method)
    if on_start is not None:
        on_start(list(ctx.pids()))
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if poll is not None:
                poll()
            if time.monotonic() > deadline:
                raise LaunchError(f"world of {world_size} ranks did not finish within {timeout_s:g} s")
    except mp.ProcessRaisedException as e:
        raise LaunchError(f"rank {e.error_index} failed:\n{e}") from None
    except mp.ProcessExitedException as e:
        raise LaunchError(f"rank {e.error_index} exited with code {e.exit_code}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)


def write_manifest(cfg: TrainConfig, out: Path, backend: str, pids: list[int]) -> dict:
    manifest = {
        "config": cfg.as_dict(),
        "layout": cfg.layout.as_dict(),
        "world_size": cfg.world_size,
        "backend": backend,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "hosts": [socket.gethostname()] * cfg.world_size,
        "pids": pids,
        "stage_layers": [list(r) for r in stage_layers(cfg.n_layers, cfg.n_vstages_total)],
        # per PP rank, the order of forward/backward actions: "F<vstage>.<micro-batch>"
        "pipeline_schedule": [[f"{a.kind}{a.vstage}.{a.mb}" for a in acts] for acts in build_schedule(
            cfg.pp, cfg.vstages, cfg.micro_batches, cfg.n_consecutive, cfg.schedule)],
        **manifest_fields(cfg, backend),  # faults (ground truth) and artifacts
        "created_unix": time.time(),
        "argv": sys.argv,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def launch(cfg: TrainConfig, out: str | Path, poll: Callable[[], None] | None = None) -> RunResult:
    """Validate ``cfg``, spawn its world, train, and return the manifest and rank 0's metrics."""
    return launch_many([(cfg, out)], poll)[0]


def read_progress(out: str | Path) -> list[dict]:
    """Steps finished so far (rank 0's ``steps.jsonl``), readable while the run goes on."""
    path = Path(out) / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def launch_many(jobs: Sequence[tuple[TrainConfig, str | Path]],
                poll: Callable[[], None] | None = None) -> list[RunResult]:
    """Run several configs of the same world size one after another in ONE spawned world
    (spawning and importing torch dominates small runs). Each job gets its own run directory."""
    if not jobs:
        return []
    cfgs = [c.validate() for c, _ in jobs]
    for c in cfgs:
        check_observability(c)
    outs = [Path(o) for _, o in jobs]
    world = cfgs[0].world_size
    if any(c.world_size != world for c in cfgs):
        raise LaunchError(f"launch_many needs one world size, got {[c.world_size for c in cfgs]}")
    backend = resolve_backend(cfgs[0])
    cfgs = [c.replace(backend=backend) for c in cfgs]
    init_method = f"tcp://127.0.0.1:{free_port()}"
    manifests: list[dict] = []
    for o in outs:  # a rerun into the same directory must not leave the old run's results behind
        for stale in [o / "steps.jsonl", o / "metrics.json", *(o / "state").glob("step*.pt"),
                      *(o / "fr").glob("rank*"), *(o / "traces").glob("rank*"), *(o / "memory").glob("rank*")]:
            stale.unlink(missing_ok=True)

    def started(pids: list[int]) -> None:
        manifests.extend(write_manifest(c, o, backend, pids) for c, o in zip(cfgs, outs))

    budget = sum(c.timeout_s + 60.0 * c.steps for c in cfgs)
    run_world(rank_main, world, ([(c.as_dict(), str(o)) for c, o in zip(cfgs, outs)], init_method),
              budget, started, poll, start_method(backend))
    results = []
    for o, m in zip(outs, manifests):
        metrics_path = o / "metrics.json"
        results.append(RunResult(o, m, json.loads(metrics_path.read_text()) if metrics_path.exists() else {}))
    return results
