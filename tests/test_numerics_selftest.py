"""Real gloo collectives (8 spawned ranks, groups of 2, 3, 4 and 8, fp32 and bf16, sizes across the
segment boundaries) match the reduction-order models bit for bit. One spawn for the whole module."""

import dataclasses

import polars as pl
import pytest
from click.testing import CliRunner

import numerics.gloo_selftest as selftest
from numerics.cli import main
from numerics.gloo_selftest import GlooModelMismatch, check_gloo_matches_model, run_gloo_selftest


@pytest.fixture(scope="module")
def report():
    return run_gloo_selftest()


def test_every_real_collective_matches_its_model_bit_for_bit(report):
    check_gloo_matches_model(report)  # raises GlooModelMismatch with the failing cases
    assert report.ok


def test_coverage_of_group_sizes_dtypes_collectives_and_segment_regimes(report):
    t = report.table()
    expected_rows = sum(len(c.ranks) for c in selftest.make_cases(selftest.DEFAULT_GROUPS, selftest.DEFAULT_SIZES))
    assert t.height == expected_rows
    assert set(t["n"]) == {2, 3, 4, 8}
    assert set(t["dtype"]) == {"float32", "bfloat16"}
    assert set(zip(t["collective"], t["op"], t["order"])) == set(selftest.COLLECTIVES)
    rows = t.rows(named=True)
    # segment count set by the tensor's bytes (> 2n MiB) and rounded up to a multiple of n
    assert any(r["num_segments"] > 2 * r["n"] and r["num_segments"] % r["n"] == 0 for r in rows)
    assert any(r["numel"] * (2 if r["dtype"] == "bfloat16" else 4) > 1 << 20 for r in rows)
    assert any(r["numel"] < r["num_segments"] for r in rows)  # empty segments
    assert any(r["numel"] % 2 == 1 and r["numel"] > 1 for r in rows)


def test_inputs_tell_the_orders_apart(report):
    # With 3 or more ranks the ring and canonical orders associate differently: every collective of a
    # non-trivial size must differ somewhere from the other order's model, or the test could not fail.
    # (Single rank results may coincide: with n = 3, chunk 2 is (x1 + x0) + x2 in both orders.)
    t = report.table().filter((pl.col("n") >= 3) & (pl.col("numel") >= 1001))
    per_case = t.group_by("case_id").agg(pl.col("other_order_mismatches").sum())
    assert per_case.height == t["case_id"].n_unique() > 0
    assert (per_case["other_order_mismatches"] > 0).all()
    zero = t.filter(pl.col("other_order_mismatches") == 0)
    assert set(zero["n"]) <= {3} and set(zero["collective"]) <= {"reduce_scatter"}


def test_a_mismatch_fails_loudly(report):
    broken = dataclasses.replace(report.results[0], mismatches=5)
    bad = dataclasses.replace(report, results=(broken,) + report.results[1:])
    assert not bad.ok
    with pytest.raises(GlooModelMismatch, match="no longer matches the reduction-order model") as err:
        check_gloo_matches_model(bad)
    assert "1 rank results" in str(err.value)


def test_bad_groups_are_rejected_before_spawning():
    with pytest.raises(ValueError, match=r"group \(0, 8\) is not a set of ranks of a 8-rank world"):
        run_gloo_selftest(world_size=8, groups=((0, 8),))


def test_cli_selftest_exit_codes(report, monkeypatch):
    monkeypatch.setattr(selftest, "run_gloo_selftest", lambda world_size: report)
    ok = CliRunner().invoke(main, ["selftest"])
    assert ok.exit_code == 0, ok.output
    assert f"ok: {len(report.results)} rank results" in ok.output
    broken = dataclasses.replace(report, results=(dataclasses.replace(report.results[0], mismatches=1),) + report.results[1:])
    monkeypatch.setattr(selftest, "run_gloo_selftest", lambda world_size: broken)
    bad = CliRunner().invoke(main, ["selftest"])
    assert bad.exit_code == 1
    assert "no longer matches" in bad.output
