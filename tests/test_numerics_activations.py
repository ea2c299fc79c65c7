"""Reassembly of rank shards into full activations by the plan, and locating where they differ
(no spawn: shards are cut from known full tensors the way the trainer's ranks hold them)."""

from __future__ import annotations

import pytest
import torch

from numerics.activations import ActivationRecordError, _ranges, assemble, locate, plan_positions
from numerics.plan import AccumulationPlan
from reference_trainer.activations import activation_points, shard_key
from reference_trainer.config import TrainConfig

CFG = TrainConfig(n_layers=1, dim=8, n_heads=2, n_kv_heads=2, ffn_dim=16, vocab_size=16, seq_len=16,
                  tp=2, cp=2, dp=2, micro_batches=2, micro_batch_size=2, cp_sharding="document",
                  doc_len_mean=5.0, dump_state=True, record_activations=True)


def _shards(plan: AccumulationPlan, fulls: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut full [dp, mb, b, S, ...] tensors into the per-rank shards the trainer records."""
    c, pos = plan.cfg, plan_positions(plan, 0)
    out = {}
    for point, kind in activation_points(c):
        for d in range(c.dp):
            for i in range(c.micro_batches):
                for cp in range(c.cp):
                    p = pos[d][i][:, cp]
                    local = fulls[point][d, i][torch.arange(p.shape[0])[:, None], p]  # [b, S/cp, ...]
                    for t in range(c.tp):
                        if kind == "seq":
                            part = local.chunk(c.tp, 1)[t]
                        elif kind == "last":
                            part = local.chunk(c.tp, -1)[t]
                        else:
                            part = local[..., t]
                        out[shard_key(point, d, cp, t, i)] = part.contiguous()
    return out


def _fulls(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    lead = (cfg.dp, cfg.micro_batches, cfg.micro_batch_size, cfg.seq_len)
    width = {"seq": (cfg.dim,), "last": (cfg.dim,), "tokens": (cfg.tp,)}
    gen = torch.Generator().manual_seed(0)
    return {p: torch.randn(*lead, *width[k], generator=gen).to(torch.bfloat16) for p, k in activation_points(cfg)}


def test_assemble_inverts_the_rank_sharding_with_document_cp_positions():
    plan = AccumulationPlan.from_config(CFG)
    fulls = _fulls(CFG)
    got = assemble(plan, _shards(plan, fulls), plan_positions(plan, 0), "test")
    assert list(got) == [p for p, _ in activation_points(CFG)]
    for point, full in fulls.items():
        assert torch.equal(got[point].view(torch.int16), full.view(torch.int16)), point


def test_locate_reports_the_first_micro_batch_in_execution_order_and_its_tokens():
    a = torch.zeros(2, 3, 2, 16, 4)
    b = a.clone()
    b[1, 0, 1, 5, 2] = 1.0  # dp 1, micro-batch 0: runs before dp 0's micro-batch 2
    b[1, 0, 1, 7:10] = -0.0  # a sign bit is a difference too
    b[0, 2, 0, 3] = 2.0
    where = locate("x", b, a)
    assert (where.dp, where.micro_batch, where.sequence, where.tokens) == (1, 0, 1, (5, 7, 8, 9))
    assert (where.micro_batches_differing, where.micro_batches_total) == (2, 6)
    assert where.describe() == "micro-batch 0 (dp 1), sequence 1: tokens 5, 7..9 differ (4 tokens; 2/6 micro-batches differ)"
    assert locate("x", a, a.clone()) is None


def test_ranges_compress_and_truncate():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0..2, 5, 7..8"
    assert _ranges(list(range(0, 20, 2)), limit=3) == "0, 2, 4, ... (7 more runs)"


def test_a_shard_of_the_wrong_size_is_named():
    plan = AccumulationPlan.from_config(CFG)
    shards = _shards(plan, _fulls(CFG))
    key = shard_key("layers.0.mlp", 1, 1, 0, 1)
    shards[key] = shards[key][:, :-1]
    with pytest.raises(ActivationRecordError, match=r"run X: layers.0.mlp of dp 1 micro-batch 1 CP rank 1 covers"):
        assemble(plan, shards, plan_positions(plan, 0), "run X")
