"""Llama-style decoder split into pipeline stages, with TP+SP and CP inside every layer.

Parameters are created from *canonical* full tensors (one seeded generator per canonical name, so
every layout starts from the same weights) and sliced to this rank's TP shard. Canonical names:
``embed.weight``, ``layers.<i>.{attn_norm,wq,wk,wv,wo,mlp_norm,w1,w3,w2}.weight``,
``norm.weight``, ``head.weight``; weights are [out, in] like torch.nn.Linear.

Each part of the forward runs in a ``tk.module`` profiler span (``embed``, ``layers.<i>.attention``,
``layers.<i>.mlp``, ``head``: tracekit.conventions.module_span_name), so that a profiled
allocation says which layer made it (reference_trainer/alloc_sites.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from tracekit.conventions import module_span_name

from . import bugs
from .activations import ActivationRecorder
from .config import TrainConfig
from .context_parallel import attention, gather_kv
from .parallel_state import ParallelContext
from .tensor_parallel import (gather_sequence, reduce_scatter_sequence, vocab_parallel_cross_entropy,
                              vocab_parallel_embedding)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ParamSpec:
    name: str
    full_shape: tuple[int, ...]
    tp_dim: int | None  # dimension split over TP; None = replicated over TP (norm weights)
    init: str = "normal"  # normal(0, 0.02) or ones

    def init_full(self, seed: int) -> torch.Tensor:
        if self.init == "ones":
            return torch.ones(self.full_shape)
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(self.name.encode())) % 2**63)
        return torch.randn(self.full_shape, generator=g) * 0.02

    def shard(self, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        if self.tp_dim is None or tp == 1:
            return full.clone()
        return full.chunk(tp, dim=self.tp_dim)[tp_rank].clone()


def layer_specs(cfg: TrainConfig, i: int) -> list[ParamSpec]:
    h, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    p = f"layers.{i}."
    return [
        ParamSpec(p + "attn_norm.weight", (h,), None, "ones"),
        ParamSpec(p + "wq.weight", (cfg.n_heads * hd, h), 0),
        ParamSpec(p + "wk.weight", (cfg.n_kv_heads * hd, h), 0),
        ParamSpec(p + "wv.weight", (cfg.n_kv_heads * hd, h), 0),
        ParamSpec(p + "wo.weight", (h, cfg.n_heads * hd), 1),
        ParamSpec(p + "mlp_norm.weight", (h,), None, "ones"),
        ParamSpec(p + "w1.weight", (f, h), 0),
        ParamSpec(p + "w3.weight", (f, h), 0),
        ParamSpec(p + "w2.weight", (h, f), 1),
    ]


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Layers of each virtual stage. The embedding and the head each count as one layer of work, so
    the first and last stages shed one layer when that keeps every stage at >= 1 layer."""
    def split(total: int) -> list[int]:
        return [total // n_stages + (1 if s < total % n_stages else 0) for s in range(n_stages)]

    counts = split(n_layers)
    if n_stages > 1:
        units = split(n_layers + 2)
        shed = [units[0] - 1] + units[1:-1] + [units[-1] - 1]
        if min(shed) >= 1:
            counts = shed
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def stage_specs(cfg: TrainConfig, vstage: int) -> list[ParamSpec]:
    n = cfg.n_vstages_total
    specs: list[ParamSpec] = []
    if vstage == 0:
        specs.append(ParamSpec("embed.weight", (cfg.vocab_size, cfg.dim), 0))
    for i in stage_layers(cfg.n_layers, n)[vstage]:
        specs += layer_specs(cfg, i)
    if vstage == n - 1:
        specs.append(ParamSpec("norm.weight", (cfg.dim,), None, "ones"))
        specs.append(ParamSpec("head.weight", (cfg.vocab_size, cfg.dim), 0))
    return specs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [b, s, heads, d] at global positions pos [b, s]."""
    d = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * freqs  # [b, s, d/2]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x32 = x.float()
    a, b = x32[..., 0::2], x32[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


@dataclass
class MicroBatch:
    """One micro-batch as this rank sees it (CP-local sequence, full on every TP rank)."""

    index: int
    tokens: torch.Tensor  # [b, S/cp] input ids at this CP rank's positions
    targets: torch.Tensor  # [b, S/cp]
    positions: torch.Tensor  # [b, S/cp] global positions of the local tokens
    mask: torch.Tensor  # [b, S/cp, S] document-causal mask against the gathered keys


class Stage(nn.Module):
    """One virtual pipeline stage: [embedding] + layers + [final norm, head, loss]."""

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, vstage: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.ctx, self.vstage = cfg, ctx, vstage
        bugs.set_active(cfg.plant_bug)
        self.specs = stage_specs(cfg, vstage)
        self.is_first = vstage == 0
        self.is_last = vstage == cfg.n_vstages_total - 1
        self.layer_ids = list(stage_layers(cfg.n_layers, cfg.n_vstages_total)[vstage])
        tp, tp_rank = cfg.tp, ctx.coords.tp
        self.params: dict[str, nn.Parameter] = {}
        for i, spec in enumerate(self.specs):
            full = spec.init_full(cfg.seed)
            p = nn.Parameter(spec.shard(full, tp, tp_rank).to(dtype))
            self.register_parameter(f"p{i}", p)
            self.params[spec.name] = p
        self.vocab_start = tp_rank * (cfg.vocab_size // tp)
        self.recorder: ActivationRecorder | None = None  # set only for the numerics check

    def _record(self, mb: MicroBatch, point: str, x: torch.Tensor) -> torch.Tensor:
        if self.recorder is not None:
            self.recorder.record(mb.index, point, x)
        return x

    def full_init_fp32(self) -> list[torch.Tensor]:
        """This rank's shards of the initial weights in fp32 (the master copy's start)."""
        return [s.shard(s.init_full(self.cfg.seed), self.cfg.tp, self.ctx.coords.tp) for s in self.specs]

    def _layer(self, i: int, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        c, comm, tp = self.cfg, self.ctx.comm, self.ctx.tp
        w = lambda n: self.params[f"layers.{i}.{n}.weight"]  # noqa: E731
        b = x.shape[0]
        with record_function(module_span_name(f"layers.{i}.attention")):
            hf = gather_sequence(rms_norm(x, w("attn_norm"), c.norm_eps), comm, tp)
            s = hf.shape[1]
            q = F.linear(hf, w("wq")).view(b, s, -1, c.head_dim)
            k = F.linear(hf, w("wk")).view(b, s, -1, c.head_dim)
            v = F.linear(hf, w("wv")).view(b, s, -1, c.head_dim)
            q, k = rope(q, mb.positions, c.rope_theta), rope(k, mb.positions, c.rope_theta)
            k, v = gather_kv(k, comm, self.ctx.cp), gather_kv(v, comm, self.ctx.cp)
            o = self._record(mb, f"layers.{i}.attention.heads", attention(q, k, v, mb.mask).reshape(b, s, -1))
            x = x + self._record(mb, f"layers.{i}.attention",
                                 reduce_scatter_sequence(F.linear(o, w("wo")), comm, tp))
        with record_function(module_span_name(f"layers.{i}.mlp")):
            hf = gather_sequence(rms_norm(x, w("mlp_norm"), c.norm_eps), comm, tp,
                                 bwd_reduce=not bugs.active("tp-bwd-reduce"))
            act = F.silu(F.linear(hf, w("w1"))) * F.linear(hf, w("w3"))
            x = x + self._record(mb, f"layers.{i}.mlp", reduce_scatter_sequence(F.linear(act, w("w2")), comm, tp))
        return self._record(mb, f"layers.{i}", x)

    def forward(self, x: torch.Tensor | None, mb: MicroBatch) -> torch.Tensor:
        """Activation [b, S/(cp*tp), h] in and out; the last stage returns this micro-batch's
        share of the step loss (sum of token losses / tokens per step, fp32 scalar)."""
        comm, tp = self.ctx.comm, self.ctx.tp
        if self.is_first:
            with record_function(module_span_name("embed")):
                x = self._record(mb, "embed", vocab_parallel_embedding(mb.tokens, self.params["embed.weight"],
                                                                      self.vocab_start, comm, tp))
        assert x is not None
        for i in self.layer_ids:
            x = self._layer(i, x, mb)
        if not self.is_last:
            return x
        with record_function(module_span_name("head")):
            normed = self._record(mb, "norm", rms_norm(x, self.params["norm.weight"], self.cfg.norm_eps))
            logits = self._record(mb, "logits",
                                  F.linear(gather_sequence(normed, comm, tp), self.params["head.weight"]))
            losses = self._record(mb, "token_loss",
                                  vocab_parallel_cross_entropy(logits, mb.targets, self.vocab_start, comm, tp))
            return losses.sum() / self.cfg.tokens_per_step
