"""Cross-rank matching of collective instances, and clock alignment from the collectives themselves.

An instance is one (pg_name, seq): every member of the group records it once. For member r with
arrival a_r (start) and completion e_r (end): wait_r = max(a) - a_r is time spent waiting for the
last member, transfer_r = e_r - max(a) the data movement after everyone arrived, and the member
with the latest arrival is the one the group waited on (ALGORITHMS.md, top-down localization).
Durations e_r - a_r are on one clock; arrivals compared across hosts need the offsets that
``align_clocks`` estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from tracekit.analysis.tables import RunTables, per_tables


@dataclass(frozen=True)
class ClockAlignment:
    offsets: pl.DataFrame  # rank, host, offset_ns: subtract from the rank's times
    instances_used: int  # matched instances (collectives, p2p transfers) spanning more than one host
    residual_ns: float  # median |completion - instance median| after alignment
    clock_domains: int = 1  # sets of hosts that no matched operation links (offsets relative within each)

    def to_dict(self) -> dict:
        return {"offsets": self.offsets.to_dicts(), "instances_used": self.instances_used,
                "residual_ns": self.residual_ns,
                "clock_domains": self.clock_domains}


def _completions(tables: RunTables) -> pl.DataFrame:
    """(instance, rank, end_ns) for every matched event whose members complete together:
    collective instances, and p2p transfers (both sides finish when the data has arrived)."""
    coll = tables.collectives.select(
        pl.format("c|{}|{}", "pg_name", "seq").alias("instance"), pl.col("rank").cast(pl.Int32), "end_ns")
    p2p = tables.p2p.with_columns(
        pl.when(pl.col("direction") == "send").then(pl.col("rank")).otherwise(pl.col("peer")).alias("src"),
        pl.when(pl.col("direction") == "send").then(pl.col("peer")).otherwise(pl.col("rank")).alias("dst"),
    ).select(pl.format("p|{}|{}|{}|{}", "pg_name", "src", "dst", "seq").alias("instance"),
             pl.col("rank").cast(pl.Int32), "end_ns")
    return pl.concat([coll, p2p])


def align_clocks(tables: RunTables) -> ClockAlignment:
    """One offset per host such that completions of matched operations coincide.

    All members of a collective (and both sides of a p2p transfer) complete within a transfer's
    skew of each other. For every pair of hosts that share instances, their offset difference is
    the median over those instances of (median completion on host A - on host B), robust to
    stragglers and outliers; the per-host offsets are the least-squares fit to those pairwise
    differences (weighted by how many instances back each). In each set of hosts linked by such
    instances the host of the lowest rank is the reference (offset 0); ranks with no host are
    their own host. ``residual_ns`` is the median |aligned completion - instance median|.
    """
    hosts = tables.coords().select("rank", "host")
    done = _completions(tables).join(hosts, on="rank")
    per_host = done.group_by("instance", "host").agg(pl.col("end_ns").median().alias("end"))
    pairs = per_host.join(per_host, on="instance", suffix="_b").filter(pl.col("host") < pl.col("host_b"))
    pairs = pairs.group_by("host", "host_b").agg((pl.col("end") - pl.col("end_b")).median().alias("diff"),
                                                  pl.len().alias("n"))
    first_rank = dict(hosts.group_by("host").agg(pl.col("rank").min()).iter_rows())
    names = sorted(first_rank, key=first_rank.get)
    index = {h: i for i, h in enumerate(names)}
    parent = list(range(len(names)))  # union-find over hosts linked by shared instances

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs.select("host", "host_b").iter_rows():
        ra, rb = find(index[a]), find(index[b])
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)  # the smaller index has the smaller first rank
    roots = [find(i) for i in range(len(names))]
    offset = np.zeros(len(names))
    if pairs.height:
        w = np.sqrt(pairs["n"].to_numpy().astype(float))
        mat = np.zeros((pairs.height + len(set(roots)), len(names)))
        rows = np.arange(pairs.height)
        mat[rows, [index[h] for h in pairs["host"]]] = w
        mat[rows, [index[h] for h in pairs["host_b"]]] = -w
        for k, r in enumerate(sorted(set(roots))):  # pin each linked set's reference host
            mat[pairs.height + k, r] = w.sum()
        rhs = np.concatenate([pairs["diff"].to_numpy() * w, np.zeros(len(set(roots)))])
        offset = np.linalg.lstsq(mat, rhs, rcond=None)[0]
        offset = offset - offset[roots]
    host_frame = pl.DataFrame({"host": names, "offset_ns": np.round(offset).astype(np.int64)})
    offsets = hosts.join(host_frame, on="host").sort("rank")
    multi = done.filter(pl.col("host").n_unique().over("instance") > 1)
    residual = 0.0
    if multi.height:
        check = multi.join(offsets.select("rank", "offset_ns"), on="rank").with_columns(
            (pl.col("end_ns") - pl.col("offset_ns")).alias("adj"))
        residual = float((check["adj"] - check.select(pl.col("adj").median().over("instance"))["adj"]).abs().median())
    return ClockAlignment(offsets=offsets, instances_used=multi["instance"].n_unique(), residual_ns=residual,
                          clock_domains=len(set(roots)))


def with_clock_offsets(tables: RunTables, alignment: ClockAlignment) -> pl.DataFrame:
    """The run's ``ranks`` table with ``clock_offset_ns`` set from an alignment (for the store)."""
    off = alignment.offsets.select(pl.col("rank").cast(pl.Int32), pl.col("offset_ns").alias("_off"))
    ranks = tables.ranks.with_columns(pl.col("rank").cast(pl.Int32)).join(off, on="rank", how="left")
    return ranks.with_columns(pl.coalesce("_off", "clock_offset_ns").alias("clock_offset_ns")).drop("_off")


def clock_offsets(tables: RunTables) -> pl.DataFrame:
    """rank, offset_ns: how far each rank's clock is ahead of the run's common clock, as every
    view of the run on one clock applies it (the Perfetto export, the dashboard): the stored
    ``ranks.clock_offset_ns`` when every rank has one (``Store.align_clocks`` saved them), else
    ``align_clocks``' estimate from the collectives (not saved: readers leave the store as it is)."""
    stored = tables.ranks.select(pl.col("rank").cast(pl.Int32), pl.col("clock_offset_ns").cast(pl.Int64))
    if not stored.height or stored["clock_offset_ns"].null_count():
        stored = with_clock_offsets(tables, align_clocks(tables)).select(
            pl.col("rank").cast(pl.Int32), pl.col("clock_offset_ns").cast(pl.Int64))
    return stored.rename({"clock_offset_ns": "offset_ns"}).sort("rank")


@per_tables
def match_collectives(tables: RunTables, offsets: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per (pg_name, seq, rank) with arrival, completion, wait and transfer.

    Columns: pg_name, seq, op, step, rank, start_ns, end_ns (aligned with ``offsets`` if given,
    else with the stored ``ranks.clock_offset_ns`` where set, else as recorded), duration_ns,
    group_size, n_members, complete, last_arrival_ns, wait_ns,
    transfer_ns, is_last (the member everyone waited on), dim (the group's dimension).
    Single-member groups are dropped: nobody waits in them. A group missing from the ``groups``
    table gets its membership from the ranks that recorded it, and a group without a recorded
    ``dim`` its dimension from its members and the layout.
    """
    coll = tables.collectives.with_columns(pl.col("rank").cast(pl.Int32))
    if offsets is None and tables.ranks["clock_offset_ns"].drop_nulls().len():
        offsets = tables.ranks.select(pl.col("rank").cast(pl.Int32), "clock_offset_ns").rename(
            {"clock_offset_ns": "offset_ns"})
    if offsets is not None:
        coll = coll.join(offsets.select("rank", "offset_ns"), on="rank", how="left").with_columns(
            pl.col("offset_ns").fill_null(0))
        coll = coll.with_columns(pl.col("start_ns") - pl.col("offset_ns"), pl.col("end_ns") - pl.col("offset_ns"))
    groups = tables.groups.select("pg_name", pl.col("size").alias("group_size"), "dim", "ranks").unique("pg_name")
    if groups["dim"].null_count():  # dimension not recorded: name it from the members and the layout
        lay = tables.layout
        groups = groups.with_columns(pl.when(pl.col("dim").is_null()).then(
            pl.col("ranks").map_elements(lambda r: lay.dim_of(list(r)) or "other", return_dtype=pl.Utf8))
            .otherwise(pl.col("dim")).alias("dim"))
    groups = groups.with_columns(pl.coalesce("group_size", pl.col("ranks").list.len()).cast(pl.Int32)).drop("ranks")
    unknown = coll.filter(~pl.col("pg_name").is_in(groups["pg_name"].implode())).group_by("pg_name").agg(
        pl.col("rank").unique().sort())
    if unknown.height:  # groups the groups table lacks: membership and dimension from the records
        lay = tables.layout
        inferred = pl.DataFrame(
            [(g, len(r), lay.dim_of(r) or "other") for g, r in unknown.iter_rows()],
            schema={"pg_name": pl.Utf8, "group_size": pl.Int32, "dim": pl.Utf8}, orient="row")
        groups = pl.concat([groups, inferred])
    m = coll.select("pg_name", "seq", "op", "step", "rank", "start_ns", "end_ns").join(
        groups, on="pg_name", how="left")
    key = ["pg_name", "seq"]
    m = m.with_columns(
        (pl.col("end_ns") - pl.col("start_ns")).alias("duration_ns"),
        pl.len().over(key).cast(pl.Int32).alias("n_members"),
        pl.col("start_ns").max().over(key).alias("last_arrival_ns"),
    ).with_columns(
        pl.col("group_size").fill_null(pl.col("n_members")),
        pl.col("dim").fill_null("other"),
    ).filter(pl.col("group_size") > 1)
    return m.with_columns(
        (pl.col("n_members") == pl.col("group_size")).alias("complete"),
        (pl.col("last_arrival_ns") - pl.col("start_ns")).alias("wait_ns"),
        (pl.col("end_ns") - pl.col("last_arrival_ns")).clip(lower_bound=0).alias("transfer_ns"),
        (pl.col("start_ns") == pl.col("last_arrival_ns")).alias("is_last"),
    ).sort("pg_name", "seq", "rank")


def instance_summary(matched: pl.DataFrame) -> pl.DataFrame:
    """One row per instance: members, the last arrival's rank, total wait, transfer time."""
    return matched.group_by("pg_name", "seq").agg(
        pl.col("op").first(), pl.col("dim").first(), pl.col("step").min(),
        pl.col("n_members").first(), pl.col("group_size").first(), pl.col("complete").first(),
        pl.col("rank").filter(pl.col("is_last")).first().alias("last_rank"),
        pl.col("wait_ns").sum().alias("total_wait_ns"),
        pl.col("wait_ns").max().alias("max_wait_ns"),
        pl.col("transfer_ns").median().alias("transfer_ns"),
    ).sort("pg_name", "seq")
