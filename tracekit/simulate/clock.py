"""Host clocks: every rank writes times on its host's clock, which is skewed and drifts.

Ranks on one host share a clock (``ranks_per_host``). A host's clock reads
``EPOCH + skew + true * (1 + drift)``: skew uniform in [-skew_ms, +skew_ms], drift uniform in
[-drift_ppm, +drift_ppm] parts per million. The true clock starts at 0 (ms).
"""

from __future__ import annotations

import numpy as np

from tracekit.simulate.config import SimConfig

EPOCH_NS = 1_764_000_000 * 10**9  # late November 2025


class Clocks:
    def __init__(self, cfg: SimConfig) -> None:
        n_hosts = -(-cfg.world_size // cfg.ranks_per_host)
        rng = np.random.default_rng([cfg.seed, 2])
        self.rph = cfg.ranks_per_host
        self.skew_ms = rng.uniform(-cfg.skew_ms, cfg.skew_ms, n_hosts) if cfg.skew_ms > 0 else np.zeros(n_hosts)
        self.drift_ppm = (rng.uniform(-cfg.drift_ppm, cfg.drift_ppm, n_hosts) if cfg.drift_ppm > 0
                          else np.zeros(n_hosts))

    def host(self, rank: int) -> int:
        return rank // self.rph

    def host_name(self, rank: int) -> str:
        return f"node{self.host(rank):04d}"

    def local_ms(self, rank: int, true_ms: np.ndarray | float) -> np.ndarray:
        """``rank``'s host clock minus EPOCH_NS, in ms (kept small so that floats hold nanoseconds)."""
        h = self.host(rank)
        return self.skew_ms[h] + np.asarray(true_ms, dtype=float) * (1 + self.drift_ppm[h] * 1e-6)

    def base_ns(self, rank: int) -> int:
        """The trace's baseTimeNanoseconds: its host clock at the true start, to the whole second."""
        return EPOCH_NS + int(np.floor(float(self.local_ms(rank, 0.0)) / 1000.0)) * 10**9

    def ts_us(self, rank: int, true_ms: np.ndarray) -> np.ndarray:
        """Kineto's ts: microseconds after the trace's baseTimeNanoseconds, on the host clock."""
        return self.local_ms(rank, true_ms) * 1e3 - (self.base_ns(rank) - EPOCH_NS) / 1e3

    def epoch_ns(self, rank: int, true_ms: float) -> int:
        """Epoch nanoseconds on the host clock (the flight recorder's times)."""
        return EPOCH_NS + int(round(float(self.local_ms(rank, true_ms)) * 1e6))

    def summary(self) -> dict:
        return {"skew_ms_by_host": [round(float(v), 3) for v in self.skew_ms],
                "drift_ppm_by_host": [round(float(v), 3) for v in self.drift_ppm]}
