import itertools

import pytest

from tracekit.topology import DIMS, Layout, LayoutError, dims_label


def test_rank_formula_matches_view_order():
    lay = Layout(tp=2, cp=2, pp=2, dp=2)
    # arange(world).view(DP, PP, CP, TP)
    for dp, pp, cp, tp in itertools.product(range(2), repeat=4):
        r = lay.rank_of(dp=dp, pp=pp, cp=cp, tp=tp)
        assert r == ((dp * 2 + pp) * 2 + cp) * 2 + tp
        c = lay.coords(r)
        assert (c.dp, c.pp, c.cp, c.tp) == (dp, pp, cp, tp)


def test_groups_of_each_dimension():
    lay = Layout(tp=2, cp=2, pp=2, dp=2)
    assert lay.group(5, "tp") == (4, 5)
    assert lay.group(5, "cp") == (5, 7)
    assert lay.group(5, "pp") == (1, 5)
    assert lay.group(5, "dp") == (5, 13)
    assert lay.group(5, ("dp", "cp")) == (5, 7, 13, 15)
    assert len(lay.groups("tp")) == 8
    assert sorted(r for g in lay.groups("cp") for r in g) == list(range(16))
    assert lay.dim_of([13, 5]) == "dp"
    assert lay.dim_of([5, 7, 13, 15]) == "dp_cp"
    assert lay.dim_of(range(16)) == "dp_pp_cp_tp" or lay.dim_of(range(16)) == "world"
    assert lay.dim_of([0, 3]) is None
    assert lay.stride("pp") == 4
    assert dims_label(("cp", "dp")) == "dp_cp"


def test_invalid_layouts_raise():
    with pytest.raises(LayoutError):
        Layout(tp=0)
    with pytest.raises(LayoutError):
        Layout(tp=2).coords(2)
    with pytest.raises(LayoutError):
        Layout(tp=2, dp=2).rank_of(tp=2)


@pytest.mark.parametrize("sizes", [(2, 2, 2, 2), (4, 1, 2, 2), (2, 1, 1, 8), (2, 1, 2, 4)])
def test_infer_from_all_groups(sizes):
    tp, cp, pp, dp = sizes
    lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp)
    groups = [g for d in ("tp", "cp", "pp", "dp") if lay.size(d) > 1 for g in lay.groups(d)]
    assert Layout.infer(lay.world_size, groups) == lay


def test_infer_ambiguous_groups_default_to_tp_and_dp_unless_described():
    lay = Layout(cp=2, pp=4)
    groups = lay.groups("cp") + lay.groups("pp")
    assert Layout.infer(8, groups) == Layout(tp=2, dp=4)
    hints = {g: "cp" for g in lay.groups("cp")} | {g: "pp" for g in lay.groups("pp")}
    assert Layout.infer(8, groups, hints) == lay


def test_infer_uses_hints_to_break_ties():
    # Only stride-2 groups of size 2 in an 8-rank world: cp or pp? The description decides.
    lay = Layout(tp=2, pp=2, dp=2)
    groups = lay.groups("pp") + lay.groups("tp")
    hints = {g: "pp" for g in lay.groups("pp")}
    assert Layout.infer(8, groups, hints) == lay
    with pytest.raises(LayoutError):
        Layout.infer(4, [[0, 7]])


def test_a_layout_with_pp_outermost_numbers_ranks_as_torchtitan_and_megatron_do():
    """init_device_mesh(("pp", "dp", "tp")) of 2 x 2 x 2: rank = tp + 2 * (dp + 2 * pp)."""
    from tracekit.topology import PP_OUTERMOST, order_from_coords

    lay = Layout(tp=2, pp=2, dp=2, order=PP_OUTERMOST)
    assert [tuple(lay.coords(r).as_dict().values()) for r in (1, 2, 5, 6)] == \
        [(0, 0, 0, 1), (1, 0, 0, 0), (0, 1, 0, 1), (1, 1, 0, 0)]  # (dp, pp, cp, tp)
    assert all(lay.rank_of(**lay.coords(r).as_dict()) == r for r in range(8))
    assert lay.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)] and lay.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.dim_of((0, 2)) == "dp" and lay.dim_of((0, 4)) == "pp" and str(lay) == "pp2xdp2xcp1xtp2"
    assert lay != Layout(tp=2, pp=2, dp=2)
    # an order matters only among dimensions above 1: with pp = 1 it numbers ranks as DIMS does
    assert Layout(tp=2, dp=4, order=PP_OUTERMOST) == Layout(tp=2, dp=4)
    with pytest.raises(LayoutError):
        Layout(tp=2, order=("tp", "cp", "pp"))
    # the order is recovered from the ranks' coordinates (what the store keeps)
    rows = [(r, *lay.coords(r).as_dict().values()) for r in range(8)]
    assert order_from_coords(lay.as_dict(), rows) == PP_OUTERMOST
    assert order_from_coords(lay.as_dict(), []) == DIMS
