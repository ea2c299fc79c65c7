"""Bitwise comparison: ULPs on the dtype's bit pattern, histograms, normwise error, first divergence."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numerics.compare import assert_bit_exact, compare, diff_buffer, ulp_distance


def _next_up(x: torch.Tensor, steps: int = 1) -> torch.Tensor:
    for _ in range(steps):
        x = torch.nextafter(x, torch.tensor(math.inf, dtype=x.dtype))
    return x


def test_identical_buffers_are_bit_exact():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    d = diff_buffer("w", x, x.clone())
    assert (d.mismatches, d.max_ulp, d.max_abs_err, d.rel_err, d.nan_mismatches) == (0, 0, 0.0, 0.0, 0)
    assert d.ulp_hist == {0: 100} and d.bit_exact


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_ulp_distance_counts_representable_values(dtype):
    x = torch.tensor([1.0, -3.5, 1e-3, 0.0], dtype=dtype)
    for steps in (1, 2, 5):
        assert ulp_distance(_next_up(x, steps), x).tolist() == [steps] * 4


def test_ulp_distance_in_bfloat16():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    assert ulp_distance(torch.tensor([1.0078125], dtype=torch.bfloat16), one).tolist() == [1]  # 1 + 2**-7
    assert ulp_distance(torch.tensor([1.015625], dtype=torch.bfloat16), one).tolist() == [2]


def test_ulp_distance_is_sign_aware_across_zero():
    tiny = torch.tensor([torch.finfo(torch.float32).smallest_normal * 2.0**-23])  # smallest subnormal
    assert ulp_distance(tiny, -tiny).tolist() == [2]
    pos0, neg0 = torch.tensor([0.0]), torch.tensor([-0.0])
    assert ulp_distance(pos0, neg0).tolist() == [0]
    d = diff_buffer("z", pos0, neg0)
    assert d.mismatches == 1 and d.max_ulp == 0  # bits differ, values do not


def test_ulp_distance_is_exact_for_the_full_float64_range():
    big = torch.tensor([torch.finfo(torch.float64).max], dtype=torch.float64)
    assert int(ulp_distance(big, -big)[0]) == 2 * 0x7FEF_FFFF_FFFF_FFFF


def test_histogram_buckets_by_powers_of_two_and_error_norms():
    expected = torch.ones(5)
    actual = torch.cat([_next_up(torch.ones(1), s) for s in (0, 1, 2, 3, 4)])
    c = compare({"b": actual}, {"b": expected})
    d = c.buffers[0]
    assert d.mismatches == 4 and d.max_ulp == 4
    assert d.ulp_hist == {0: 1, 1: 1, 2: 2, 3: 1}  # 0 | 1 | 2-3 | 4-7
    hist = c.ulp_histogram()
    assert hist.rows() == [("b", 0, 0, 1), ("b", 1, 1, 1), ("b", 2, 3, 2), ("b", 4, 7, 1)]
    err = (actual.double() - expected.double()).numpy()
    assert d.max_abs_err == pytest.approx(4 * 2.0**-23)
    assert d.rel_err == pytest.approx(np.linalg.norm(err) / math.sqrt(5))


def test_nan_on_one_side_is_an_infinite_error():
    d = diff_buffer("n", torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0]))
    assert d.nan_mismatches == 1 and d.mismatches == 1
    assert d.max_abs_err == math.inf and d.rel_err == math.inf
    same_nan = diff_buffer("n", torch.tensor([math.nan]), torch.tensor([math.nan]))
    assert same_nan.bit_exact and same_nan.max_abs_err == 0.0


def test_relative_error_against_a_zero_reference():
    assert diff_buffer("z", torch.zeros(3), torch.zeros(3)).rel_err == 0.0
    assert diff_buffer("z", torch.tensor([0.0, 1e-30, 0.0]), torch.zeros(3)).rel_err == math.inf


def test_first_divergent_follows_the_given_order_and_names_the_module():
    base = {f"layers.{i}.mlp.w1.weight": torch.full((4,), float(i)) for i in range(3)}
    bad = dict(base)
    bad["layers.1.mlp.w1.weight"] = _next_up(base["layers.1.mlp.w1.weight"])
    bad["layers.2.mlp.w1.weight"] = _next_up(base["layers.2.mlp.w1.weight"], 3)
    forward = compare(bad, base)
    assert not forward.bit_exact
    assert forward.first_divergent.name == "layers.1.mlp.w1.weight"
    backward = compare(bad, base, order=list(reversed(base)))
    assert backward.first_divergent.name == "layers.2.mlp.w1.weight"
    assert backward.first_divergent.module == "layers.2.mlp.w1"
    table = backward.table()
    assert table["buffer"].to_list() == list(reversed(base))
    assert table["mismatches"].to_list() == [4, 4, 0] and table["max_ulp"].to_list() == [3, 1, 0]
    assert compare(base, {k: v.clone() for k, v in base.items()}).first_divergent is None


def test_assert_bit_exact_reports_the_first_divergent_buffer():
    exp = {"loss": torch.tensor(2.5), "w.weight": torch.ones(3)}
    assert assert_bit_exact({k: v.clone() for k, v in exp.items()}, exp).bit_exact
    act = {"loss": torch.tensor(2.5), "w.weight": _next_up(torch.ones(3))}
    with pytest.raises(AssertionError, match=r"first divergent buffer 'w.weight' \(module w\): 3/3 elements differ, max 1 ULP"):
        assert_bit_exact(act, exp)


@pytest.mark.parametrize(
    "actual, expected, order, message",
    [
        ({"a": torch.zeros(2)}, {"b": torch.zeros(2)}, None, r"only in actual \['a'\], only in expected \['b'\]"),
        ({"a": torch.zeros(2)}, {"a": torch.zeros(3)}, None, "buffer 'a': actual is \\(2,\\)"),
        ({"a": torch.zeros(2)}, {"a": torch.zeros(2, dtype=torch.float64)}, None, "torch.float64"),
        ({"a": torch.zeros(2, dtype=torch.int32)}, {"a": torch.zeros(2, dtype=torch.int32)}, None, "bitwise comparison supports"),
        ({"a": torch.zeros(2), "b": torch.zeros(1)}, {"a": torch.zeros(2), "b": torch.zeros(1)}, ["a"], r"missing \['b'\]"),
        ({"a": torch.zeros(2)}, {"a": torch.zeros(2)}, ["a", "a"], "repeated"),
        ({"a": torch.zeros(2)}, {"a": torch.zeros(2)}, ["a", "c"], r"unknown \['c'\]"),
    ],
)
def test_bad_input_raises_a_clear_error(actual, expected, order, message):
    with pytest.raises(ValueError, match=message):
        compare(actual, expected, order)


@settings(max_examples=80, deadline=None)
@given(
    x=st.floats(width=32, allow_nan=False, allow_infinity=False),
    up=st.integers(min_value=0, max_value=100),
    down=st.integers(min_value=0, max_value=100),
)
def test_ulp_distance_is_additive_along_the_float_line(x, up, down):
    # walking `down` steps below x and `up` steps above it, across zero and binade edges included
    mid = torch.tensor([x], dtype=torch.float32)
    hi = _next_up(mid, up)
    lo = mid
    for _ in range(down):
        lo = torch.nextafter(lo, torch.tensor(-math.inf))
    if math.isinf(hi.item()) or math.isinf(lo.item()):
        return
    assert int(ulp_distance(hi, mid)[0]) == up and int(ulp_distance(mid, lo)[0]) == down
    assert int(ulp_distance(hi, lo)[0]) == int(ulp_distance(lo, hi)[0]) == up + down


def test_ulps_are_counted_in_the_dtype_the_value_was_rounded_to():
    """A bf16 gradient stored as fp32: one bf16 step is 1 ULP, not 65,536 fp32 ULPs."""
    a = torch.tensor([1.0, 2.0, -3.0]).to(torch.bfloat16)
    b = a.clone()
    b[1] = torch.tensor(2.015625, dtype=torch.bfloat16)  # the next bf16 after 2.0 (8 bits of mantissa)
    as_fp32 = diff_buffer("g", b.float(), a.float())
    assert as_fp32.max_ulp == 65536 and as_fp32.dtype == "float32"
    in_bf16 = diff_buffer("g", b.float(), a.float(), torch.bfloat16)
    assert in_bf16.max_ulp == 1 and in_bf16.dtype == "bfloat16" and in_bf16.mismatches == 1
    # bits below bf16 resolution still count: a mismatch is never 0 ULP
    c = a.float().clone()
    c[0] = torch.nextafter(c[0:1], torch.tensor([2.0]))[0]
    assert diff_buffer("g", c, a.float(), torch.bfloat16).max_ulp == 1
    comparison = compare({"g": b.float()}, {"g": a.float()}, dtypes={"g": torch.bfloat16})
    assert comparison.buffers[0].max_ulp == 1
