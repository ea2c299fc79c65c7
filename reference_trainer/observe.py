"""Wires observability and faults into one rank's training run (called by ``train.rank_main``).

Hook order on the comm layer matters and lives here: the hang injector runs before the flight
recorder (a stalled rank never records the op), the slow-link delay after it (the delay lies inside
the op's recorded duration).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .comm import Comm
from .config import ConfigError, TrainConfig
from .data import Corpus
from .faults import FaultError, ImbalancedCorpus, check_faults, cp_pair_counts, ground_truth, install, parse_faults
from .flight_recorder import FlightRecorder
from .profiling import ProfilingError, RankProfiler, memory_source, parse_steps
from .train import StepResult, Trainer, run_training


def watchdog_seconds(cfg: TrainConfig) -> float:
    """Dump after this long without progress: before gloo's own timeout ends the rank."""
    return cfg.fr_watchdog_s if cfg.fr_watchdog_s > 0 else cfg.timeout_s / 2


def check_observability(cfg: TrainConfig) -> None:
    """ConfigError for a bad fault spec or profile window (before any rank is spawned)."""
    try:
        check_faults(parse_faults(cfg.faults), cfg)
        parse_steps(cfg.profile_steps, cfg.steps)
    except (FaultError, ProfilingError) as e:
        raise ConfigError(str(e)) from None


def attention_work(cfg: TrainConfig, steps: list[int]) -> dict[str, dict[str, int]]:
    """{step: {rank: unmasked causal (query, key) pairs of the tokens the rank attends for}} over
    its micro-batches: the attention work its documents give it (TP ranks share their replica's
    and CP rank's tokens). tracekit compares it with compute to tell more work from a slow rank."""
    faults = [f for f in parse_faults(cfg.faults) if f.kind == "cp_imbalance"]
    corpus = (ImbalancedCorpus(cfg, faults[0].params["ranks"], faults[0].params.get("short", 4)) if faults
              else Corpus(cfg))
    lay = cfg.layout
    out: dict[str, dict[str, int]] = {}
    for s in steps:
        per_dp = [[sum(v) for v in zip(*(cp_pair_counts(cfg, mb) for mb in corpus.micro_batches(s, d)))]
                  for d in range(cfg.dp)]
        out[str(s)] = {str(r): int(per_dp[lay.coords(r).dp][lay.coords(r).cp]) for r in range(cfg.world_size)}
    return out


def manifest_fields(cfg: TrainConfig, backend: str) -> dict[str, Any]:
    """What the manifest says about faults (ground truth) and the artifacts of the run."""
    window = parse_steps(cfg.profile_steps, cfg.steps)
    profiled = list(range(window[0], window[1] + 1)) if window else []
    return {
        "faults": [ground_truth(f, cfg) for f in parse_faults(cfg.faults)],
        "attention_work": attention_work(cfg, profiled),
        "artifacts": {
            "traces": "traces/rank<R>.json.gz" if window else None,
            "profiled_steps": list(range(window[0], window[1] + 1)) if window else [],
            "memory": "memory/rank<R>.pickle" if window and cfg.profile_memory else None,
            "memory_source": memory_source(backend) if window and cfg.profile_memory else None,
            "flight_recorder": "fr/rank<R>" if cfg.flight_recorder else None,
            "fr_watchdog_s": watchdog_seconds(cfg),
        },
    }


def write_device_stats(device, out: Path, rank: int) -> None:
    """<out>/device/rank<R>.json: how well the emulated device held (overruns: segments whose CPU
    work took longer than the device time, so the machine, not the model, set their length)."""
    st = device.stats
    d = out / "device"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps({
        "gflops": device.gflops, "gbps": device.gbps, "launch_us": device.launch_us,
        "jitter": device.jitter, "spans": st.spans,
        "segments": st.segments, "overruns": st.overruns, "slept_s": round(st.slept_s, 4),
        "work": {k: [list(w) for w in v] for k, v in st.work.items()}}, indent=1))


def observed_training(cfg: TrainConfig, comm: Comm, out: Path) -> list[StepResult]:
    faults = parse_faults(cfg.faults)
    window = parse_steps(cfg.profile_steps, cfg.steps)
    hooks_before = list(comm.hooks)
    parts: dict[str, Any] = {}

    def setup(trainer: Trainer) -> None:
        installed = install(trainer, faults) if faults or cfg.device_gflops else {"late_hooks": []}
        late = installed["late_hooks"]
        if installed.get("device") is not None:
            parts["device"] = installed["device"]
        if cfg.flight_recorder:
            ctx = trainer.ctx
            groups = [g for g in (ctx.tp, ctx.cp, ctx.pp, ctx.dp, ctx.dp_cp, ctx.pp_bwd, comm.world)
                      if g.pg is not None]
            fr = FlightRecorder(comm.rank, groups, out, backend=comm.backend if comm.backend != "none" else "gloo",
                                timeout_ms=int(cfg.timeout_s * 1000), step_of=lambda: trainer.step_index)
            comm.add_hook(fr)
            fr.start_watchdog(watchdog_seconds(cfg))
            parts["fr"] = fr
        for h in late:
            comm.add_hook(h)
        if window is not None:
            prof = RankProfiler(comm.rank, out, window, comm.backend, trainer, cfg.profile_memory,
                                cfg.profile_stack)
            prof.start()
            parts["prof"] = prof

    def on_step(_: StepResult) -> None:
        if "prof" in parts:
            parts["prof"].step()

    reason = "error"
    try:
        results, _ = run_training(cfg, comm, out, on_step=on_step, setup=setup)
        reason = "end"
        return results
    finally:
        if "fr" in parts:
            parts["fr"].dump(reason)
            parts["fr"].stop()
        if "prof" in parts and reason == "end":
            parts["prof"].finish()
        if "device" in parts:
            write_device_stats(parts["device"], out, comm.rank)
        comm.hooks[:] = hooks_before
