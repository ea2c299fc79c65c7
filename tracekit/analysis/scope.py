"""Top-down and lazy for large jobs: which ranks the diagnosis must read, chosen from aggregates.

At thousands of ranks the per-event tables do not fit in memory and need not: a slow rank, link or
stage shows in a few numbers per (rank, step). ``narrow`` computes those where the data lies
(DuckDB, over a store file or a Parquet dataset, streaming) and picks the scope level by level:
1. compute (every rank; events summed per rank, step and kernel name): ranks whose compute stands
   out against their stage, persistently or in some steps;
2. DP (every rank; only data-parallel collectives): the replica the others wait for, per step, and
   the DP group whose transfers (the fastest member's time, one clock) are slow;
3. PP (only the late replica's ranks and a reference replica's): the stage whose pipeline and
   in-stage communication waits grew against the same stage of the reference;
and the stage whose compute exceeds the others in every replica. Where fewer than three replicas
(or DP groups) compare, a level judges by effect or ratio alone, and with one replica the stage's
TP and CP groups are held against each other instead (docs/scale.md has each level and how the
scope fares on the fault grid). The scope is those ranks' cells
(a replica's stage: its CP x TP ranks) with the same cells of reference replicas as their peers,
and the diagnosis runs on it unchanged (``Store.diagnose``), told how many ranks the candidates
were picked from so that its bars stay those of the whole job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from tracekit.analysis.links import costs_enough, pair_messages
from tracekit.analysis.standout import spread
from tracekit.analysis.tables import ranked_source
from tracekit.analysis.tunables import Tunables
from tracekit.topology import Layout

# tables.compute_events' definition of model compute, as SQL (kept beside it: one decision)
COMPUTE_SQL = ("NOT coalesce(is_comm, false) AND step IS NOT NULL "
               "AND (phase IN ('fwd', 'bwd') OR (kind = 'kernel' AND phase IS NULL))")
# Spans left out of each (rank, step)'s compute: a deschedule spike is one span far longer than the
# rest. Leaving out the longest only, a rank-step with two spikes stood out by chance (at 1,024 ranks
# with one span in 2,000 spiked, 39-48 rank-steps at z 16-80; 612 at 16,384 ranks, and 3 ranks
# "persistent"), and each such candidate's cells were read. Three leave a rank-step with four spikes
# (about 1 in 10^6 at that rate) and cost nothing measurable (0.97 -> 0.99 s at 16,384 ranks).
SCOPE_TRIM_SPANS = 3
# Fewer units than this (two replicas, two DP groups) have no spread to judge one by: the scope then
# reads the later or slower one wherever its effect is large enough.
MIN_COMPARED = 3


@dataclass(frozen=True)
class Scope:
    """The ranks a scoped diagnosis reads, and why each level chose what it chose."""

    ranks: tuple[int, ...]
    world_size: int
    levels: tuple[dict, ...] = field(default_factory=tuple)

    def ranges(self) -> list[tuple[int, int]]:
        """The ranks as inclusive contiguous ranges (cells are contiguous: TP, CP innermost)."""
        out: list[tuple[int, int]] = []
        for r in self.ranks:
            if out and out[-1][1] == r - 1:
                out[-1] = (out[-1][0], r)
            else:
                out.append((r, r))
        return out

    @property
    def summary(self) -> str:
        """What was read, in one line."""
        said = []
        for lv in self.levels:
            picked = lv.get("candidates") or lv.get("late_replicas") or lv.get("stages") or lv.get("heavy")
            if lv["level"] == "compute":
                said.append(f"compute of every rank: {len(picked or [])} stand out")
            elif lv["level"] == "dp" and "rows" in lv:
                said.append(f"DP collectives of every rank: late replicas {picked or 'none'}"
                            + (f", slow DP group {lv['slow_group']['pg_name']}" if lv.get("slow_group") else ""))
            elif lv["level"] == "links" and "rows" in lv:
                said.append(f"p2p of every rank: {len(lv.get('slow_links') or [])} slow links")
            elif lv["level"] == "pp":
                said.append(f"pipeline waits of two replicas: stages {picked or 'none'}")
            elif lv["level"] == "stage" and picked:
                said.append(f"heavy stages {picked}")
        return (f"large job: the diagnosis read {len(self.ranks):,} of {self.world_size:,} ranks, chosen top-down ("
                + "; ".join(said) + ") with reference replicas as their peers")

    def to_dict(self) -> dict:
        return {"ranks": len(self.ranks), "world_size": self.world_size, "summary": self.summary,
                "levels": list(self.levels)}


def _cell(lay: Layout, dp: int, pp: int) -> range:
    first = lay.rank_of(dp=dp, pp=pp)
    return range(first, first + lay.cp * lay.tp)


def _compute_level(con, run_id: str, lay: Layout, tun: Tunables) -> tuple[list[int], dict, pl.DataFrame]:
    """Ranks whose compute stands out, and the per-(rank, step) compute (for the stage level)."""
    # per (rank, step): the compute without its SCOPE_TRIM_SPANS longest spans, so that a few descheduled
    # kernels (the longest by far) move nothing; summed where the data lies, no span leaves DuckDB
    compute = con.sql(f"SELECT rank, step, sum(dur_ns)::DOUBLE AS compute_ns, (sum(dur_ns) - "
                      f"list_sum(max(dur_ns, {SCOPE_TRIM_SPANS})))::DOUBLE AS trimmed_ns FROM events "
                      f"WHERE run_id = $r AND {COMPUTE_SQL} GROUP BY ALL", params={"r": run_id}).pl()
    if not compute.height:
        return [], {"level": "compute", "read": "events (none recorded)"}, compute
    compute = compute.with_columns(((pl.col("rank") // (lay.tp * lay.cp)) % lay.pp).alias("pp"))
    peers = ["pp", "step"]
    n = pl.len().over(peers)
    ref = (pl.col("trimmed_ns").sum().over(peers) - pl.col("trimmed_ns")) / (n - 1)
    ratios = compute.filter(n > 1).with_columns((pl.col("trimmed_ns") / ref).log().alias("lr")).filter(
        pl.col("lr").is_finite())
    wide = ratios.pivot(on="step", index="rank", values="lr").sort("rank")
    ranks = wide["rank"].to_numpy()
    mat = wide.drop("rank").to_numpy().astype(float)
    mat = mat - np.nanmedian(mat, axis=0, keepdims=True)
    sigma = max(spread(mat[np.isfinite(mat)]), 1e-4)
    steps = np.isfinite(mat).sum(axis=1).clip(min=1)
    # persistent: the steps' mean without the two most extreme (a step or two of preemption); episodic: one step
    ordered = np.sort(np.where(np.isfinite(mat), mat, np.nan), axis=1)
    kept = ordered[:, 1:-1] if mat.shape[1] >= 6 else ordered
    persistent = np.nanmean(kept, axis=1) / (sigma / np.sqrt(np.isfinite(kept).sum(axis=1).clip(min=1)))
    episodic = np.nanmax(mat, axis=1) / sigma
    # a step's excess is a candidate only where the diagnosis could call it an episode: within half its
    # floor (episode_min_ratio; the scope's sum and the diagnosis' matched spans differ a little).
    # The z bar alone let the far tail of 20,480-327,680 cells through (z 5.7-6.3 with no fault)
    step_bar = max(tun.scope_z_step, math.log(tun.episode_min_ratio) / 2 / sigma)
    pick = set()
    for score, bar in ((persistent, tun.scope_z_persistent), (episodic, step_bar)):
        order = np.argsort(-np.nan_to_num(score, nan=-np.inf))[: tun.scope_candidates]
        pick |= {int(ranks[i]) for i in order if score[i] >= bar}
    return sorted(pick), {"level": "compute", "read": "events: compute per rank and step, summed in place",
                          "rows": compute.height, "sigma": sigma, "candidates": sorted(pick),
                          "steps": int(steps.max())}, compute


def _dp_level(con, run_id: str, lay: Layout, tun: Tunables, step_ns: float) -> tuple[list[int], list[int], dict]:
    """(late replicas, ranks of a slow DP group, evidence): from the DP collectives alone."""
    if lay.dp < 2:
        return [], [], {"level": "dp", "read": "nothing (dp = 1)"}
    # one scan of the DP collectives (two records a rank and step), both sums taken from it: each
    # scan of a 16,384-rank dataset's collectives costs about 0.55 s
    dp_ops = con.sql(
        "WITH g AS (SELECT pg_name FROM groups WHERE run_id = $r AND dim = 'dp') "
        "SELECT rank, pg_name, seq, step, end_ns - start_ns AS d FROM collectives "
        "WHERE run_id = $r AND source <> 'fr' AND pg_name IN (SELECT pg_name FROM g) AND step IS NOT NULL",
        params={"r": run_id}).pl()
    rows = dp_ops.group_by("rank", "step").agg(pl.col("d").sum().cast(pl.Float64).alias("wait_ns"))
    links = (dp_ops.group_by("pg_name", "seq", "step").agg(pl.col("d").min().alias("t"))
             .group_by("pg_name", "step").agg(pl.col("t").sum().cast(pl.Float64).alias("transfer_ns")))
    evidence: dict = {"level": "dp", "read": "collectives of the DP groups only", "rows": rows.height}
    late: list[int] = []
    if rows.height:
        rows = rows.with_columns((pl.col("rank") // (lay.world_size // lay.dp)).alias("dp"))
        # the replica everyone waits for waits least itself: its lateness is the others' median wait minus its own
        per = rows.group_by("dp", "step").agg(pl.col("wait_ns").mean()).pivot(on="step", index="dp", values="wait_ns")
        dps = per["dp"].to_numpy()
        mat = per.drop("dp").to_numpy().astype(float)
        lateness = np.nanmedian(mat, axis=0, keepdims=True) - mat
        scale = np.array([max(spread(c[np.isfinite(c)]), 1e-9) for c in lateness.T])
        # two replicas have no spread to measure against (their z is 0.67 whatever happens): the
        # later one is read where it alone is late enough in two steps (a cell more to read, not a verdict)
        z = lateness / scale if len(dps) >= MIN_COMPARED else np.where(lateness > 0, np.inf, -np.inf)
        # late in two steps at least: the diagnosis names no episode of one step (culprits.py), and at
        # one span in 2,000 descheduled every replica of 256 ranks has a spike or more in every step,
        # so some replica is late by one in some step (1,024 ranks: two more cells read, 0.3-0.4 s)
        second = lambda m: np.sort(np.nan_to_num(m, nan=-np.inf), axis=1)[:, -min(2, m.shape[1])]  # noqa: E731
        score, effect = second(z), second(lateness)
        order = np.argsort(-score)[:tun.scope_candidates]
        late = [int(dps[i]) for i in order if score[i] >= tun.scope_z_step
                and effect[i] >= tun.effect_min_frac * step_ns]
        if len(dps) < MIN_COMPARED and len(late) > 1:  # each of two later in turn: neither is the late one
            late = []
        evidence["late_replicas"] = late
    slow_group: list[int] = []
    med = links.group_by("pg_name").agg(pl.col("transfer_ns").median())
    if med.height >= 2:
        vals = med["transfer_ns"].to_numpy()
        top = int(np.argmax(vals))
        if vals.size >= MIN_COMPARED:
            s = max(spread(vals), 1e-9 * max(float(np.median(vals)), 1.0))
            z, ref = (vals[top] - np.median(vals)) / s, float(np.median(vals))
        else:  # two DP groups: no spread to measure against; the slower by the ratio alone
            z, ref = math.inf, float(np.min(vals))
        if z >= tun.scope_z_step and vals[top] >= ref * tun.slow_link_ratio:
            name = med["pg_name"][top]
            members = con.sql("SELECT ranks FROM groups WHERE run_id = $r AND pg_name = $p",
                              params={"r": run_id, "p": name}).fetchall()
            slow_group = sorted(int(x) for x in members[0][0]) if members else []
            evidence["slow_group"] = {"pg_name": name, "z": float(z)}
    return late, slow_group, evidence


def _link_level(con, run_id: str, lay: Layout, tun: Tunables) -> tuple[list[tuple[int, int]], dict]:
    """Pipeline links whose every message is slow: per link the fastest transfer of all its messages
    (a send or receive's own duration, one clock; a slow link has no fast message, a late rank's
    links do), against the links between the same two stages. Reads only the p2p records."""
    if lay.pp < 2:
        return [], {"level": "links", "read": "nothing (pp = 1)"}
    rows = con.sql("SELECT rank, peer, direction, min(end_ns - start_ns)::DOUBLE AS t FROM p2p WHERE run_id = $r "
                   "AND source <> 'fr' AND peer IS NOT NULL AND end_ns IS NOT NULL GROUP BY ALL",
                   params={"r": run_id}).pl()
    evidence: dict = {"level": "links", "read": "p2p records: each link's fastest message", "rows": rows.height}
    if not rows.height:
        return [], evidence
    send = pl.col("direction") == "send"
    stage = lambda c: (pl.col(c) // (lay.tp * lay.cp)) % lay.pp  # noqa: E731
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
    return pairs, evidence


def _pp_level(con, run_id: str, lay: Layout, replica: int, ref: int, tun: Tunables, step_ns: float
              ) -> tuple[list[int], dict]:
    """The stages of ``replica`` to read: the ends of its pipeline link whose transfers (the shorter of
    send and receive, one clock) grew most against the same stage pair of ``ref``, and the stage whose
    in-stage collectives grew most. Reads only those two replicas' p2p and non-DP collectives."""
    size = lay.world_size // lay.dp
    ranges = sorted([(replica * size, (replica + 1) * size - 1), (ref * size, (ref + 1) * size - 1)])
    p2p_src, p2p_within = ranked_source(con, "p2p", ranges)
    coll_src, coll_within = ranked_source(con, "collectives", ranges)
    stage = (pl.col("rank") // (lay.tp * lay.cp)) % lay.pp
    evidence: dict = {"level": "pp", "read": f"p2p and in-stage collectives of replicas {replica} and {ref}"}
    stages: list[int] = []
    p2p = con.sql(f"SELECT rank, peer, direction, step, start_ns, end_ns FROM {p2p_src} WHERE run_id = $r "
                  f"AND source <> 'fr'{p2p_within} AND step IS NOT NULL", params={"r": run_id}).pl()
    if p2p.height and not p2p["peer"].is_not_null().any():
        stages += _peerless_link(p2p, lay, replica, ref, tun, step_ns, evidence)
    p2p = p2p.filter(pl.col("peer").is_not_null())
    if p2p.height:
        pairs = pair_messages(p2p)
        # each link against the link at the same position of the reference replica
        shift = (replica - ref) * size
        per = pairs.with_columns(pl.min_horizontal("send", "recv").alias("t")).group_by("src", "dst").agg(
            pl.col("t").median(), (pl.col("t").sum() / pl.col("step").n_unique()).alias("per_step"))
        mine = per.filter(pl.col("src") // size == replica)
        theirs = per.filter(pl.col("src") // size == ref).select(
            (pl.col("src") + shift).alias("src"), (pl.col("dst") + shift).alias("dst"), pl.col("t").alias("t_ref"),
            pl.col("per_step").alias("ps_ref"))
        both = mine.join(theirs, on=["src", "dst"]).with_columns(
            (pl.col("t") / pl.col("t_ref")).alias("ratio"), (pl.col("per_step") - pl.col("ps_ref")).alias("excess"))
        # the diagnosis' own cost rule (on any transport: here it only chooses what to read)
        both = both.filter((pl.col("ratio") >= tun.slow_link_ratio)
                           & costs_enough(pl.col("ratio"), pl.col("excess"), step_ns, tun)).sort("ratio", descending=True)
        if both.height:
            top = both.row(0, named=True)
            a, b = (int(top[x]) // (lay.tp * lay.cp) % lay.pp for x in ("src", "dst"))
            stages += [a, b]
            evidence["link"] = {"ranks": [int(top["src"]), int(top["dst"])], "ratio": float(top["ratio"])}
    coll = con.sql(
        "WITH dpg AS (SELECT pg_name FROM groups WHERE run_id = $r AND dim = 'dp') "
        f"SELECT rank, step, sum(end_ns - start_ns)::DOUBLE AS ns FROM {coll_src} WHERE run_id = $r "
        f"AND source <> 'fr'{coll_within} AND step IS NOT NULL AND pg_name NOT IN (SELECT pg_name FROM dpg) "
        "GROUP BY ALL", params={"r": run_id}).pl()
    if coll.height:
        per = coll.with_columns((pl.col("rank") // size).alias("dp"), stage.alias("pp")).group_by("dp", "pp").agg(
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


def _peerless_link(p2p: pl.DataFrame, lay: Layout, replica: int, ref: int, tun: Tunables, step_ns: float,
                   evidence: dict) -> list[int]:
    """The stages around a slow link where the p2p records name no peer (NCCL's name the pipeline group
    only; the diagnosis pairs them with the flight recorder's entries, which SQL cannot align): the rank
    whose sends grew most against the same position of ``ref``, and its two neighbouring stages (the
    link is to one of them). Sends, not receives: a late replica's receives all wait longer, and a
    slow link's sends grow at its two ends (by 1.3-2x the replica's other sends on the fault grid)."""
    size = lay.world_size // lay.dp
    sends = p2p.filter((pl.col("direction") == "send") & pl.col("end_ns").is_not_null()).group_by("rank").agg(
        ((pl.col("end_ns") - pl.col("start_ns")).sum() / pl.col("step").n_unique()).cast(pl.Float64).alias("ns"))
    mine = sends.filter(pl.col("rank") // size == replica).with_columns((pl.col("rank") % size).alias("pos"))
    theirs = sends.filter(pl.col("rank") // size == ref).select((pl.col("rank") % size).alias("pos"),
                                                                pl.col("ns").alias("ref_ns"))
    grown = mine.join(theirs, on="pos").with_columns((pl.col("ns") - pl.col("ref_ns")).alias("grown")).sort(
        "grown", descending=True)
    if not grown.height or grown["grown"][0] < tun.link_effect_min_frac * step_ns:
        return []
    rank = int(grown["rank"][0])
    stage = lay.coords(rank).pp
    evidence["peerless_link"] = {"rank": rank, "grown_ns": float(grown["grown"][0])}
    return [q for q in (stage - 1, stage, stage + 1) if 0 <= q < lay.pp]


def _stage_group_level(con, run_id: str, lay: Layout, tun: Tunables, step_ns: float) -> tuple[list[int], dict]:
    """With one replica (dp = 1), the stages holding a slow TP or CP group: each group's transfers
    (per collective the fastest member's time, one clock) summed per step, against the groups of the
    same dimension and stage, by the diagnosis' link rules (ratio, cost); and, where the p2p records
    name no peer, the stages around the rank whose sends exceed its stage's most (as
    ``_peerless_link``, its stage standing in for a reference replica). Reads every TP and CP
    collective and every send: affordable where a single replica is the whole job."""
    rows = con.sql(
        "WITH g AS (SELECT pg_name, dim, ranks[1] AS first FROM groups WHERE run_id = $r AND dim IN ('tp', 'cp') "
        "AND size >= 2), t AS (SELECT pg_name, seq, any_value(step) AS step, min(end_ns - start_ns) AS t "
        "FROM collectives WHERE run_id = $r AND source <> 'fr' AND step IS NOT NULL "
        "AND pg_name IN (SELECT pg_name FROM g) GROUP BY ALL) "
        "SELECT t.pg_name, any_value(g.dim) AS dim, any_value(g.first) AS first, "
        "(sum(t.t) / count(DISTINCT t.step))::DOUBLE AS per_step FROM t JOIN g USING (pg_name) GROUP BY t.pg_name",
        params={"r": run_id}).pl()
    evidence: dict = {"level": "groups", "read": "TP and CP collectives, sends (one replica)", "rows": rows.height}
    if not rows.height:
        return [], evidence
    rows = rows.with_columns((pl.col("first") // (lay.tp * lay.cp) % lay.pp).alias("pp"))
    ref = ((pl.col("per_step").sum().over("dim", "pp") - pl.col("per_step")) / (pl.len().over("dim", "pp") - 1))
    rows = rows.filter(pl.len().over("dim", "pp") >= 2).with_columns(ref.alias("ref")).with_columns(
        (pl.col("per_step") / pl.col("ref")).alias("ratio"), (pl.col("per_step") - pl.col("ref")).alias("excess"))
    slow = rows.filter((pl.col("ratio") >= tun.slow_link_ratio)
                       & costs_enough(pl.col("ratio"), pl.col("excess"), step_ns, tun)).sort(
        "ratio", descending=True).head(tun.scope_candidates)
    stages = {int(q) for q in slow["pp"].to_list()}
    evidence["slow_groups"] = slow["pg_name"].to_list()
    if lay.pp > 1:  # pipeline links whose records name no peer: the rank whose sends exceed its stage's most
        sends = con.sql("SELECT rank, (sum(end_ns - start_ns) / count(DISTINCT step))::DOUBLE AS ns FROM p2p "
                        "WHERE run_id = $r AND source <> 'fr' AND direction = 'send' AND step IS NOT NULL "
                        "AND end_ns IS NOT NULL GROUP BY rank HAVING count(peer) = 0", params={"r": run_id}).pl()
        if sends.height:
            sends = sends.with_columns((pl.col("rank") // (lay.tp * lay.cp) % lay.pp).alias("pp")).with_columns(
                (pl.col("ns") - pl.col("ns").median().over("pp")).alias("grown")).sort("grown", descending=True)
            if sends["grown"][0] >= tun.link_effect_min_frac * step_ns:
                q = int(sends["pp"][0])
                stages |= {x for x in (q - 1, q, q + 1) if 0 <= x < lay.pp}
                evidence["peerless_link"] = {"rank": int(sends["rank"][0]), "grown_ns": float(sends["grown"][0])}
    evidence["stages"] = sorted(stages)
    return sorted(stages), evidence


def _stage_level(compute: pl.DataFrame, lay: Layout, tun: Tunables) -> tuple[list[int], dict]:
    if lay.pp < 2 or not compute.height:
        return [], {"level": "stage", "read": "nothing (pp = 1)"}
    per = compute.group_by("pp", "step").agg(pl.col("compute_ns").median()).group_by("pp").agg(
        pl.col("compute_ns").median()).sort("pp")
    ratio = per["compute_ns"].to_numpy() / max(float(np.median(per["compute_ns"].to_numpy())), 1.0)
    heavy = [int(p) for p, r in zip(per["pp"].to_list(), ratio) if r >= tun.stage_compute_ratio]
    return heavy, {"level": "stage", "read": "compute per stage", "heavy": heavy,
                   "ratios": {str(p): float(r) for p, r in zip(per["pp"].to_list(), ratio)}}


def narrow(con, run_id: str, lay: Layout, tun: Tunables = Tunables()) -> Scope:
    """The scope of a large job's diagnosis (module docstring)."""
    levels = []
    step = con.sql("SELECT median(end_ns - start_ns)::DOUBLE FROM steps WHERE run_id = $r", params={"r": run_id}
                   ).fetchall()
    step_ns = float(step[0][0]) if step and step[0][0] else 0.0
    candidates, ev, compute = _compute_level(con, run_id, lay, tun)
    levels.append(ev)
    late, slow_group, ev = _dp_level(con, run_id, lay, tun, step_ns)
    levels.append(ev)
    pairs, ev = _link_level(con, run_id, lay, tun)
    levels.append(ev)
    cells: set[tuple[int, int]] = {(lay.coords(r).dp, lay.coords(r).pp) for r in candidates}
    link_cells = {(lay.coords(r).dp, lay.coords(r).pp) for pair in pairs for r in pair}
    if lay.dp == 1:  # no replica to hold a late one against: the stage's groups against each other
        slow_stages, ev = _stage_group_level(con, run_id, lay, tun, step_ns)
        levels.append(ev)
        link_cells |= {(0, q) for q in slow_stages}
    busy = {d for d, _ in cells} | set(late)
    # reference replicas: quiet ones first; where too few are quiet (two replicas, both with a
    # candidate), busy ones too: any other replica's cell is a peer of the same position
    refs = sorted(range(lay.dp), key=lambda d: d in busy)[: max(1, math.ceil(tun.scope_min_peers / (lay.cp * lay.tp)))]
    # every late replica is searched, candidates or not: the compute level lets a few ranks of a large
    # job through by chance, and one of those in a replica would hide its slow link
    for replica in late[:2]:
        ref = next((d for d in refs if d != replica), None)
        if ref is not None:
            stages, ev = _pp_level(con, run_id, lay, replica, ref, tun, step_ns)
            levels.append(ev)
            cells |= {(replica, q) for q in stages}
    cells |= link_cells
    heavy, ev = _stage_level(compute, lay, tun)
    levels.append(ev)
    for p in heavy:
        others = [q for q in range(lay.pp) if q != p][:2]
        cells |= {(refs[0] if refs else 0, q) for q in [p, *others]}
    if not cells and not slow_group:  # nothing stands out: the verdict reads a sample (first and last stage)
        cells = {(refs[0] if refs else 0, p) for p in {0, lay.pp - 1}}
    stages = {p for _, p in cells}
    cells |= {(d, p) for d in refs for p in stages}
    ranks = {r for d, p in cells for r in _cell(lay, d, p)} | set(slow_group)
    if slow_group:  # its peers: another DP group of the same kind (the next position)
        ranks |= {r + 1 if (r + 1) % (lay.world_size // lay.dp) else r - 1 for r in slow_group}
    return Scope(tuple(sorted(ranks)), lay.world_size, tuple(levels))
