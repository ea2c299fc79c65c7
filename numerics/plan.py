"""Accumulation plan: every order and dtype in which a parallel training step adds numbers, derived
from the run's config values (``numerics.run_config``; nothing of the trainer's code).

The sequential reference (``numerics.reference_model``) follows this plan to reproduce a parallel
step bit for bit. What it fixes:

- parameters: canonical names, full shapes, TP split dimension, initial values (seeded per name);
- TP: which slice of each weight a TP rank holds (the split of a row-parallel GEMM's contracted
  dimension), the reduction model of the partial sums (sequence reduce-scatter, vocab-parallel loss
  sums, norm-weight gradients);
- CP: the global positions each CP rank holds (chunks i and 2cp-1-i, or per document), the order
  in which K/V are gathered (CP rank order) and the dK/dV reduce-scatter model;
- PP: the layers of each virtual stage; one flat gradient bucket per virtual stage, micro-batches
  accumulated in ascending order in ``grad_accum_dtype``;
- DP: the flat bucket (TP-sharded parameters first, then norm weights, padded to a multiple of
  dp*cp), reduced over the DP x CP group (group index dp*cp + cp) in ``reduce_dtype``; ZeRO-1 once per
  step, ZeRO-2 after every micro-batch; AdamW on each rank's fp32 master shard.

Reduction model: ``native`` on gloo is gloo's ring (``reduction_order.GlooRing``); ``canonical`` is the
rank-ordered chained sum. Native NCCL reductions are not modelled.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cached_property

import polars as pl
import torch

from numerics.reduction_order import ReductionOrder, get_order
from numerics.run_config import RunConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}  # fp64: precision experiments only
LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w1", "w3", "w2")


class PlanError(ValueError):
    """A config whose accumulation order cannot be emulated."""


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # None: replicated over TP (norm weights)

    def initial(self, seed: int) -> torch.Tensor:
        """The canonical initial value: ones for norms, N(0, 0.02^2) from a per-name seeded generator."""
        if self.tp_dim is None:
            return torch.ones(self.shape)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(self.name.encode())) % 2**63)
        return torch.randn(self.shape, generator=gen) * 0.02

    def tp_slice(self, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        if self.tp_dim is None or tp == 1:
            return full.clone()
        return full.chunk(tp, dim=self.tp_dim)[tp_rank].clone()


@dataclass(frozen=True)
class BucketPlan:
    """The flat gradient bucket of one virtual stage on one TP rank (same layout for every TP rank)."""

    vstage: int
    params: tuple[Param, ...]  # flat order: TP-sharded first, then replicated
    shard_numels: tuple[int, ...]  # elements of each parameter's TP shard
    padded: int  # flat length, a multiple of dp*cp
    shard_len: int

    @property
    def offsets(self) -> list[int]:
        out, off = [], 0
        for n in self.shard_numels:
            out.append(off)
            off += n
        return out

    @property
    def replicated(self) -> slice:
        n_rep = sum(n for p, n in zip(self.params, self.shard_numels) if p.tp_dim is None)
        total = sum(self.shard_numels)
        return slice(total - n_rep, total)


def _params(cfg: RunConfig, vstage: int) -> list[Param]:
    h, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    shapes = {"attn_norm": ((h,), None), "wq": ((cfg.n_heads * hd, h), 0), "wk": ((cfg.n_kv_heads * hd, h), 0),
              "wv": ((cfg.n_kv_heads * hd, h), 0), "wo": ((h, cfg.n_heads * hd), 1), "mlp_norm": ((h,), None),
              "w1": ((f, h), 0), "w3": ((f, h), 0), "w2": ((h, f), 1)}
    out = [Param("embed.weight", (cfg.vocab_size, h), 0)] if vstage == 0 else []
    for i in cfg.stage_layers()[vstage]:
        out += [Param(f"layers.{i}.{n}.weight", *shapes[n]) for n in LAYER_PARAMS]
    if vstage == cfg.n_vstages_total - 1:
        out += [Param("norm.weight", (h,), None), Param("head.weight", (cfg.vocab_size, h), 0)]
    return out


# Where the reference adds over ranks or micro-batches; each can be given another order (the
# bug-or-order envelope re-runs the reference with one site changed at a time).
SITES = {"tp": "TP collectives (sequence reduce-scatter, vocab-parallel loss sums, norm-weight grads)",
         "cp": "CP K/V gradient reduce-scatter", "dp": "DP x CP gradient reduce-scatter",
         "loss": "loss all-reduce over DP x CP", "accum": "micro-batch gradient accumulation"}


@dataclass(frozen=True)
class AccumulationPlan:
    cfg: RunConfig
    overrides: tuple[tuple[str, str], ...] = ()  # (site, order name): an alternative order at that site

    @classmethod
    def from_config(cls, cfg) -> "AccumulationPlan":
        """From a RunConfig or the values of any config (a mapping, or an object with ``as_dict``)."""
        cfg = RunConfig.coerce(cfg)
        if cfg.reduce_order == "native" and cfg.backend == "nccl":
            raise PlanError("native NCCL reductions have no bit-exact model: run with reduce_order=canonical")
        return cls(cfg)

    # -- dtypes and orders -------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.compute_dtype]

    @property
    def accum_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.grad_accum_dtype]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.reduce_dtype]

    @property
    def order(self) -> ReductionOrder:
        """How every sum over ranks (TP, CP, DP x CP) associates."""
        return get_order("canonical" if self.cfg.reduce_order == "canonical" else "gloo_ring")

    def order_of(self, site: str) -> ReductionOrder:
        """The order of the sums at ``site`` (``SITES``): the run's, unless overridden."""
        return get_order(dict(self.overrides)[site]) if site in dict(self.overrides) else self.order

    def with_order(self, site: str, order: str) -> "AccumulationPlan":
        if site not in SITES:
            raise ValueError(f"unknown reduction site {site!r}; expected one of {sorted(SITES)}")
        return AccumulationPlan(self.cfg, tuple(sorted({**dict(self.overrides), site: order}.items())))

    # -- parameters and buckets ----------------------------------------------------------------
    @cached_property
    def stage_layers(self) -> list[range]:
        """Layers of each virtual stage (the trainer's partition: first and last stages shed one)."""
        return self.cfg.stage_layers()

    @cached_property
    def stage_params(self) -> list[list[Param]]:
        return [_params(self.cfg, vs) for vs in range(self.cfg.n_vstages_total)]

    @cached_property
    def buckets(self) -> list[BucketPlan]:
        c, out = self.cfg, []
        for vs, params in enumerate(self.stage_params):
            flat = [p for p in params if p.tp_dim is not None] + [p for p in params if p.tp_dim is None]
            numels = tuple(_numel(p.shape) // (c.tp if p.tp_dim is not None else 1) for p in flat)
            n = c.dp * c.cp
            padded = -(-sum(numels) // n) * n
            out.append(BucketPlan(vs, tuple(flat), numels, padded, padded // n))
        return out

    @property
    def params(self) -> list[Param]:
        return [p for ps in self.stage_params for p in ps]

    def backward_order(self) -> list[str]:
        """Canonical names in the order backward produces their gradients (head first, embedding
        last; within a layer the reverse of the forward use)."""
        names = ["head.weight", "norm.weight"]
        for i in reversed(range(self.cfg.n_layers)):
            names += [f"layers.{i}.{n}.weight" for n in ("w2", "w3", "w1", "mlp_norm", "wo", "wv", "wk", "wq", "attn_norm")]
        return names + ["embed.weight"]

    def dp_cp_index(self, dp: int, cp: int) -> int:
        """Group-local index in the DP x CP group (CP varies fastest, as in the rank layout)."""
        return dp * self.cfg.cp + cp

    # -- context parallelism ------------------------------------------------------------------
    def cp_positions(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """[b, S] document ids -> [b, cp, S/cp] global positions each CP rank holds (ascending)."""
        return torch.stack([self._cp_positions_row(row) for row in doc_ids])

    def _cp_positions_row(self, doc: torch.Tensor) -> torch.Tensor:
        cp, s = self.cfg.cp, doc.numel()
        n_pieces = 2 * cp
        owner_of_piece = [p if p < cp else n_pieces - 1 - p for p in range(n_pieces)]
        owner = torch.empty(s, dtype=torch.long)
        if self.cfg.cp_sharding == "sequence":
            piece = s // n_pieces
            for p in range(n_pieces):
                owner[p * piece:(p + 1) * piece] = owner_of_piece[p]
        else:  # per document: 2cp pieces per document, remainders dealt round-robin across documents
            starts = [0] + [j for j in range(1, s) if doc[j] != doc[j - 1]] + [s]
            dealt = 0
            for a, b in zip(starts[:-1], starts[1:]):
                piece = (b - a) // n_pieces
                for p in range(n_pieces):
                    owner[a + p * piece:a + (p + 1) * piece] = owner_of_piece[p]
                for j in range(a + n_pieces * piece, b):
                    owner[j] = dealt % cp
                    dealt += 1
        return torch.stack([torch.nonzero(owner == r).flatten() for r in range(cp)])

    # -- a table people can read ------------------------------------------------------------------
    def describe(self) -> pl.DataFrame:
        c, order = self.cfg, self.order.name
        rows = [
            ("TP", f"{c.tp} ranks", "row-parallel partial sums reduce-scattered along the sequence; "
             "vocab-parallel loss sums; norm-weight grads all-reduced", order, c.compute_dtype),
            ("CP", f"{c.cp} ranks", f"{c.cp_sharding} sharding into {2 * c.cp} pieces, K/V gathered in "
             "CP rank order, dK/dV reduce-scattered", order, c.compute_dtype),
            ("PP", f"{c.pp} ranks x {c.vstages} virtual", "one bucket per virtual stage, micro-batches "
             "added in ascending order", "chained", c.grad_accum_dtype),
            ("DP", f"{c.dp} x CP {c.cp}", f"flat bucket reduce-scattered over DP x CP (ZeRO-{c.zero_stage}), "
             "AdamW on fp32 master shards", order, c.reduce_dtype),
        ]
        return pl.DataFrame(rows, schema=["dimension", "size", "what is summed", "order", "dtype"], orient="row")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
