"""The trainer's configuration: one dataclass, validated before any process is spawned."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from tracekit.topology import Layout

from .bugs import BUGS

SCHEDULES = ("1f1b", "afab")
DTYPES = ("fp32", "bf16")
CP_SHARDINGS = ("sequence", "document")
REDUCE_ORDERS = ("native", "canonical")
BACKENDS = ("auto", "gloo", "nccl")


class ConfigError(ValueError):
    """An impossible configuration (sizes that do not divide, unknown choices, ...)."""


@dataclass(frozen=True)
class TrainConfig:
    # model (a tiny Llama by default: seconds per step on CPU)
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # parallelism, ranks ordered [TP, CP, PP, DP] innermost to outermost
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    vstages: int = 1  # virtual pipeline stages per PP rank (interleaving)
    consecutive: int = 0  # N: consecutive micro-batches per virtual stage; 0 means pp
    schedule: str = "1f1b"
    zero_stage: int = 1  # 1: grads reduce-scattered once per step; 2: after every micro-batch
    # batch: dp * micro_batches * micro_batch_size sequences of seq_len tokens per step
    seq_len: int = 128
    micro_batch_size: int = 1
    micro_batches: int = 4
    # numerics
    compute_dtype: str = "bf16"
    grad_accum_dtype: str = "fp32"
    reduce_dtype: str = "fp32"  # dtype of the DP (dp x cp) gradient reduction
    reduce_order: str = "native"  # native backend reductions, or canonical rank-ordered sums
    cp_sharding: str = "sequence"  # sequence: chunks i, 2cp-1-i; document: per-document (WLB-LLM)
    # optimizer (AdamW, decoupled weight decay)
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    # data: heavy-tailed (lognormal) document lengths packed with eos
    seed: int = 1234
    doc_len_mean: float = 48.0
    doc_len_sigma: float = 1.0
    doc_len_max: int = 4096
    eos_id: int = 0
    # run
    steps: int = 3
    backend: str = "auto"
    timeout_s: float = 300.0
    dump_state: bool = False
    record_activations: bool = False  # debug: dump every micro-batch's per-layer activations (needs dump_state)
    plant_bug: str = ""  # debug: plant a known bug (reference_trainer.bugs.BUGS) to test numerics checks
    # observability and faults (reference_trainer/observe.py)
    faults: str = ""  # fault specs separated by ';' (reference_trainer/faults.py)
    # An emulated device per rank (reference_trainer/device.py): > 0 makes every compute span last
    # the time a device of this speed needs for its work (matmul FLOPs / device_gflops + bytes
    # written by other ops / device_gbps + kernels x device_launch_us), times a per-span lognormal
    # jitter of relative sd device_jitter. Ranks then mostly wait, as on dedicated GPUs, instead of
    # trading CPU cores.
    device_gflops: float = 0.0
    device_gbps: float = 1.0
    device_launch_us: float = 0.0
    device_jitter: float = 0.0
    profile_steps: str = ""  # "a-b": torch.profiler trace + memory snapshot of steps a..b
    profile_memory: bool = True  # record allocations in the profiled steps and write the memory snapshot
    profile_stack: bool = False  # torch.profiler with_stack: Python frames in the trace and the CPU snapshot
    flight_recorder: bool = True  # <out>/fr/rank<R> at the end, on a stall and on SIGUSR1
    fr_watchdog_s: float = 0.0  # dump after this long without progress; 0 = timeout_s / 2

    # -- derived -----------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_consecutive(self) -> int:
        return self.consecutive or self.pp

    @property
    def n_vstages_total(self) -> int:
        return self.pp * self.vstages

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.micro_batches * self.micro_batch_size * self.seq_len

    def replace(self, **changes: Any) -> "TrainConfig":
        d = asdict(self)
        unknown = set(changes) - set(d)
        if unknown:
            raise ConfigError(f"unknown config fields: {sorted(unknown)}")
        d.update(changes)
        return TrainConfig(**d)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields: {sorted(unknown)}")
        return cls(**d)

    def single_process(self) -> "TrainConfig":
        """The same model on the same global batch with every parallel size 1 (the reference)."""
        return self.replace(tp=1, cp=1, pp=1, dp=1, vstages=1, consecutive=0,
                            micro_batches=self.dp * self.micro_batches)

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> "TrainConfig":
        errors: list[str] = []

        def need(cond: bool, msg: str) -> None:
            if not cond:
                errors.append(msg)

        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tp", "cp",
                    "pp", "dp", "vstages", "seq_len", "micro_batch_size", "micro_batches", "steps")
        for name in positive:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                 f"{name} must be a positive integer, got {v!r}")
        if errors:
            raise ConfigError("; ".join(errors))
        need(self.consecutive >= 0, f"consecutive (N) must be >= 0 (0 means pp), got {self.consecutive}")
        need(self.device_gflops >= 0, f"device_gflops must be >= 0 (0 = off), got {self.device_gflops}")
        need(self.device_gbps > 0, f"device_gbps must be > 0, got {self.device_gbps}")
        need(self.device_launch_us >= 0, f"device_launch_us must be >= 0, got {self.device_launch_us}")
        need(0 <= self.device_jitter <= 0.5, f"device_jitter must be in [0, 0.5], got {self.device_jitter}")
        need(self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        need(self.zero_stage in (1, 2), f"zero_stage must be 1 or 2, got {self.zero_stage}")
        for name in ("compute_dtype", "grad_accum_dtype", "reduce_dtype"):
            need(getattr(self, name) in DTYPES, f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        need(self.cp_sharding in CP_SHARDINGS, f"cp_sharding must be one of {CP_SHARDINGS}, got {self.cp_sharding!r}")
        need(self.reduce_order in REDUCE_ORDERS, f"reduce_order must be one of {REDUCE_ORDERS}, got {self.reduce_order!r}")
        need(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        need(self.dim % self.n_heads == 0, f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads} (GQA)")
        need(self.dim % self.n_heads != 0 or self.head_dim % 2 == 0,
             f"head_dim {self.dim // max(self.n_heads, 1)} must be even for RoPE")
        need(self.n_heads % self.tp == 0, f"n_heads {self.n_heads} not divisible by tp {self.tp}")
        need(self.n_kv_heads % self.tp == 0, f"n_kv_heads {self.n_kv_heads} not divisible by tp {self.tp}")
        need(self.ffn_dim % self.tp == 0, f"ffn_dim {self.ffn_dim} not divisible by tp {self.tp}")
        need(self.vocab_size % self.tp == 0, f"vocab_size {self.vocab_size} not divisible by tp {self.tp}")
        need(self.seq_len % (2 * self.cp) == 0,
             f"seq_len {self.seq_len} not divisible by 2*cp = {2 * self.cp} (CP uses 2*cp chunks)")
        need(self.seq_len % (self.cp * self.tp) == 0,
             f"seq_len/cp = {self.seq_len / self.cp:g} not divisible by tp {self.tp} (sequence parallel)")
        need(self.n_layers >= self.pp * self.vstages,
             f"n_layers {self.n_layers} too few for pp*vstages = {self.pp * self.vstages} pipeline stages")
        need(not 0 <= self.eos_id < self.vocab_size or self.vocab_size >= 2,
             "vocab_size must be >= 2")
        need(0 <= self.eos_id < self.vocab_size, f"eos_id {self.eos_id} outside vocab {self.vocab_size}")
        need(self.doc_len_mean >= 1 and self.doc_len_sigma >= 0 and self.doc_len_max >= 1,
             "doc_len_mean >= 1, doc_len_sigma >= 0 and doc_len_max >= 1 required")
        need(self.plant_bug in ("",) + BUGS, f"plant_bug must be empty or one of {BUGS}, got {self.plant_bug!r}")
        need(self.dump_state or not self.record_activations,
             "record_activations needs dump_state (the records travel in the state dump)")
        need(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        if errors:
            raise ConfigError("invalid trainer config: " + "; ".join(errors))
        return self
