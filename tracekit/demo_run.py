"""Profiled reference-trainer runs with an injected straggler, for ``tracekit demo``, the trainer-run
tests and ``benchmarks/localize_accuracy.py``.

A thin layer over the trainer's own fault injection and profiling (``--fault``, ``--profile-steps``,
reference_trainer/faults.py and profiling.py): step 0 is an unprofiled warm-up, steps 1..``steps``
are profiled (``ProfilerStep#1..steps``, the trainer's step index), and each run directory gets the
trainer's layout (``manifest.json`` with the faults as ground truth, ``traces/``, ``fr/``,
``memory/``). Several scenarios of one world size run one after another in ONE spawned world,
because spawning and importing torch dominates small runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class SlowFault:
    """The rank's compute takes ``factor`` times as long (the trainer's ``slow`` fault)."""

    rank: int
    factor: float
    steps: tuple[int, ...] | None = None  # trainer steps (profiled: 1..steps); None: every step

    def spec(self) -> str:
        steps = f",steps={'+'.join(map(str, self.steps))}" if self.steps else ""
        return f"slow:rank={self.rank},factor={self.factor}{steps}"


@dataclass(frozen=True)
class FaultSpec:
    """Any trainer fault, as its ``--fault`` spec (reference_trainer/faults.py), e.g.
    ``link:a=1,b=3,delay_ms=20`` or ``cp_imbalance:ranks=1``; the manifest records the truth."""

    text: str

    def spec(self) -> str:
        return self.text


@dataclass(frozen=True)
class Scenario:
    config: dict  # TrainConfig fields; "steps" counts the profiled steps
    out: str
    faults: tuple[SlowFault | FaultSpec, ...] = field(default_factory=tuple)


def run_scenarios(scenarios: Sequence[Scenario]) -> list[Path]:
    """Train every scenario (all of one world size) in one spawned world; returns the run directories."""
    from reference_trainer.config import TrainConfig
    from reference_trainer.launch import launch_many

    jobs = []
    for sc in scenarios:
        n = int(sc.config.get("steps", 3))
        cfg = TrainConfig.from_dict({**sc.config, "steps": n + 1, "profile_steps": f"1-{n}",
                                     "faults": ";".join(f.spec() for f in sc.faults)})
        jobs.append((cfg, sc.out))
    launch_many(jobs)
    return [Path(s.out) for s in scenarios]


# The demo's embedded default: 4 ranks (tp 2, dp 2), rank 3 (dp 1, tp 1) computes 3x slower.
# device_*: every rank gets an emulated device (reference_trainer/device.py) whose compute time
# follows the work done (0.5 GFLOP/s, 0.25 GB/s, 400 us per kernel: slow enough that 4-8 ranks on a
# 2-core machine finish their CPU work before the device would, so they mostly wait instead of
# trading CPU), with a 2% per-span jitter, about what kernels of the same shapes vary by on a GPU.
DEVICE = {"device_gflops": 0.5, "device_gbps": 0.25, "device_launch_us": 400.0, "device_jitter": 0.02}
DEMO_CONFIG = {"tp": 2, "dp": 2, "n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
               "seq_len": 128, "micro_batches": 4, "steps": 6, **DEVICE}
DEMO_FAULT = SlowFault(rank=3, factor=3.0)
