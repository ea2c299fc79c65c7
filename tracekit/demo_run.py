"""Profiled reference-trainer runs with an injected straggler, for ``tracekit demo``, the trainer-run
tests and ``benchmarks/localize_accuracy.py``.

Each rank trains one unprofiled warm-up step and one profiler warm-up step, then records ``steps``
steps (``ProfilerStep#1..steps``) and writes the trainer's run-directory layout: ``traces/rank<R>.json.gz`` and
``manifest.json`` (config, layout and the injected faults as ground truth, steps counted from the
first profiled step). Several scenarios of one world size run one after another in ONE spawned
world, because spawning and importing torch dominates small runs.

Fault: a rank's compute (``tk.compute`` spans, minus the communication nested in them) takes
``factor`` times as long: the hook sleeps at the end of the span, so the span itself is longer.
This is a stand-in for the trainer's own ``--fault`` / profiling options (branch ``obs``); when
those land, this module should call them instead.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class SlowFault:
    rank: int
    factor: float
    steps: tuple[int, ...] | None = None  # recorded steps (ProfilerStep#1..n); None: every step

    def ground_truth(self) -> dict:
        return {"kind": "slow", "ranks": [self.rank], "steps": list(self.steps) if self.steps else None,
                "magnitude": {"compute_factor": self.factor}}


@dataclass(frozen=True)
class Scenario:
    config: dict  # TrainConfig fields
    out: str
    faults: tuple[SlowFault, ...] = field(default_factory=tuple)


class _CommClock:
    """Time this rank spends inside synchronous comm ops (taken out of the stretched compute)."""

    def __init__(self) -> None:
        self.total = 0.0

    def before(self, record) -> None:
        record.extra["_t0"] = time.perf_counter()

    def after(self, record) -> None:
        if not record.is_async:
            self.total += time.perf_counter() - record.extra.get("_t0", time.perf_counter())


class _Stretch:
    def __init__(self, factor_of, clock: _CommClock) -> None:
        self.factor_of, self.clock, self.stack = factor_of, clock, []

    def before(self, ann) -> None:
        self.stack.append((time.perf_counter(), self.clock.total))

    def after(self, ann) -> None:
        t0, c0 = self.stack.pop()
        factor = self.factor_of()
        if factor > 1.0:
            own = (time.perf_counter() - t0) - (self.clock.total - c0)
            time.sleep(max(0.0, own * (factor - 1.0)))


def _rank_main(rank: int, world: int, scenarios: list[Scenario], init_method: str, warmup: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from reference_trainer.comm import Comm
    from reference_trainer.config import TrainConfig
    from reference_trainer.train import Trainer

    torch.set_num_threads(1)
    comm = Comm.init_world("gloo", rank, world, init_method, 300, "native", torch.device("cpu"))
    try:
        for sc in scenarios:
            cfg = TrainConfig.from_dict({**sc.config, "backend": "gloo"})
            out = Path(sc.out)
            (out / "traces").mkdir(parents=True, exist_ok=True)
            trainer = Trainer(cfg, comm)
            clock = _CommClock()
            comm.add_hook(clock)

            def factor() -> float:
                step = trainer.step_index - warmup  # = the ProfilerStep number the trace records
                return max([f.factor for f in sc.faults if f.rank == rank and step >= 0
                            and (f.steps is None or step in f.steps)], default=1.0)

            trainer.spans.add_hook(_Stretch(factor, clock))
            for _ in range(warmup):
                trainer.train_step()

            def save(p) -> None:
                p.export_chrome_trace(str(out / "traces" / f"rank{rank}.json.gz"))

            n = cfg.steps  # recorded as ProfilerStep#1..n: step #0 is the profiler's own warm-up
            with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=n, repeat=1),
                         on_trace_ready=save) as prof:
                for _ in range(n + 1):
                    trainer.train_step()
                    prof.step()
            comm.remove_hook(clock)
            if rank == 0:
                lay = cfg.layout
                manifest = {"run_id": out.name, "world_size": world, "backend": "gloo",
                            "config": {**asdict(cfg), "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp},
                            "faults": [f.ground_truth() for f in sc.faults], "warmup_steps": warmup}
                (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
            comm.barrier(comm.world)  # the manifest exists before any rank starts the next scenario
    finally:
        comm.shutdown()


def run_scenarios(scenarios: Sequence[Scenario], warmup: int = 1, timeout_s: float = 1800) -> list[Path]:
    """Run every scenario (all of one world size) in one spawned world; returns the run directories."""
    from reference_trainer.config import TrainConfig
    from reference_trainer.launch import free_port, run_world

    sizes = {TrainConfig.from_dict(s.config).validate().world_size for s in scenarios}
    if len(sizes) != 1:
        raise ValueError(f"scenarios need one world size, got {sorted(sizes)}")
    world = sizes.pop()
    for s in scenarios:
        for f in s.faults:
            if not 0 <= f.rank < world:
                raise ValueError(f"fault rank {f.rank} outside 0..{world - 1}")
    run_world(_rank_main, world, (list(scenarios), f"tcp://127.0.0.1:{free_port()}", warmup), timeout_s=timeout_s)
    return [Path(s.out) for s in scenarios]


# The demo's embedded default: 4 ranks (tp 2, dp 2), rank 3 (dp 1, tp 1) computes 2x slower.
DEMO_CONFIG = {"tp": 2, "dp": 2, "n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
               "seq_len": 128, "micro_batches": 4, "steps": 6}
DEMO_FAULT = SlowFault(rank=3, factor=2.0)
