"""Precision flags: accumulation errors against fp64 and the needs-FP32 rule, checked against the
figures in ALGORITHMS.md (Numerics) and against hand-computed bf16 cases."""

import pytest
import torch

from numerics.precision import accumulate, buffer_precision, precision_table, synthetic_terms

NUMEL = 32768

# ALGORITHMS.md: bf16 buffer error vs fp64 with k noisy micro-batches
PUBLISHED_BF16_ERROR = {1: 1.7e-3, 4: 3.2e-3, 16: 5.3e-3, 64: 9.8e-3}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def by_k():
    return {k: buffer_precision(f"k{k}", synthetic_terms(k, 1, NUMEL, seed=k)) for k in (1, 4, 8, 16, 64)}


@pytest.mark.parametrize("k", sorted(PUBLISHED_BF16_ERROR))
def test_bf16_buffer_error_matches_the_published_figures(by_k, k):
    assert by_k[k].err_bf16 == pytest.approx(PUBLISHED_BF16_ERROR[k], rel=0.08)


def test_fp32_buffer_and_storage_floor_stay_at_one_bf16_rounding(by_k):
    for p in by_k.values():
        assert p.err_fp32 == pytest.approx(1.7e-3, rel=0.08)
        assert p.storage_floor == pytest.approx(1.7e-3, rel=0.08)
    assert by_k[1].err_bf16 == by_k[1].storage_floor  # one term: the buffer is the rounded exact sum


def test_verdict_flips_between_4_and_8_noisy_terms(by_k):
    assert [by_k[k].needs_fp32 for k in (1, 4, 8, 16, 64)] == [False, False, True, True, True]
    assert by_k[4].ratio == pytest.approx(1.9, abs=0.1) and by_k[64].ratio > 5
    assert "(> 2x); needs FP32" in by_k[8].reason
    assert "(<= 2x); BF16 accumulation is fine" in by_k[4].reason


def test_threshold_is_the_rule(by_k):
    terms = synthetic_terms(8, 1, NUMEL, seed=8)
    assert not buffer_precision("w", terms, threshold=3.0).needs_fp32
    assert buffer_precision("w", terms, threshold=2.0).ratio == by_k[8].ratio


def test_terms_are_micro_batches_times_dp_and_dp_uses_the_reduction_order():
    terms = synthetic_terms(4, 3, 4096, seed=1)
    ring = buffer_precision("w", terms, order="gloo_ring")
    assert (ring.micro_batches, ring.dp, ring.terms) == (4, 3, 12)
    # 3 DP ranks: the ring and canonical orders associate differently, so the bf16 buffers differ
    assert not torch.equal(accumulate(terms, torch.bfloat16, order="gloo_ring"), accumulate(terms, torch.bfloat16, order="canonical"))


def test_hand_computed_bf16_absorption():
    # 1 + 2**-8 is a tie that rounds back to 1 in bf16: both small additions are swallowed
    terms = torch.tensor([1.0, 2.0**-8, 2.0**-8]).reshape(3, 1, 1)
    p = buffer_precision("w", terms)
    assert accumulate(terms, torch.bfloat16).item() == 1.0
    assert accumulate(terms, torch.float32).item() == 1.0 + 2.0**-7
    assert p.err_bf16 == pytest.approx(2.0**-7 / (1 + 2.0**-7))
    assert p.err_fp32 == 0.0 and p.storage_floor == 0.0  # the exact sum is representable in bf16
    assert p.absorbed == 1.0 and p.needs_fp32 and p.ratio == float("inf")


def test_zero_exact_sum_is_not_flagged_when_accumulation_is_exact():
    x = torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(0))
    p = buffer_precision("w", torch.cat([x, -x]))
    assert (p.err_bf16, p.storage_floor, p.needs_fp32) == (0.0, 0.0, False)


def test_precision_table_has_one_row_per_buffer():
    table = precision_table({"a": synthetic_terms(2, 1, 64, seed=0), "b": synthetic_terms(16, 2, 64, seed=1)})
    assert table["buffer"].to_list() == ["a", "b"]
    assert table["terms"].to_list() == [2, 32]
    assert {"err_bf16", "err_fp32", "storage_floor", "ratio", "needs_fp32", "reason"} <= set(table.columns)


@pytest.mark.parametrize(
    "terms, kwargs, message",
    [
        (torch.zeros(4, 8), {}, r"shape \(micro_batches, dp, \*buffer_shape\)"),
        (torch.zeros(0, 1, 8), {}, "shape"),
        (torch.zeros(2, 1, 8, dtype=torch.bfloat16), {}, "exact \\(fp32/fp64\\) gradients"),
        (torch.zeros(2, 1, 8), {"threshold": 0.0}, "threshold must be positive"),
        (torch.zeros(2, 1, 8), {"order": "tree"}, "unknown reduction order"),
    ],
)
def test_bad_input_is_rejected(terms, kwargs, message):
    with pytest.raises(ValueError, match=message):
        buffer_precision("w", terms, **kwargs)


def test_synthetic_stream_rejects_empty_shapes():
    with pytest.raises(ValueError, match="micro_batches, dp, numel >= 1"):
        synthetic_terms(0, 1, 8)
