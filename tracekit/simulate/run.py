"""``simulate(cfg, out)``: run the model and write a run directory as the reference trainer does
(DESIGN.md): ``manifest.json`` (ground truth), ``traces/rank<R>.json.gz``, ``fr/rank<R>``."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from tracekit.simulate import flight, kineto
from tracekit.simulate.clock import Clocks
from tracekit.simulate.config import SimConfig
from tracekit.simulate.faults import Effects, chip_factors, ground_truth, parse_all
from tracekit.simulate.model import Trace, simulate_job
from tracekit.simulate.ranks import Views
from tracekit.simulate.schedule import Groups, schedule_names
from tracekit.topology import DIMS


def run_model(cfg: SimConfig) -> tuple[Trace, list]:
    """The simulated run (true clock) and its parsed faults; raises SimError on bad input."""
    cfg.check()
    faults = parse_all(cfg.faults, cfg)
    return simulate_job(cfg, Effects(faults, cfg)), faults


def simulate(cfg: SimConfig, out_dir: str | Path) -> Path:
    """Simulate ``cfg`` and write its run directory to ``out_dir``; returns the directory."""
    out = Path(out_dir)
    trace, faults = run_model(cfg)
    groups = Groups(cfg)
    views = Views(trace, groups)
    clocks = Clocks(cfg)
    writer = kineto.RankWriter(views, clocks, cfg.names, cfg.seed, cfg.world_size, cfg.detail)
    blocked = []
    for r in range(cfg.world_size):
        view = views.rank(r)
        kineto.write(out / "traces" / trace_file(cfg, clocks, r), writer.document(view))
        flight.write(out / "fr" / f"rank{r}", flight.dump(views, clocks, view, cfg.seed))
        if np.any(np.isfinite(view.start) & ~np.isfinite(view.end)):
            blocked.append(r)
    (out / "manifest.json").write_text(json.dumps(manifest(cfg, faults, trace, clocks, groups, blocked), indent=1))
    return out


def trace_file(cfg: SimConfig, clocks: Clocks, r: int) -> str:
    """Rank r's trace file name: rank<R>.json.gz, or (``trace_names`` profiler) the name
    torch.profiler.tensorboard_trace_handler gives it, f"{hostname}_{pid}.{time_ns}.pt.trace.json.gz",
    which is where a real job's directory says which host each rank ran on."""
    if cfg.trace_names == "profiler":
        return f"{clocks.host_name(r)}_{kineto.process_id(r)}.{clocks.base_ns(r) + r}.pt.trace.json.gz"
    return f"rank{r}.json.gz"


def manifest(cfg: SimConfig, faults: list, trace: Trace, clocks: Clocks, groups: Groups, blocked: list[int]) -> dict:
    truth = [ground_truth(f, cfg) for f in faults]
    for t in truth:
        if t["kind"] == "hang":  # who waits forever: the hung rank's peers, and whoever waits on them
            t["blocked_ranks"] = [r for r in blocked if r not in t["ranks"]]
            t["collective"] = trace.hung
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extras"}
    config["faults"] = ";".join(cfg.faults)
    config["microbatches"] = cfg.n_microbatches
    hosts = [clocks.host_name(r) for r in range(cfg.world_size)]
    return {
        "config": config,
        # the trainer's schema; a job numbered otherwise says how, innermost first
        "layout": {**cfg.layout.as_dict(), **({"order": list(cfg.layout.order)} if cfg.layout.order != DIMS else {})},
        "world_size": cfg.world_size,
        "backend": "nccl",
        "torch_version": "simulated",
        "python_version": sys.version.split()[0],
        "hosts": hosts,
        "pids": [kineto.process_id(r) for r in range(cfg.world_size)],
        "pipeline_schedule": schedule_names(cfg),
        "faults": truth,
        "artifacts": {"traces": "traces/rank<R>.json.gz" if cfg.trace_names == "rank" else
                      "traces/<host>_<pid>.<ns>.pt.trace.json.gz", "profiled_steps": list(range(cfg.steps)),
                      "flight_recorder": "fr/rank<R>"},
        "simulated": {
            "seed": cfg.seed, "names": cfg.names,
            "names_flavour": None if groups.flavour is None else groups.flavour,
            "nccl": "ncclDevKernel" if kineto.new_nccl(cfg.seed) else "ncclKernel",
            "ranks_per_host": cfg.ranks_per_host, "noise": cfg.noise, "skew_ms": cfg.skew_ms,
            "drift_ppm": cfg.drift_ppm, **clocks.summary(),
            "spikes": {"probability": cfg.spikes, "events": trace.spikes},
            # rank r's factor at [r] (rank order is (dp, pp, cp, tp) row-major, as the grid)
            "chips": {"spread": cfg.chip_spread,
                      "factors": [round(float(x), 5) for x in chip_factors(cfg).reshape(-1)]},
            "microbatches": cfg.n_microbatches, "vstages": cfg.vstages,
            "step_ms": [_longest(s, e) for s, e in zip(trace.step_start, trace.step_end)],
        },
        "created_unix": time.time(),
        "argv": sys.argv,
    }


def _longest(start: np.ndarray, end: np.ndarray) -> float | None:
    """The step's longest duration over the ranks that finished it (true clock), None if none did."""
    done = np.isfinite(start) & np.isfinite(end)
    return round(float((end[done] - start[done]).max()), 3) if done.any() else None
