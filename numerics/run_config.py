"""The run's configuration as the reference sees it: plain values read from a run's manifest (or any
mapping of the trainer's config fields), with every derived quantity computed here.

Nothing is imported from the trainer: a derivation the trainer gets wrong (tokens per step, the
pipeline's layer split, the head size) is then not reproduced by the reference, and shows as a
mismatch. Unknown fields are ignored (the trainer has fields the numerics do not use); a field the
reference needs that is missing or of the wrong type is bad input (``RunConfigError``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping


# The trainer's fields that change no number the reference computes (schedule order within a stage
# does not change the ascending micro-batch accumulation; the rest is observability and debugging).
TRAINER_ONLY = frozenset({"consecutive", "schedule", "timeout_s", "dump_state", "plant_bug", "faults",
                          "device_gflops", "device_gbps", "device_launch_us", "device_jitter", "profile_steps",
                          "profile_memory", "profile_stack", "flight_recorder", "fr_watchdog_s"})


class RunConfigError(ValueError):
    """A manifest or config the reference cannot use (missing field, wrong type, impossible sizes)."""


@dataclass(frozen=True)
class RunConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    vstages: int = 1
    zero_stage: int = 1
    seq_len: int = 128
    micro_batch_size: int = 1
    micro_batches: int = 4
    compute_dtype: str = "bf16"
    grad_accum_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    reduce_order: str = "native"
    cp_sharding: str = "sequence"
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    seed: int = 1234
    doc_len_mean: float = 48.0
    doc_len_sigma: float = 1.0
    doc_len_max: int = 4096
    eos_id: int = 0
    steps: int = 1
    backend: str = "gloo"
    record_activations: bool = False

    # -- derived here, never read from the trainer ---------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_vstages_total(self) -> int:
        return self.pp * self.vstages

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the whole step (every DP replica): the loss is normalized by this."""
        return self.dp * self.micro_batches * self.micro_batch_size * self.seq_len

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def layout(self) -> str:
        return f"tp{self.tp} cp{self.cp} pp{self.pp} dp{self.dp}"

    def stage_layers(self) -> list[range]:
        """Layers of each virtual stage: an even split of the layers where the embedding and the head
        count as one layer of work each, so the first and last stages hold one layer less when every
        stage keeps at least one (the trainer's documented partition, written again here)."""
        n, s = self.n_layers, self.n_vstages_total
        even = [n // s + (s_i < n % s) for s_i in range(s)]
        counts = even
        if s > 1:
            units = [(n + 2) // s + (s_i < (n + 2) % s) for s_i in range(s)]
            units[0] -= 1
            units[-1] -= 1
            if min(units) >= 1:
                counts = units
        bounds = [sum(counts[:k]) for k in range(s + 1)]
        return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def replace(self, **changes: Any) -> "RunConfig":
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config", strict: bool = False) -> "RunConfig":
        """``strict``: refuse fields the reference does not know (a hand-written config's typo); a
        manifest's config carries trainer-only fields (faults, profiling), which are ignored."""
        if not isinstance(data, Mapping):
            raise RunConfigError(f"{source}: expected a mapping of config fields, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)} - TRAINER_ONLY)
        if strict and unknown:
            raise RunConfigError(f"{source}: unknown config fields {unknown}")
        values = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            v, want = data[f.name], type(f.default)
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if type(v) is not want:
                raise RunConfigError(f"{source}: field {f.name!r} must be {want.__name__}, got {v!r}")
            values[f.name] = v
        return cls(**values).validate(source)

    def validate(self, source: str = "config") -> "RunConfig":
        errors = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tp", "cp", "pp",
                     "dp", "vstages", "seq_len", "micro_batch_size", "micro_batches", "steps"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1")
        for name in ("compute_dtype", "grad_accum_dtype", "reduce_dtype"):
            if getattr(self, name) not in ("fp32", "bf16"):
                errors.append(f"{name} must be fp32 or bf16")
        if self.reduce_order not in ("native", "canonical"):
            errors.append("reduce_order must be native or canonical")
        if self.cp_sharding not in ("sequence", "document"):
            errors.append("cp_sharding must be sequence or document")
        if self.zero_stage not in (1, 2):
            errors.append("zero_stage must be 1 or 2")
        if not errors:
            for what, a, b in (("dim", self.dim, self.n_heads), ("n_heads", self.n_heads, self.n_kv_heads),
                               ("n_heads", self.n_heads, self.tp), ("n_kv_heads", self.n_kv_heads, self.tp),
                               ("ffn_dim", self.ffn_dim, self.tp), ("vocab_size", self.vocab_size, self.tp),
                               ("seq_len", self.seq_len, 2 * self.cp), ("seq_len", self.seq_len, self.cp * self.tp)):
                if a % b:
                    errors.append(f"{what} {a} not divisible by {b}")
            if self.n_layers < self.n_vstages_total:
                errors.append(f"n_layers {self.n_layers} < {self.n_vstages_total} pipeline stages")
            if not 0 <= self.eos_id < self.vocab_size:
                errors.append(f"eos_id {self.eos_id} outside the vocabulary")
        if errors:
            raise RunConfigError(f"{source}: " + "; ".join(errors))
        return self

    @classmethod
    def coerce(cls, cfg: Any) -> "RunConfig":
        """A RunConfig from a RunConfig, a mapping of fields, or any object with ``as_dict()`` (its
        values only: nothing of that object's derived properties is used)."""
        if isinstance(cfg, cls):
            return cfg
        if hasattr(cfg, "as_dict"):
            cfg = cfg.as_dict()
        return cls.from_dict(cfg)


def read_manifest(run_dir: str | Path) -> dict:
    """``<run>/manifest.json`` as a dict (``RunConfigError`` naming the file when unusable)."""
    path = Path(run_dir) / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunConfigError(f"{path}: cannot read the run's manifest: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise RunConfigError(f"{path}: expected an object with a 'config' object")
    return data


def config_from_manifest(run_dir: str | Path) -> RunConfig:
    path = Path(run_dir) / "manifest.json"
    return RunConfig.from_dict(read_manifest(run_dir)["config"], str(path))
