"""Slow links: transfers that take longer than the same kind of transfer elsewhere.

A transfer is the time an operation takes once every side is ready, measured on one rank's clock
(cross-host clocks are skewed by up to seconds, so no comparison of two ranks' timestamps enters a
link verdict): for a collective instance its shortest member duration (the last member to arrive
waits for no one), for a p2p message the shorter of its send and its receive (the side that came
second waits for no one; sends and receives are paired by order per link and step). A late rank does not make its links look slow, and a slow link (both ends on time, data
slow) shows here and nowhere else.

Links are compared within their kind: a collective group with the other groups of its dimension
for the same op (a group's all-gathers and reduce-scatters cost differently), a p2p pair with the
other pairs. Transfers on a shared CPU have heavy tails (a descheduled rank stretches one instance
tenfold), so a link is slow only when all of these hold:
- its median transfer is ``slow_link_ratio`` x the others' median (a real effect, not a tail);
- its instances (each divided by its kind's median) rank above every other link's (one-sided
  Mann-Whitney z), beyond a Bonferroni bar over the links compared (the most extreme of many links
  is extreme by chance): z >= the normal quantile of 1 - ``link_alpha`` / links, and >= ``link_z_min``;
- the excess costs at least ``link_effect_min_frac`` of a step (a slower link that costs nothing is
  not a finding; on a shared CPU, healthy pipeline links differ persistently by a millisecond or two
  per message, about 0.5% of a step), or ``link_broken_min_frac`` where the link is
  ``link_broken_ratio`` x slower on a transport that is not the CPU's (``costs_enough``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import polars as pl

from tracekit.analysis.collectives import match_collectives
from tracekit.analysis.tables import RunTables, per_tables
from tracekit.analysis.tunables import Tunables

# backends that move data through the host's CPUs: within one host there is no link hardware to fail
CPU_TRANSPORTS = ("gloo",)

SCHEMA = {"link": pl.Utf8, "name": pl.Utf8, "ranks": pl.List(pl.Int32), "kind": pl.Utf8, "instances": pl.Int64,
          "transfer_ns": pl.Float64, "ratio": pl.Float64, "z": pl.Float64, "z_bar": pl.Float64,
          "excess_per_step_ns": pl.Float64, "slow": pl.Boolean}


@dataclass(frozen=True)
class P2PCoverage:
    """How much of a run's p2p traffic the link level could measure: an op enters a transfer only
    when its peer is known and the other side's op is there to pair with it."""
    ops: int  # p2p ops within steps
    measured: int  # of them, paired into transfers
    ranks: tuple[int, ...]  # ranks with ops that entered no transfer

    @property
    def share(self) -> float:
        return self.measured / self.ops if self.ops else 1.0


def pair_messages(p2p: pl.DataFrame) -> pl.DataFrame:
    """(src, dst, step, k, send, recv): each p2p message of ``p2p`` (rows with rank, peer, direction,
    step, start_ns, end_ns) whose send and receive are both known, paired by their order on the link
    within the step, with the two sides' durations."""
    known = p2p.filter(pl.col("peer").is_not_null() & pl.col("step").is_not_null()).with_columns(
        pl.when(pl.col("direction") == "send").then(pl.col("rank")).otherwise(pl.col("peer")).alias("src"),
        pl.when(pl.col("direction") == "send").then(pl.col("peer")).otherwise(pl.col("rank")).alias("dst"),
        (pl.col("end_ns") - pl.col("start_ns")).alias("d"))
    # the order within each link, step and side, without sorting the whole table (1.7x faster on 1.2M rows)
    known = known.with_columns(pl.col("start_ns").rank("ordinal").over("src", "dst", "step", "direction").alias("k"))
    send, recv = (known.filter(pl.col("direction") == x).select("src", "dst", "step", "k", pl.col("d").alias(x))
                  for x in ("send", "recv"))
    return send.join(recv, on=["src", "dst", "step", "k"])


@per_tables
def _p2p_pairs(tables: RunTables) -> pl.DataFrame:
    """``pair_messages`` of the run's p2p records."""
    return pair_messages(tables.p2p)


@per_tables
def p2p_coverage(tables: RunTables) -> P2PCoverage:
    """The share of p2p ops that entered a transfer, and the ranks some of whose ops did not."""
    ops = tables.p2p.filter(pl.col("step").is_not_null())
    if not ops.height:
        return P2PCoverage(0, 0, ())
    pairs = _p2p_pairs(tables)
    paired = pl.concat([pairs.group_by(pl.col("src").alias("rank")).len(),
                        pairs.group_by(pl.col("dst").alias("rank")).len()]).group_by("rank").agg(pl.col("len").sum())
    per = ops.group_by(pl.col("rank").cast(pl.Int64)).len().join(
        paired.with_columns(pl.col("rank").cast(pl.Int64)).rename({"len": "paired"}), on="rank", how="left")
    short = per.filter(pl.col("paired").fill_null(0) < pl.col("len"))["rank"].sort().to_list()
    return P2PCoverage(ops.height, min(2 * pairs.height, ops.height), tuple(int(r) for r in short))


@per_tables
def lone_groups(tables: RunTables) -> list[str]:
    """The collective dimensions whose one group holds every rank (a job of DP alone, or TP alone):
    their transfers have no other group of the kind to be compared with, so a slow link in them
    cannot stand out (``link_transfers`` measures each link against the same kind elsewhere)."""
    lay = tables.layout
    return [d for d in ("tp", "cp", "dp") if 1 < getattr(lay, d) == lay.world_size]


def one_pipeline(tables: RunTables) -> bool:
    """Whether the job is one pipeline and nothing else (tp x cp x dp = 1): its p2p links have no
    counterpart in another pipeline, and are compared with one another (``_pool_lone_p2p``)."""
    lay = tables.layout
    return 1 < lay.pp == lay.world_size


def _transfer_instances(tables: RunTables) -> pl.DataFrame:
    """(link, name, ranks, kind, step, t): one row per transfer sample, each measured on one rank's
    clock (host clocks are skewed; FORMATS.md): a collective instance's transfer is its shortest
    member duration (the last arrival waits for no one); a p2p message's, the shorter of its send
    and its receive."""
    parts = []
    pairs = _p2p_pairs(tables)
    if pairs.height:
        # a link is compared with the links between the same two stages of the other pipelines: the
        # stages' positions in the schedule (ends, or middle stages whose sends and receives overlap)
        # shape their transfers, not only the link
        # the host as recorded (coords() names an unknown one after its rank): null where unknown
        known = tables.ranks.select(pl.col("rank").cast(pl.Int32), pl.col("host").alias("known_host"))
        stage = tables.coords().join(known, on="rank", how="left").select(
            pl.col("rank").cast(pairs["src"].dtype), "pp", pl.col("known_host").alias("host"))
        pairs = pairs.join(stage.rename({"rank": "src", "pp": "pp_src", "host": "host_src"}), on="src", how="left").join(
            stage.rename({"rank": "dst", "pp": "pp_dst", "host": "host_dst"}), on="dst", how="left")
        parts.append(pairs.select(
            pl.lit("p2p").alias("link"), pl.format("{}->{}", "src", "dst").alias("name"),
            pl.concat_list("src", "dst").cast(pl.List(pl.Int32)).alias("ranks"),
            pl.format("p2p:{}->{}", "pp_src", "pp_dst").alias("kind"),
            pl.col("step").cast(pl.Int64), pl.min_horizontal("send", "recv").clip(lower_bound=0).cast(pl.Float64)
            .alias("t"), (pl.col("host_src") != pl.col("host_dst")).alias("cross_host")))
    m = match_collectives(tables)
    if m.height:
        inst = m.group_by("pg_name", "seq", "dim", "op").agg(
            pl.col("duration_ns").min().cast(pl.Float64).alias("t"), pl.col("step").max().cast(pl.Int64),
            pl.col("rank").unique().sort().cast(pl.Int32).alias("ranks"), pl.col("complete").all())
        inst = inst.filter(pl.col("complete"))
        parts.append(inst.select(pl.lit("group").alias("link"), pl.col("pg_name").alias("name"), "ranks",
                                 pl.format("{}:{}", "dim", "op").alias("kind"), "step", "t",
                                 pl.lit(None, pl.Boolean).alias("cross_host")))
    if not parts:
        return pl.DataFrame(schema={"link": pl.Utf8, "name": pl.Utf8, "ranks": pl.List(pl.Int32), "kind": pl.Utf8,
                                    "step": pl.Int64, "t": pl.Float64, "cross_host": pl.Boolean})
    return pl.concat(parts).drop_nulls("t")


POOLED_P2P = "p2p:pipeline"  # the kind prefix of p2p links that no other pipeline has a counterpart of


def _pool_lone_p2p(inst: pl.DataFrame) -> pl.DataFrame:
    """A p2p link is compared with the links between the same two stages of the other pipelines;
    where it has none (one pipeline: tp x cp x dp = 1), with the pipeline's other such links that
    cross hosts as it does or stay within one as it does (NVLink within a host moves data an order
    of magnitude faster than the network between hosts; a link whose hosts are unknown is left
    alone), as one kind: else a 20 ms delay on link
    1 -> 2 of a 4-stage pipeline, 60% of a step, went unseen and rank 1 was named, unexplained."""
    p2p = pl.col("link") == "p2p"
    links_per_kind = pl.col("key").n_unique().over("kind")
    # where a host is unknown, so is the fabric: such a link stays alone (unmeasured)
    lone = p2p & (links_per_kind == 1) & pl.col("cross_host").is_not_null()
    pooled = pl.format("{}:{}", pl.lit(POOLED_P2P),
                       pl.when(pl.col("cross_host")).then(pl.lit("cross-host")).otherwise(pl.lit("within-host")))
    return inst.with_columns(pl.when(lone).then(pooled).otherwise(pl.col("kind")).alias("kind"))


def costs_enough(ratio: float | pl.Expr, excess_ns: float | pl.Expr, step_ns: float, tun: Tunables,
                 cpu_transport: bool = False) -> bool | pl.Expr:
    """Whether a slow link costs enough to be a finding: ``link_effect_min_frac`` of a step, or
    ``link_broken_min_frac`` for a link ``link_broken_ratio`` x slower (broken, whatever it costs
    today) where the transport is not the CPU's. Floats give a bool, polars expressions an expression."""
    enough = excess_ns >= tun.link_effect_min_frac * step_ns
    if cpu_transport:
        return enough
    return enough | ((ratio >= tun.link_broken_ratio) & (excess_ns >= tun.link_broken_min_frac * step_ns))


def median_without(s: np.ndarray, own: np.ndarray) -> float:
    """The median of the multiset ``s`` (sorted) without ``own`` (a sub-multiset of it), in
    O(|own| log |s|): every link is compared with all the others, and there are thousands."""
    n = s.size - own.size
    if n <= 0:
        return float("nan")
    own = np.sort(own)

    def kth(k: int) -> float:  # the k-th smallest (0-based) of the rest lies at s[k .. k + |own|]
        idx = np.arange(k, min(k + own.size, s.size - 1) + 1)
        rest_le = np.searchsorted(s, s[idx], side="right") - np.searchsorted(own, s[idx], side="right")
        return float(s[idx[int(np.argmax(rest_le >= k + 1))]])

    return kth(n // 2) if n % 2 else (kth(n // 2 - 1) + kth(n // 2)) / 2.0


def _groups(keys: np.ndarray) -> list[tuple[object, np.ndarray]]:
    """(key, indices) for each distinct key, in key order, each key's indices ascending. Hashed by
    polars: numpy's sort of string keys took 0.5 s on a 16,384-rank job's 336-rank scope."""
    if not keys.size:
        return []
    grouped = (pl.DataFrame({"key": keys}).with_row_index("i").group_by("key", maintain_order=False)
               .agg(pl.col("i")).sort("key"))
    return [(k, np.asarray(i, dtype=np.int64)) for k, i in grouped.iter_rows()]


@per_tables
def link_transfers(tables: RunTables, step_ns: float, tunables: Tunables = Tunables()) -> pl.DataFrame:
    """Per link (p2p pair or collective group): median transfer, its ratio to the same kind
    elsewhere, the rank-test z and its bar, the excess per step, and whether it is slow.

    Each instance is divided by the median transfer of its kind on the *other* links (with two
    groups of a kind, each is measured against the other), so that a link's instances of every
    kind (a group's all-gathers, reduce-scatters, all-reduces) pool into one sample that is ranked
    against every other link's: a handful of steps then gives enough instances to tell a slow link
    from a heavy tail."""
    tun = tunables
    inst = _transfer_instances(tables)
    if not inst.height:
        return pl.DataFrame(schema=SCHEMA)
    n_steps = max(inst["step"].n_unique(), 1)
    cpu = tables.backend in CPU_TRANSPORTS
    inst = inst.with_columns(pl.format("{}|{}", "link", "name").alias("key"))
    inst = _pool_lone_p2p(inst)
    refs = []  # (key, kind) -> median transfer of the kind on the other links
    for (kind,), per_kind in inst.partition_by("kind", as_dict=True).items():
        t_sorted = np.sort(per_kind["t"].to_numpy())
        for key, idx in _groups(per_kind["key"].to_numpy()):
            if idx.size < t_sorted.size:
                refs.append({"key": key, "kind": kind, "ref": median_without(t_sorted, per_kind["t"].to_numpy()[idx])})
    if not refs:  # every kind has a single link: nothing to compare with
        return pl.DataFrame(schema=SCHEMA)
    inst = inst.join(pl.DataFrame(refs), on=["key", "kind"]).with_columns(
        (pl.col("t").clip(lower_bound=1.0) / pl.col("ref").clip(lower_bound=1.0)).log().alias("lr"))
    n_keys = inst["key"].n_unique()
    z_bar = max(tun.link_z_min, NormalDist().inv_cdf(1 - tun.link_alpha / max(n_keys, 1)))
    # one-sided Mann-Whitney of each link's instances against all the others': the joint sample is
    # every instance for every link, so one ranking serves them all (ties take average ranks)
    lr = inst["lr"].to_numpy()
    order = lr.argsort(kind="mergesort")
    _, first, counts = np.unique(lr[order], return_index=True, return_counts=True)
    ranks = np.empty(lr.size)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    n = lr.size
    tie = float((counts.astype(float) ** 3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    per_kind = inst.group_by("key", "kind").agg(pl.col("t").median().alias("med"), pl.col("ref").first(),
                                                pl.len().alias("n"), pl.col("lr").median())
    excess_of = dict(per_kind.group_by("key").agg(((pl.col("med") - pl.col("ref")) * pl.col("n")).sum())
                     .iter_rows())
    kind_of = dict(per_kind.sort("lr", descending=True).unique("key", keep="first").select("key", "kind").iter_rows())
    keys, t_all = inst["key"].to_numpy(), inst["t"].to_numpy()
    first_row = {k: idx[0] for k, idx in _groups(keys)}
    rows = []
    for key, idx in _groups(keys):
        x = lr[idx]
        n1, n2 = x.size, n - x.size
        # each instance is already a ratio to its kind's median on the other links: with two groups
        # of a kind, each other's mirror image, the other links' median lr is the slow one's negative
        ratio = math.exp(float(np.median(x)))
        var = n1 * n2 / 12.0 * ((n + 1) - tie)
        z = float((ranks[idx].sum() - n1 * (n1 + 1) / 2.0 - n1 * n2 / 2.0) / math.sqrt(var)) if n2 and var > 0 else 0.0
        excess = float(excess_of[key]) / n_steps
        # a link compared with other stage pairs (one pipeline) must be broken-slow: the stages'
        # positions shape their transfers (on a shared CPU, by a millisecond or two a message)
        bar = tun.link_broken_ratio if kind_of[key].startswith(POOLED_P2P) else tun.slow_link_ratio
        slow = bool(ratio >= bar and z >= z_bar and costs_enough(ratio, excess, step_ns, tun, cpu))
        row = inst.row(int(first_row[key]), named=True)
        rows.append({"link": row["link"], "name": row["name"], "ranks": list(row["ranks"]), "kind": kind_of[key],
                     "instances": int(n1), "transfer_ns": float(np.median(t_all[idx])), "ratio": ratio, "z": z,
                     "z_bar": z_bar, "excess_per_step_ns": excess, "slow": slow})
    return pl.DataFrame(rows, schema=SCHEMA).sort("z", descending=True)


def slowest_link(links: pl.DataFrame, ranks: set[int] | None = None, both: bool = False) -> dict | None:
    """The slow link with the highest z (among those touching ``ranks``: any end, or with ``both``
    every end within them); None when no link is slow."""
    hit = links.filter(pl.col("slow") & (pl.col("ranks").list.len() >= 2))
    if ranks is not None:
        inside = pl.col("ranks").list.eval(pl.element().is_in(list(ranks))).list.sum()
        hit = hit.filter(inside >= (pl.col("ranks").list.len() if both else 1))
    hit = hit.sort("z", descending=True)
    return hit.row(0, named=True) if hit.height else None
