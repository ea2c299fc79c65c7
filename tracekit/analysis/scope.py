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
beside them, every pipeline link's fastest message and a sample of every TP and CP group's
transfers, against the same kind at the same stages; the other ranks of a host holding several
compute candidates; and the stage whose compute exceeds the others in every replica. Where fewer
than three replicas (or DP groups) compare, a level judges by effect or ratio alone, and with one
replica the stage's TP and CP groups are held against each other instead. The levels that read
communication records (links, PP, TP and CP groups) are in scope_comm.py; docs/scale.md has each level and how the
scope fares on the fault grid. The scope is those ranks' cells
(a replica's stage: its CP x TP ranks) with the same cells of reference replicas as their peers,
and the diagnosis runs on it unchanged (``Store.diagnose``), told how many ranks the candidates
were picked from so that its bars stay those of the whole job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from tracekit.analysis.links import P2PCoverage
from tracekit.analysis.scope_comm import group_level, link_level, pp_level, stage_group_level
from tracekit.analysis.standout import spread
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
    # the whole job's p2p as the links level measured it (None: no p2p level, pp = 1)
    p2p_cover: P2PCoverage | None = None

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
                said.append(f"compute of every rank: {len(picked or [])} stand out"
                            + (f", with {len(lv['host_mates'])} more ranks of their hosts" if lv.get("host_mates")
                               else ""))
            elif lv["level"] == "dp" and "rows" in lv:
                said.append(f"DP collectives of every rank: late replicas {picked or 'none'}"
                            + (f", slow DP group {lv['slow_group']['pg_name']}" if lv.get("slow_group") else ""))
            elif lv["level"] == "links" and "rows" in lv:
                said.append(f"p2p of every rank: {len(lv.get('slow_links') or [])} slow links")
            elif lv["level"] == "pp":
                said.append(f"{lv['waits']} of replica {lv['replica']} against replica {lv['ref']}: "
                            f"stages {picked or 'none'}")
            elif lv["level"] == "tp_cp" and "rows" in lv:
                said.append(f"TP and CP groups of every replica ({len(lv['steps'])} steps): "
                            f"{len(lv['slow_groups'])} slow")
            elif lv["level"] == "groups":
                said.append(f"TP and CP groups and sends of the one replica: stages {picked or 'none'}")
            elif lv["level"] == "stage" and picked:
                said.append(f"heavy stages {picked}")
        return (f"large job: the diagnosis read {len(self.ranks):,} of {self.world_size:,} ranks, chosen top-down ("
                + "; ".join(said) + ") with reference replicas as their peers")

    def to_dict(self) -> dict:
        return {"ranks": len(self.ranks), "world_size": self.world_size, "summary": self.summary,
                "levels": list(self.levels)}


def _next_position(lay: Layout, rank: int) -> int:
    """The rank at the next position of ``rank``'s replica (the previous one from its last)."""
    if lay.stride("dp") * lay.dp == lay.world_size:  # DP outermost: a replica is a range of ranks
        return rank + 1 if (rank + 1) % (lay.world_size // lay.dp) else rank - 1
    c = lay.coords(rank).as_dict()
    inner = [(d, getattr(lay, d)) for d in ("tp", "cp", "pp") if getattr(lay, d) > 1]
    for d, n in inner:  # the innermost coordinate that can move
        return lay.rank_of(**{**c, d: c[d] + 1 if c[d] + 1 < n else c[d] - 1})
    return rank


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
    compute = compute.with_columns(((pl.col("rank") // lay.stride("pp")) % lay.pp).alias("pp"))
    peers = ["pp", "step"]
    n = pl.len().over(peers)
    ref = (pl.col("trimmed_ns").sum().over(peers) - pl.col("trimmed_ns")) / (n - 1)
    ratios = compute.filter(n > 1).with_columns((pl.col("trimmed_ns") / ref).log().alias("lr")).filter(
        pl.col("lr").is_finite())
    if not ratios.height:  # one rank per stage (tp = cp = dp = 1): no rank has a peer to stand out against
        return [], {"level": "compute", "read": "events: no rank shares its stage", "rows": compute.height,
                    "candidates": []}, compute
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


def _host_mates(con, run_id: str, candidates: list[int], tun: Tunables) -> list[int]:
    """The other ranks of each host that holds two candidates or more: a slow host's ranks stand out
    together, more of them than the compute level lets through (``scope_candidates`` per score), and
    a host read in part was named with "each of its 5 ranks" of 8 (1,024 ranks, tp 1 x pp 8 x dp 128,
    a host of 8 at 1.1x). Hosts come from the ranks table (the profiler's file names)."""
    if len(candidates) < 2:
        return []
    hosts = con.sql("SELECT rank, host FROM ranks WHERE run_id = $r AND host IS NOT NULL",
                    params={"r": run_id}).pl()
    if not hosts.height or hosts["host"].n_unique() < 2:  # one host: nothing to set it against
        return []
    held = hosts.filter(pl.col("rank").is_in(candidates)).group_by("host").len().filter(pl.col("len") >= 2)
    busiest = held.sort("len", descending=True)["host"].head(tun.scope_candidates).to_list()
    mates = hosts.filter(pl.col("host").is_in(busiest) & ~pl.col("rank").is_in(candidates))["rank"]
    return sorted(int(r) for r in mates)


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
        rows = rows.with_columns((pl.col("rank") // lay.stride("dp") % lay.dp).alias("dp"))
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
        # late in most steps first: a replica with two spikes outscores a slow link's steady lateness
        # step by step (1,024 ranks, CP link 20 ms: 80 ms late in all 20 steps, z 80, behind two
        # replicas late 150-360 ms in two steps each), and only the first two are searched below
        steady = np.nanmedian(np.nan_to_num(z, nan=-np.inf), axis=1) >= tun.scope_z_step
        order = np.lexsort((-score, ~steady))[:tun.scope_candidates]
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
    pairs, ev, cover = link_level(con, run_id, lay, tun)
    levels.append(ev)
    mates = _host_mates(con, run_id, candidates, tun)
    if mates:
        levels[0] = {**levels[0], "host_mates": mates}
    cells: set[tuple[int, int]] = {(lay.coords(r).dp, lay.coords(r).pp) for r in [*candidates, *mates]}
    link_cells = {(lay.coords(r).dp, lay.coords(r).pp) for pair in pairs for r in pair}
    if lay.dp == 1:  # no replica to hold a late one against: the stage's groups against each other
        slow_stages, ev = stage_group_level(con, run_id, lay, tun, step_ns)
        levels.append(ev)
        link_cells |= {(0, q) for q in slow_stages}
    else:  # slow TP and CP groups anywhere, whether or not their replica stands out as late
        group_cells, ev = group_level(con, run_id, lay, tun, step_ns)
        levels.append(ev)
        link_cells |= group_cells
    busy = {d for d, _ in cells} | set(late)
    # reference replicas: quiet ones first; where too few are quiet (two replicas, both with a
    # candidate), busy ones too: any other replica's cell is a peer of the same position
    refs = sorted(range(lay.dp), key=lambda d: d in busy)[: max(1, math.ceil(tun.scope_min_peers / (lay.cp * lay.tp)))]
    # every late replica is searched, candidates or not: the compute level lets a few ranks of a large
    # job through by chance, and one of those in a replica would hide its slow link
    for replica in late[:2]:
        ref = next((d for d in refs if d != replica), None)
        if ref is not None:
            stages, ev = pp_level(con, run_id, lay, replica, ref, tun, step_ns)
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
    if slow_group:  # its peers: another DP group of the same kind (the next position in the replica)
        ranks |= {_next_position(lay, r) for r in slow_group}
    return Scope(tuple(sorted(ranks)), lay.world_size, tuple(levels), cover)
