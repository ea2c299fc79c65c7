"""The scope's communication levels (scope.py): which pipeline links and groups a large job's
diagnosis must read, from the p2p and collective records alone.

- ``link_level`` (every rank's p2p): pipeline links with no fast message;
- ``pp_level`` (a late replica and a reference one): the stages of the link and of the in-stage
  collectives that grew most, and ``peerless_link`` where the p2p records name no peer;
- ``group_level`` (every replica, a few steps): TP and CP groups slower than their dimension's
  others at the same stage;
- ``stage_group_level`` (dp = 1, no replica to compare): a stage's TP and CP groups, and its ranks'
  sends, against each other.
"""

from __future__ import annotations

import polars as pl

from tracekit.analysis.links import P2PCoverage, costs_enough, pair_messages
from tracekit.analysis.tables import ranked_source
from tracekit.analysis.tunables import Tunables
from tracekit.topology import Layout

# What a job-wide look at the TP and CP groups reads (group_level): a slow link is slow in every step
# and collective, so two steps and each eighth collective of a group tell it. At 16,384 ranks (63M
# collective records) that costs 1.1-1.2 s, most of it the scan; four steps of every collective, 2.0-2.5 s
SCOPE_GROUP_STEPS = 2
SCOPE_GROUP_EVERY = 8


def link_level(con, run_id: str, lay: Layout, tun: Tunables
               ) -> tuple[list[tuple[int, int]], dict, P2PCoverage | None]:
    """Pipeline links whose every message is slow: per link the fastest transfer of all its messages
    (a send or receive's own duration, one clock; a slow link has no fast message, a late rank's
    links do), against the links between the same two stages. Reads only the p2p records.

    Also how much of the job's p2p this measured (``links.P2PCoverage``: the ops within steps that
    name their peer), which the diagnosis of the scope cannot tell from its own ranks: a sample's
    stages 0 and 7 hold no pair of ops, and "p2p links were measured in 0 of 5,760 ops" had put a
    clean 1,024-rank job's "no straggler" at 0.00."""
    if lay.pp < 2:
        return [], {"level": "links", "read": "nothing (pp = 1)"}, None
    # one scan: the ops without a peer grouped too (one row per rank and direction), for the coverage
    rows = con.sql("SELECT rank, peer, direction, min(end_ns - start_ns)::DOUBLE AS t, "
                   "count(*) FILTER (WHERE step IS NOT NULL) AS n FROM p2p WHERE run_id = $r "
                   "AND source <> 'fr' GROUP BY ALL", params={"r": run_id}).pl()
    peerless = rows.filter(pl.col("peer").is_null() & (pl.col("n") > 0))
    cover = P2PCoverage(int(rows["n"].sum() or 0), int(rows["n"].sum() or 0) - int(peerless["n"].sum() or 0),
                        tuple(sorted(int(r) for r in peerless["rank"].unique())))
    rows = rows.filter(pl.col("peer").is_not_null() & pl.col("t").is_not_null()).drop("n")
    evidence: dict = {"level": "links", "read": "p2p records: each link's fastest message", "rows": rows.height,
                      "p2p_ops": cover.ops, "p2p_measured": cover.measured}
    if not rows.height:
        return [], evidence, cover
    send = pl.col("direction") == "send"
    stage = lambda c: (pl.col(c) // lay.stride("pp")) % lay.pp  # noqa: E731
    links = rows.with_columns(pl.when(send).then("rank").otherwise("peer").alias("src"),
                              pl.when(send).then("peer").otherwise("rank").alias("dst")).group_by("src", "dst").agg(
        pl.col("t").min()).with_columns(stage("src").alias("a"), stage("dst").alias("b"))
    links = links.with_columns(pl.col("t").median().over("a", "b").alias("ref"),
                               ((pl.col("t") - pl.col("t").median().over("a", "b")).abs().median().over("a", "b")
                                * 1.4826).alias("mad"))
    links = links.with_columns((pl.col("t") / pl.col("ref")).alias("ratio"),
                               ((pl.col("t") - pl.col("ref")) / pl.max_horizontal(pl.col("mad"), pl.col("ref") * 1e-3))
                               .alias("z"))
    slow = links.filter((pl.col("ratio") >= tun.slow_link_ratio) & (pl.col("z") >= tun.scope_z_step)).sort(
        "z", descending=True).head(tun.scope_candidates)
    pairs = [(int(a), int(b)) for a, b in slow.select("src", "dst").iter_rows()]
    evidence["slow_links"] = [list(p) for p in pairs]
    return pairs, evidence, cover


def replica_ranges(lay: Layout, dp: int) -> list[tuple[int, int]]:
    """Replica ``dp``'s ranks as inclusive contiguous ranges: one with DP outermost, one per stage
    (each a TP x CP cell) where PP is (torchtitan's order)."""
    if lay.stride("dp") * lay.dp == lay.world_size:
        size = lay.world_size // lay.dp
        return [(dp * size, (dp + 1) * size - 1)]
    cell = lay.tp * lay.cp
    return [(first, first + cell - 1) for first in (lay.rank_of(dp=dp, pp=p) for p in range(lay.pp))]


def pp_level(con, run_id: str, lay: Layout, replica: int, ref: int, tun: Tunables, step_ns: float
              ) -> tuple[list[int], dict]:
    """The stages of ``replica`` to read: the ends of its pipeline link whose transfers (the shorter of
    send and receive, one clock) grew most against the same stage pair of ``ref``, and the stage whose
    in-stage collectives grew most. Reads only those two replicas' p2p and non-DP collectives."""
    ranges = sorted(replica_ranges(lay, replica) + replica_ranges(lay, ref))
    p2p_src, p2p_within = ranked_source(con, "p2p", ranges)
    coll_src, coll_within = ranked_source(con, "collectives", ranges)
    stage = (pl.col("rank") // lay.stride("pp")) % lay.pp
    replica_of = lambda c: pl.col(c) // lay.stride("dp") % lay.dp  # noqa: E731
    waits = "p2p and in-stage collectives" if lay.pp > 1 else "in-replica collectives"
    evidence: dict = {"level": "pp", "replica": replica, "ref": ref, "waits": waits,
                      "read": f"{waits} of replicas {replica} and {ref}"}
    stages: list[int] = []
    p2p = con.sql(f"SELECT rank, peer, direction, step, start_ns, end_ns FROM {p2p_src} WHERE run_id = $r "
                  f"AND source <> 'fr'{p2p_within} AND step IS NOT NULL", params={"r": run_id}).pl()
    if p2p.height and not p2p["peer"].is_not_null().any():
        stages += peerless_link(p2p, lay, replica, ref, tun, step_ns, evidence)
    p2p = p2p.filter(pl.col("peer").is_not_null())
    if p2p.height:
        pairs = pair_messages(p2p)
        # each link against the link at the same position of the reference replica
        shift = (replica - ref) * lay.stride("dp")
        per = pairs.with_columns(pl.min_horizontal("send", "recv").alias("t")).group_by("src", "dst").agg(
            pl.col("t").median(), (pl.col("t").sum() / pl.col("step").n_unique()).alias("per_step"))
        mine = per.filter(replica_of("src") == replica)
        theirs = per.filter(replica_of("src") == ref).select(
            (pl.col("src") + shift).alias("src"), (pl.col("dst") + shift).alias("dst"), pl.col("t").alias("t_ref"),
            pl.col("per_step").alias("ps_ref"))
        both = mine.join(theirs, on=["src", "dst"]).with_columns(
            (pl.col("t") / pl.col("t_ref")).alias("ratio"), (pl.col("per_step") - pl.col("ps_ref")).alias("excess"))
        # the diagnosis' own cost rule (on any transport: here it only chooses what to read)
        both = both.filter((pl.col("ratio") >= tun.slow_link_ratio)
                           & costs_enough(pl.col("ratio"), pl.col("excess"), step_ns, tun)).sort("ratio", descending=True)
        if both.height:
            top = both.row(0, named=True)
            a, b = (int(top[x]) // lay.stride("pp") % lay.pp for x in ("src", "dst"))
            stages += [a, b]
            evidence["link"] = {"ranks": [int(top["src"]), int(top["dst"])], "ratio": float(top["ratio"])}
    coll = con.sql(
        "WITH dpg AS (SELECT pg_name FROM groups WHERE run_id = $r AND dim = 'dp') "
        f"SELECT rank, step, sum(end_ns - start_ns)::DOUBLE AS ns FROM {coll_src} WHERE run_id = $r "
        f"AND source <> 'fr'{coll_within} AND step IS NOT NULL AND pg_name NOT IN (SELECT pg_name FROM dpg) "
        "GROUP BY ALL", params={"r": run_id}).pl()
    if coll.height:
        per = coll.with_columns(replica_of("rank").alias("dp"), stage.alias("pp")).group_by("dp", "pp").agg(
            pl.col("ns").mean())  # per rank and step
        a = dict(per.filter(pl.col("dp") == replica).select("pp", "ns").iter_rows())
        b = dict(per.filter(pl.col("dp") == ref).select("pp", "ns").iter_rows())
        grown = {p: a[p] - b.get(p, a[p]) for p in a}
        top = max(grown, key=lambda p: grown[p]) if grown else None
        if top is not None and grown[top] >= tun.link_effect_min_frac * step_ns:
            stages.append(int(top))
            evidence["in_stage"] = {"stage": int(top), "grown_ns": grown[top]}
    evidence["stages"] = sorted(set(stages))
    return sorted(set(stages)), evidence


def peerless_link(p2p: pl.DataFrame, lay: Layout, replica: int, ref: int, tun: Tunables, step_ns: float,
                   evidence: dict) -> list[int]:
    """The stages around a slow link where the p2p records name no peer (NCCL's name the pipeline group
    only; the diagnosis pairs them with the flight recorder's entries, which SQL cannot align): the rank
    whose sends grew most against the same position of ``ref``, and its two neighbouring stages (the
    link is to one of them). Sends, not receives: a late replica's receives all wait longer, and a
    slow link's sends grow at its two ends (by 1.3-2x the replica's other sends on the fault grid)."""
    dp_of = pl.col("rank") // lay.stride("dp") % lay.dp
    pos = pl.col("rank") - dp_of * lay.stride("dp")  # the rank's place within its replica
    sends = p2p.filter((pl.col("direction") == "send") & pl.col("end_ns").is_not_null()).group_by("rank").agg(
        ((pl.col("end_ns") - pl.col("start_ns")).sum() / pl.col("step").n_unique()).cast(pl.Float64).alias("ns"))
    mine = sends.filter(dp_of == replica).with_columns(pos.alias("pos"))
    theirs = sends.filter(dp_of == ref).select(pos.alias("pos"), pl.col("ns").alias("ref_ns"))
    grown = mine.join(theirs, on="pos").with_columns((pl.col("ns") - pl.col("ref_ns")).alias("grown")).sort(
        "grown", descending=True)
    if not grown.height or grown["grown"][0] < tun.link_effect_min_frac * step_ns:
        return []
    rank = int(grown["rank"][0])
    evidence["peerless_link"] = {"rank": rank, "grown_ns": float(grown["grown"][0])}
    return around(lay.coords(rank).pp, lay)


def around(stage: int, lay: Layout) -> list[int]:
    """A stage and its neighbours: where a link of that stage's unknown peer can be."""
    return [q for q in (stage - 1, stage, stage + 1) if 0 <= q < lay.pp]


def slow_groups(con, run_id: str, lay: Layout, tun: Tunables, step_ns: float, steps: list[int] | None = None,
                every: int = 1) -> tuple[pl.DataFrame, int]:
    """(slow TP and CP groups: pg_name, dim, first member, pp; groups measured): each group's
    transfers (per collective the fastest member's time, one clock, so neither skew nor compute
    noise enters) summed per step, against the other groups of the same dimension and stage, by the
    diagnosis' link rules (ratio, cost). ``steps``: only these steps are read; ``every``: only each
    such collective of a group (by sequence number: the same ones in every group of a dimension and
    stage, which run the same program), where the cost of a slow one is then ``every`` x its excess."""
    within = "" if steps is None else f" AND step IN ({', '.join(str(int(x)) for x in steps)})"
    within += f" AND seq % {int(every)} = 0" if every > 1 else ""
    # aggregated before the groups are joined: a semi-join on the group names cost 0.25 s more at 16,384 ranks
    rows = con.sql(
        "WITH t AS (SELECT pg_name, seq, any_value(step) AS step, min(end_ns - start_ns) AS t FROM collectives "
        f"WHERE run_id = $r AND source <> 'fr' AND step IS NOT NULL{within} GROUP BY pg_name, seq), "
        "g AS (SELECT pg_name, dim, ranks[1] AS first FROM groups WHERE run_id = $r AND dim IN ('tp', 'cp') "
        "AND size >= 2) SELECT t.pg_name, any_value(g.dim) AS dim, any_value(g.first) AS first, "
        f"({int(every)} * sum(t.t) / count(DISTINCT t.step))::DOUBLE AS per_step FROM t JOIN g USING (pg_name) "
        "GROUP BY t.pg_name", params={"r": run_id}).pl()
    rows = rows.with_columns((pl.col("first") // lay.stride("pp") % lay.pp).alias("pp"))
    ref = ((pl.col("per_step").sum().over("dim", "pp") - pl.col("per_step")) / (pl.len().over("dim", "pp") - 1))
    measured = rows.filter(pl.len().over("dim", "pp") >= 2).with_columns(ref.alias("ref")).with_columns(
        (pl.col("per_step") / pl.col("ref")).alias("ratio"), (pl.col("per_step") - pl.col("ref")).alias("excess"))
    slow = measured.filter((pl.col("ratio") >= tun.slow_link_ratio)
                           & costs_enough(pl.col("ratio"), pl.col("excess"), step_ns, tun)).sort(
        "ratio", descending=True).head(tun.scope_candidates)
    return slow, measured.height


def group_level(con, run_id: str, lay: Layout, tun: Tunables, step_ns: float
                ) -> tuple[set[tuple[int, int]], dict]:
    """The cells (replica, stage) of slow TP and CP groups anywhere in the job (``slow_groups``), from
    a sample of their collectives (``SCOPE_GROUP_STEPS``, ``SCOPE_GROUP_EVERY``). Otherwise such a
    link is found only through its replica's lateness, which kernel noise hides: at 15% noise a CP
    link 20 ms late (a quarter of a step) left its replica about 1 noise unit late, and a 512-rank
    job read "no straggler" at 0.95."""
    if lay.tp * lay.cp < 2:
        return set(), {"level": "tp_cp", "read": "nothing (tp = cp = 1)"}
    run_steps = [int(x) for x, in con.sql("SELECT DISTINCT step FROM steps WHERE run_id = $r AND step IS NOT NULL "
                                           "ORDER BY step", params={"r": run_id}).fetchall()]
    # steps spread over the run, neither end (the first warms up; a run that hung ends inside its last)
    steps = sorted({run_steps[(i + 1) * len(run_steps) // (SCOPE_GROUP_STEPS + 1)]
                    for i in range(SCOPE_GROUP_STEPS)}) if run_steps else []
    slow, n = slow_groups(con, run_id, lay, tun, step_ns, steps or None, SCOPE_GROUP_EVERY)
    cells = {(lay.coords(int(f)).dp, int(q)) for f, q in slow.select("first", "pp").iter_rows()}
    return cells, {"level": "tp_cp", "read": f"each {SCOPE_GROUP_EVERY}th TP and CP collective of {len(steps)} steps",
                   "rows": n, "steps": steps, "slow_groups": slow["pg_name"].to_list()}


def stage_group_level(con, run_id: str, lay: Layout, tun: Tunables, step_ns: float) -> tuple[list[int], dict]:
    """With one replica (dp = 1), the stages holding a slow TP or CP group (``slow_groups``, every
    step); and, where the p2p records name no peer, the stages around the rank whose sends exceed
    its stage's most (as ``peerless_link``, its stage standing in for a reference replica). Reads
    every TP and CP collective and every send: affordable where a single replica is the whole job."""
    slow, n = slow_groups(con, run_id, lay, tun, step_ns)
    evidence: dict = {"level": "groups", "read": "TP and CP collectives, sends (one replica)", "rows": n,
                      "slow_groups": slow["pg_name"].to_list()}
    stages = {int(q) for q in slow["pp"].to_list()}
    if lay.pp > 1:  # pipeline links whose records name no peer: the rank whose sends exceed its stage's most
        sends = con.sql("SELECT rank, (sum(end_ns - start_ns) / count(DISTINCT step))::DOUBLE AS ns FROM p2p "
                        "WHERE run_id = $r AND source <> 'fr' AND direction = 'send' AND step IS NOT NULL "
                        "AND end_ns IS NOT NULL GROUP BY rank HAVING count(peer) = 0", params={"r": run_id}).pl()
        if sends.height:
            sends = sends.with_columns((pl.col("rank") // lay.stride("pp") % lay.pp).alias("pp")).with_columns(
                (pl.col("ns") - pl.col("ns").median().over("pp")).alias("grown")).sort("grown", descending=True)
            if sends["grown"][0] >= tun.link_effect_min_frac * step_ns:
                stages |= set(around(int(sends["pp"][0]), lay))
                evidence["peerless_link"] = {"rank": int(sends["rank"][0]), "grown_ns": float(sends["grown"][0])}
    evidence["stages"] = sorted(stages)
    return sorted(stages), evidence
