"""Collective matching (wait / transfer) and clock alignment from matched completions."""

from __future__ import annotations

import polars as pl
import pytest
from synthetic_job import MS, Faults, make_job

from tracekit.analysis.collectives import align_clocks, instance_summary, match_collectives, with_clock_offsets
from tracekit.analysis.tables import RunTables, TablesError
from tracekit.topology import Layout


def _tables(colls: list[tuple], groups: list[tuple], hosts: dict[int, str], p2p: list[tuple] = ()) -> RunTables:
    world = max(hosts) + 1
    job = make_job(layout=Layout(dp=world), steps=1, microbatches=1)  # for the other tables' shapes
    job["collectives"] = pl.DataFrame(
        [("t", r, pg, seq, "all_reduce", s, e, None, None, 0, "annotation") for r, pg, seq, s, e in colls],
        schema=job["collectives"].schema, orient="row")
    job["groups"] = pl.DataFrame([("t", pg, pg, "dp", ranks, len(ranks)) for pg, ranks in groups],
                                 schema=job["groups"].schema, orient="row")
    job["p2p"] = pl.DataFrame([("t", r, peer, d, "pp", seq, s, e, None, 0, 0, "x") for r, peer, d, seq, s, e in p2p],
                              schema=job["p2p"].schema, orient="row")
    job["ranks"] = job["ranks"].with_columns(pl.col("rank").replace_strict(hosts, return_dtype=pl.Utf8).alias("host"))
    job = {k: v.with_columns(pl.lit("t").alias("run_id")) for k, v in job.items()}
    return RunTables.from_mapping(job)


def test_wait_and_transfer_of_one_instance():
    # three members arrive at 100, 130, 250 and complete at 300, 301, 302 (ns)
    t = _tables([(0, "g", 0, 100, 300), (1, "g", 0, 130, 301), (2, "g", 0, 250, 302)],
                [("g", [0, 1, 2])], {0: "a", 1: "a", 2: "a"})
    m = match_collectives(t).sort("rank")
    assert m["wait_ns"].to_list() == [150, 120, 0]
    assert m["transfer_ns"].to_list() == [50, 51, 52]
    assert m["duration_ns"].to_list() == [200, 171, 52]
    assert m["is_last"].to_list() == [False, False, True]
    assert m["complete"].all()
    s = instance_summary(m).row(0, named=True)
    assert (s["last_rank"], s["total_wait_ns"], s["max_wait_ns"], s["transfer_ns"]) == (2, 270, 150, 51.0)


def test_incomplete_instance_and_single_member_groups():
    t = _tables([(0, "g", 0, 100, 300), (1, "g", 0, 130, 301), (2, "solo", 0, 5, 9)],
                [("g", [0, 1, 2]), ("solo", [2])], {0: "a", 1: "a", 2: "a"})
    m = match_collectives(t)
    assert m["pg_name"].unique().to_list() == ["g"]  # nobody waits in a one-member group
    assert not m["complete"].any() and m["n_members"].unique().to_list() == [2]


def test_clock_offsets_recovered_from_skewed_hosts():
    skew = {1: 3 * MS, 2: -5 * MS, 3: int(1.5 * MS)}
    job = make_job(faults=Faults(slow_rank=6, slow_factor=1.2, host_skew_ns=skew), steps=4, seed=3)
    align = align_clocks(RunTables.from_mapping(job))
    got = dict(align.offsets.select("host", "offset_ns").unique().iter_rows())
    for h in range(4):
        assert abs(got[f"host{h}"] - skew.get(h, 0)) < 50_000, (h, got)  # within 50 us of ms skews
    assert align.clock_domains == 1 and align.instances_used > 100
    assert align.residual_ns < 50_000
    # ranks on one host share an offset
    assert align.offsets.group_by("host").agg(pl.col("offset_ns").n_unique())["offset_ns"].max() == 1
    # with aligned arrivals the straggler is the last to reach its gradient reduce-scatters
    m = match_collectives(RunTables.from_mapping(job), align.offsets)
    dp = m.filter((pl.col("pg_name") == "dp:6") & (pl.col("op") == "reduce_scatter"))
    assert dp.filter(pl.col("is_last"))["rank"].to_list().count(6) == dp["seq"].n_unique()
    # stored offsets (ranks.clock_offset_ns) are used when none are passed
    stored = dict(job, ranks=with_clock_offsets(RunTables.from_mapping(job), align))
    assert stored["ranks"]["clock_offset_ns"].to_list() == align.offsets["offset_ns"].to_list()
    again = match_collectives(RunTables.from_mapping(stored))
    assert again.select("start_ns", "end_ns").equals(m.select("start_ns", "end_ns"))


def test_unlinked_hosts_are_separate_clock_domains():
    # hosts a and b share a collective, host c only talks to itself
    t = _tables([(0, "g", 0, 0, 1000), (1, "g", 0, 10_000, 2_000_000 + 1000),
                 (2, "h", 0, 0, 50), (3, "h", 0, 0, 60)],
                [("g", [0, 1]), ("h", [2, 3])], {0: "a", 1: "b", 2: "c", 3: "c"})
    a = align_clocks(t)
    off = dict(a.offsets.select("rank", "offset_ns").iter_rows())
    assert off == {0: 0, 1: 2_000_000, 2: 0, 3: 0}
    assert a.clock_domains == 2


def test_p2p_transfers_link_hosts():
    # no collective spans hosts; a send/recv pair completing together does
    t = _tables([], [], {0: "a", 1: "b"},
                p2p=[(0, 1, "send", 0, 100, 500), (1, 0, "recv", 0, 7000, 7500)])
    off = dict(align_clocks(t).offsets.select("rank", "offset_ns").iter_rows())
    assert off == {0: 0, 1: 7000}


def test_tables_validation_names_the_problem():
    job = make_job(steps=1, microbatches=1)
    with pytest.raises(TablesError, match="missing tables"):
        RunTables.from_mapping({k: v for k, v in job.items() if k != "p2p"})
    bad = dict(job, collectives=job["collectives"].drop("seq"))
    with pytest.raises(TablesError, match=r"'collectives' lacks columns \['seq'\]"):
        RunTables.from_mapping(bad)
    with pytest.raises(TablesError, match="not found"):
        RunTables.from_mapping(job, run_id="other")
