"""Reduction-order models: segment layout, add order, ops, and input validation (no processes spawned;
the models are checked against real gloo in test_numerics_selftest.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from numerics.reduction_order import ORDERS, Canonical, GlooRing, chained_sum, get_order, ring_plan

BF16_HALF_ULP_OF_ONE = 2.0**-8  # 1 + 2**-8 is a tie in bf16 and rounds to even (1.0)


def test_ring_plan_segment_count_set_by_ranks_for_small_tensors():
    plan = ring_plan(numel=7, element_size=4, n=8)
    assert plan.num_segments == 16  # max(ceil(28 B / 1 MiB), 2n) rounded up to a multiple of n
    assert plan.segment_elems == 1  # ceil(28 / 16) = 2 bytes, rounded up to one 4-byte element
    assert plan.segments_per_rank == 2
    assert [plan.chunk_range(c) for c in range(8)] == [(0, 2), (2, 4), (4, 6), (6, 7)] + [(7, 7)] * 4


def test_ring_plan_segment_count_set_by_bytes_and_rounded_to_multiple_of_n():
    plan = ring_plan(numel=1_800_001, element_size=4, n=3)  # 7,200,004 B -> 7 segments of <= 1 MiB -> 9
    assert plan.num_segments == 9
    assert plan.segment_elems == 200_001  # ceil(7,200,004 / 9) = 800,001 B -> 800,004 B
    assert [plan.chunk_range(c) for c in range(3)] == [(0, 600_003), (600_003, 1_200_006), (1_200_006, 1_800_001)]
    bf16 = ring_plan(numel=2_200_001, element_size=2, n=2)  # 4.4 MB -> 5 -> 6 segments
    assert bf16.num_segments == 6


def test_add_order_walks_down_the_ring_and_ends_with_the_owner():
    plan = ring_plan(numel=100, element_size=4, n=4)
    assert plan.add_order(0) == [3, 2, 1, 0]
    assert plan.add_order(2) == [1, 0, 3, 2]


def test_chained_sum_rounds_every_add_in_the_tensor_dtype():
    one, tiny = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([BF16_HALF_ULP_OF_ONE], dtype=torch.bfloat16)
    # ((1 + t) + t): each add is a tie that rounds back to 1
    assert chained_sum([one, tiny, tiny]).item() == 1.0
    # ((t + t) + 1): 1 + 2**-7 is representable
    assert chained_sum([tiny, tiny, one]).item() == 1.0 + 2.0**-7
    # torch's own bf16 sum accumulates in fp32 and gets the other answer: never use it for emulation
    assert torch.stack([one, tiny, tiny]).sum(0).item() == 1.0 + 2.0**-7


def test_ring_and_canonical_orders_differ_where_association_matters():
    # 3 ranks, 1 element: chunk 0 is owned by rank 0 and summed as (x2 + x1) + x0
    xs = [torch.tensor([v], dtype=torch.bfloat16) for v in (1.0, BF16_HALF_ULP_OF_ONE, BF16_HALF_ULP_OF_ONE)]
    assert GlooRing().all_reduce(xs).item() == 1.0 + 2.0**-7
    assert Canonical().all_reduce(xs).item() == 1.0
    assert GlooRing().all_reduce(xs, "avg").item() == torch.tensor(1.0 + 2.0**-7, dtype=torch.bfloat16).div(3).item()


def test_ring_chunks_follow_their_owner_order():
    # 3 ranks, 6 elements -> 6 segments of 1 element, 2 per rank; value pattern makes each owner visible
    n, numel = 3, 6
    xs = [torch.zeros(numel, dtype=torch.bfloat16) for _ in range(n)]
    for c in range(n):
        lo, hi = ring_plan(numel, 2, n).chunk_range(c)
        # the owner's input is 1, the others are half-ULP ties: owner last -> 1 + 2**-7, owner first -> 1
        for r in range(n):
            xs[r][lo:hi] = 1.0 if r == c else BF16_HALF_ULP_OF_ONE
    out = GlooRing().all_reduce(xs)
    assert torch.equal(out, torch.full((numel,), 1.0 + 2.0**-7, dtype=torch.bfloat16))
    assert torch.equal(Canonical().all_reduce(xs)[:2], torch.ones(2, dtype=torch.bfloat16))  # chunk 0: rank 0 first


def test_reduce_scatter_is_the_all_reduce_split_along_dim0():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 3, generator=gen) for _ in range(4)]
    for order in ORDERS.values():
        full = order.all_reduce(xs, "avg")
        parts = order.reduce_scatter(xs, "avg")
        assert [p.shape for p in parts] == [torch.Size([2, 3])] * 4
        assert torch.equal(torch.cat(parts), full)


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(min_value=0, max_value=3000),
    n=st.integers(min_value=1, max_value=9),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
)
def test_every_element_is_reduced_exactly_once(numel, n, dtype):
    # small integers add exactly in every order, so any order must give the exact sum on every element
    xs = [torch.arange(numel, dtype=torch.float64).remainder(7).add(r).to(dtype) for r in range(n)]
    exact = sum(x.double() for x in xs)
    for order in ORDERS.values():
        assert torch.equal(order.all_reduce(xs).double(), exact)
    covered = sum(hi - lo for lo, hi in (ring_plan(numel, xs[0].element_size(), n).chunk_range(c) for c in range(n)))
    assert covered == numel


@pytest.mark.parametrize(
    "inputs, op, message",
    [
        ([], "sum", "at least one"),
        ([torch.zeros(3), torch.zeros(4)], "sum", "rank 1 input"),
        ([torch.zeros(3), torch.zeros(3, dtype=torch.float64)], "sum", "rank 1 input"),
        ([torch.zeros(3, dtype=torch.int32)] * 2, "sum", "floating-point"),
        ([torch.zeros(3)] * 2, "max", "unsupported reduce op"),
    ],
)
def test_bad_inputs_are_rejected(inputs, op, message):
    for order in ORDERS.values():
        with pytest.raises(ValueError, match=message):
            order.all_reduce(inputs, op)


def test_reduce_scatter_rejects_uneven_split_and_unknown_order():
    with pytest.raises(ValueError, match="does not split into 3"):
        GlooRing().reduce_scatter([torch.zeros(4)] * 3)
    with pytest.raises(ValueError, match="unknown reduction order 'tree'"):
        get_order("tree")
    with pytest.raises(ValueError):
        chained_sum([])
