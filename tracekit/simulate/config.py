"""What to simulate: the job's layout, schedule, faults, clocks and noise (``SimConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tracekit.topology import DIMS, Layout, LayoutError

NAMES = ("mesh", "plain", "none")
TRACE_NAMES = ("rank", "profiler")  # traces/rank<R>.json.gz, or as torch.profiler.tensorboard_trace_handler names them


class SimError(ValueError):
    """A configuration or fault spec that cannot be simulated (bad input: exit 2)."""


@dataclass(frozen=True)
class SimConfig:
    """A 4D job (rank = tp + TP*(cp + CP*(pp + PP*dp))) and what to do to it.

    Times are milliseconds of the true (global) clock. ``faults`` are specs in the trainer's
    spelling (tracekit/simulate/faults.py). ``noise`` is the sigma of the lognormal factor on every
    compute kernel; ``spikes`` the probability that one kernel is descheduled 5-30x; ``chip_spread``
    the sigma of a lognormal factor each rank keeps for the whole run (healthy chips differ: clocks,
    thermals, placement), 0 for identical chips."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    steps: int = 4
    seed: int = 0
    faults: tuple[str, ...] = ()
    names: str = "mesh"
    skew_ms: float = 0.0
    drift_ppm: float = 0.0
    noise: float = 0.02
    spikes: float = 0.0
    chip_spread: float = 0.0
    trace_names: str = "rank"  # rank: traces/rank<R>.json.gz; profiler: <host>_<pid>.<ns>.pt.trace.json.gz
    microbatches: int = 0  # 0: 2 * pp (Llama 3's bs = 2 * pp)
    vstages: int = 1
    layers: int = 1  # transformer layers per virtual stage (each: attention + MLP)
    ranks_per_host: int = 8
    detail: bool = False  # Kineto: aten ops around launches and ac2g flows, as the profiler writes them
    # base costs of one layer on one micro-batch (ms), before tp/cp split and faults
    attn_ms: float = 1.6
    mlp_ms: float = 2.4
    optimizer_ms: float = 3.0
    hidden: int = 4096
    seq_len: int = 8192
    params_per_layer: int = 200_000_000  # all layers' weights are split by tp
    intra_gbps: float = 150.0  # NVLink, within a host
    inter_gbps: float = 25.0  # network, across hosts
    extras: dict = field(default_factory=dict, compare=False)
    # how ranks are numbered, innermost dimension first: DIMS (Llama 3's, the trainer's) or another
    # (torchtitan and Megatron-LM put PP outermost: ("tp", "cp", "dp", "pp"))
    order: tuple[str, ...] = DIMS

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, order=tuple(self.order))

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or 2 * self.pp

    def check(self) -> None:
        """Raise SimError on a configuration that cannot run."""
        try:
            self.layout
        except LayoutError as e:
            raise SimError(str(e)) from None
        for name in ("steps", "vstages", "layers", "ranks_per_host"):
            if getattr(self, name) < 1:
                raise SimError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.microbatches < 0:
            raise SimError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.names not in NAMES:
            raise SimError(f"names must be one of {NAMES}, got {self.names!r}")
        if self.trace_names not in TRACE_NAMES:
            raise SimError(f"trace_names must be one of {TRACE_NAMES}, got {self.trace_names!r}")
        for name in ("skew_ms", "drift_ppm", "noise", "chip_spread"):
            if getattr(self, name) < 0:
                raise SimError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.spikes <= 1:
            raise SimError(f"spikes is a probability in [0, 1], got {self.spikes}")
        if self.vstages > 1 and self.pp < 2:
            raise SimError("vstages > 1 needs pp >= 2")
