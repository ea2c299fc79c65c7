"""Why is the culprit slow? Open its own timeline and compare it with its peers (ALGORITHMS.md).

Causes, checked in this order on the culprit found by ``localize``:
- slow_link: transfers (time from both sides being ready to completion) in a p2p pair or a group
  that take far longer than the same kind elsewhere, while the compute is normal;
- slow_compute (a worker issue): forward/backward compute slower than the peers at the same
  position (same pp/cp/tp in other replicas) by a uniform factor;
- data_imbalance: the extra compute is uneven across micro-batches, follows the attention work
  (sum of len^2 over documents) where it is known, or the slowest member moves from step to step;
- cpu_bound: time neither computing nor communicating (launch gaps) well above the peers';
- stage_imbalance: a pipeline stage does more compute than the others, in every replica.
All thresholds live in ``Tunables``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl

from tracekit.analysis import work as attention
from tracekit.analysis.links import link_transfers, slowest_link
from tracekit.analysis.localize import Localization
from tracekit.analysis.tables import RunTables, compute_events, per_tables
from tracekit.analysis.tunables import Tunables

CATEGORY = {"slow_compute": "worker", "cpu_bound": "worker", "late_no_trace": "worker", "slow_link": "link",
            "data_imbalance": "data",
            "stage_imbalance": "pipeline", "hang": "hang", "unexplained": "unknown", "none": "none", "insufficient_data": "none"}


@dataclass(frozen=True)
class Cause:
    # slow_compute | cpu_bound | late_no_trace | slow_link | data_imbalance | stage_imbalance | unexplained |
    # none | insufficient_data
    kind: str
    ranks: tuple[int, ...]  # the rank(s) or link end points the cause is about
    summary: str
    evidence: dict[str, float | int | str | None] = field(default_factory=dict)

    @property
    def category(self) -> str:  # worker | link | data | pipeline | unknown | none
        return CATEGORY[self.kind]

    def to_dict(self) -> dict:
        evidence = {k: None if isinstance(v, float) and v != v else v for k, v in self.evidence.items()}  # NaN -> null
        return {**asdict(self), "evidence": evidence, "category": self.category}


@per_tables
def rank_step_metrics(tables: RunTables) -> pl.DataFrame:
    """Per (rank, step): compute_ns, busy_ns (union of compute and communication), step_ns, gap_ns.

    compute_ns excludes communication nested in a compute span (the trainer's fwd/bwd spans hold
    their TP and CP collectives): a peer waiting inside such a span is not computing."""
    comp = compute_events(tables.events)
    # CPU-op compute (a job we did not annotate) carries its own nested communication; the other
    # rows' is the rank's collectives and p2p inside them
    own = comp.filter(pl.col("nested_comm_ns").is_not_null())
    compute = comp.group_by("rank", "step").agg(
        (pl.col("dur_ns") - pl.col("nested_comm_ns").fill_null(0)).sum().alias("compute_ns"))
    nested = _nested_comm(comp.filter(pl.col("nested_comm_ns").is_null()), pl.concat([
        tables.collectives.select("rank", pl.col("start_ns").alias("s"), pl.col("end_ns").alias("e")),
        tables.p2p.select("rank", pl.col("start_ns").alias("s"), pl.col("end_ns").alias("e"))])) \
        if comp.height > own.height else pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "nested_ns": pl.Int64})
    compute = compute.with_columns(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64)).join(
        nested, on=["rank", "step"], how="left").with_columns(
        (pl.col("compute_ns") - pl.col("nested_ns").fill_null(0)).clip(lower_bound=0)).drop("nested_ns")
    spans = pl.concat([
        comp.select("rank", "step", pl.col("ts_ns").alias("s"), (pl.col("ts_ns") + pl.col("dur_ns")).alias("e")),
        tables.collectives.select("rank", "step", pl.col("start_ns").alias("s"), pl.col("end_ns").alias("e")),
        tables.p2p.select("rank", "step", pl.col("start_ns").alias("s"), pl.col("end_ns").alias("e")),
    ], how="vertical_relaxed").with_columns(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64))
    spans = spans.sort("rank", "step", "s").with_columns(
        pl.col("e").cum_max().shift(1).over("rank", "step").alias("prev"))
    busy = spans.with_columns(
        (pl.col("e") - pl.max_horizontal("s", pl.col("prev").fill_null(pl.col("s")))).clip(lower_bound=0).alias("c")
    ).group_by("rank", "step").agg(pl.col("c").sum().alias("busy_ns"))
    if tables.steps.height:
        steps = tables.steps.select(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64),
                                    (pl.col("end_ns") - pl.col("start_ns")).alias("step_ns"))
    else:  # no step spans recorded: a step lasts from its rank's first to last recorded activity
        steps = spans.group_by("rank", "step").agg((pl.col("e").max() - pl.col("s").min()).alias("step_ns"))
    out = steps.join(busy, on=["rank", "step"], how="left").join(
        compute.with_columns(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64)),
        on=["rank", "step"], how="left")
    return out.with_columns(pl.col("compute_ns").fill_null(0), pl.col("busy_ns").fill_null(0)).with_columns(
        (pl.col("step_ns") - pl.col("busy_ns")).clip(lower_bound=0).alias("gap_ns"))


def _nested_comm(comp: pl.DataFrame, comm: pl.DataFrame) -> pl.DataFrame:
    """(rank, step, nested_ns): communication time inside each rank's compute spans."""
    spans = comp.select(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64),
                        pl.col("ts_ns").cast(pl.Int64).alias("s0"),
                        (pl.col("ts_ns") + pl.col("dur_ns")).cast(pl.Int64).alias("e0")).sort("s0")
    ops = comm.select(pl.col("rank").cast(pl.Int32), pl.col("s").cast(pl.Int64), pl.col("e").cast(pl.Int64)).drop_nulls()
    if not spans.height or not ops.height:
        return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "nested_ns": pl.Int64})
    hit = ops.sort("rank", "s").join_asof(spans.sort("rank", "s0"), left_on="s", right_on="s0", by="rank",
                                          strategy="backward", check_sortedness=False)
    # only ops wholly inside a span are nested (async sends overlapping the next span are not)
    hit = hit.filter(pl.col("e0").is_not_null() & (pl.col("s") > pl.col("s0")) & (pl.col("e") < pl.col("e0")))
    return hit.group_by("rank", "step").agg((pl.col("e") - pl.col("s")).sum().cast(pl.Int64).alias("nested_ns"))


def peers(tables: RunTables, rank: int) -> list[int]:
    """Ranks at the same position: same pp/cp/tp in other replicas (or, with dp = 1, the other
    TP/CP ranks of the same stage)."""
    lay = tables.layout
    dims = "dp" if lay.dp > 1 else ("cp", "tp")
    return [r for r in lay.group(rank, dims) if r != rank]


def ratio_to_peers(metrics: pl.DataFrame, rank: int, peers: list[int], col: str, steps=None) -> float:
    m = metrics if steps is None else metrics.filter(pl.col("step").is_in(steps))
    own = m.filter(pl.col("rank") == rank).select("step", pl.col(col).alias("own"))
    ref = m.filter(pl.col("rank").is_in(peers)).group_by("step").agg(pl.col(col).median().alias("ref"))
    j = own.join(ref, on="step").filter(pl.col("ref") > 0)
    return float((j["own"] / j["ref"]).median()) if j.height else float("nan")


def _microbatch_cv(tables: RunTables, rank: int, peers: list[int], steps=None) -> tuple[float, float]:
    """How uneven the rank's micro-batches are: the coefficient of variation of its per-micro-batch
    compute within a step and phase (median over those), and the same for its peers. A slow device
    slows every micro-batch alike; more work (longer documents) lands on some micro-batches only."""
    comp = compute_events(tables.events).filter(pl.col("microbatch").is_not_null())
    if steps is not None:
        comp = comp.filter(pl.col("step").is_in(steps))
    per = (comp.filter(pl.col("rank").is_in([rank, *peers]))
           .group_by("rank", "step", "phase", "microbatch").agg(pl.col("dur_ns").sum()))
    cv = (per.group_by("rank", "step", "phase").agg((pl.col("dur_ns").std() / pl.col("dur_ns").mean()).alias("cv"))
          .drop_nulls("cv").group_by("rank").agg(pl.col("cv").median()))
    own = cv.filter(pl.col("rank") == rank)["cv"]
    noise = cv.filter(pl.col("rank") != rank)["cv"].median()
    return (float(own[0]) if own.len() else float("nan")), (float(noise) if noise is not None else float("nan"))


def stage_ratios(metrics: pl.DataFrame, tables: RunTables, bar: float) -> list[tuple[int, float, float, float]]:
    """Per stage: (stage, median over steps of its compute over the median stage's, its extra
    compute per step in ns, share of steps in which the ratio reached ``bar``). A stage's compute is
    its *least* loaded rank's: more work on a stage slows all its ranks, one slow rank only itself."""
    co = tables.coords().select("rank", "pp")
    per = metrics.join(co, on="rank").group_by("step", "pp").agg(pl.col("compute_ns").min())
    per = per.join(per.group_by("step").agg(pl.col("compute_ns").median().alias("mid")), on="step").filter(
        pl.col("mid") > 0).with_columns((pl.col("compute_ns") / pl.col("mid")).alias("ratio"))
    out = per.group_by("pp").agg(pl.col("ratio").median(), (pl.col("compute_ns") - pl.col("mid")).median().alias("x"),
                                 (pl.col("ratio") >= bar).mean().alias("share")).sort("pp")
    return [(int(a), float(b), float(c), float(d)) for a, b, c, d in out.iter_rows()]


def _stage_ratio(metrics: pl.DataFrame, tables: RunTables, stage: int) -> float:
    """A stage's median compute over the median stage's (per step, median over its ranks)."""
    co = tables.coords().select("rank", "pp")
    per = metrics.join(co, on="rank").group_by("step", "pp").agg(pl.col("compute_ns").median())
    med = per.group_by("step").agg(pl.col("compute_ns").median().alias("mid"))
    own = per.filter(pl.col("pp") == stage).join(med, on="step").filter(pl.col("mid") > 0)
    return float((own["compute_ns"] / own["mid"]).median()) if own.height else float("nan")


def explain(tables: RunTables, loc: Localization, tunables: Tunables = Tunables(),
            work: pl.DataFrame | None = None, compute_ratio: float | None = None) -> Cause:
    """The cause behind a localization. ``work`` (rank, step, work) is optional attention work
    per rank and step (e.g. ``attention_work`` of the documents it processed). ``compute_ratio``:
    the culprit's compute over its peers' as ``culprits`` measured it (kernel by kernel, the same
    kernels of its peers); without it, per-step compute totals are compared."""
    tun = tunables
    metrics = rank_step_metrics(tables)
    step_ns = loc.step_time_ns or 1.0
    links = link_transfers(tables, step_ns, tun)
    if loc.verdict in ("straggler", "transient"):
        return _explain_rank(tables, loc, metrics, links, tun, step_ns, work, compute_ratio)
    if loc.verdict == "stage":
        stage = loc.coords["pp"]
        ratio = _stage_ratio(metrics, tables, stage)
        ev = {"stage": stage, "stage_compute_ratio": ratio}
        if ratio >= tun.stage_compute_ratio:
            return Cause("stage_imbalance", loc.culprit_ranks,
                         f"pipeline stage {stage} computes {ratio:.2f}x the median stage in every replica", ev)
        link = slowest_link(links, set(loc.culprit_ranks))
        if link:
            return Cause("slow_link", tuple(link["ranks"]), f"slow link {link['name']} ({link['ratio']:.1f}x)", ev)
        return Cause("unexplained", loc.culprit_ranks, f"stage {stage} holds the pipeline back; compute is normal", ev)
    if loc.verdict == "group":
        link = slowest_link(links, set(loc.culprit_ranks), both=True)
        if link:
            return Cause("slow_link", tuple(link["ranks"]),
                         f"slow link {link['name']}: transfers {link['ratio']:.1f}x the same kind elsewhere",
                         {"link": link["name"], "transfer_ns": link["transfer_ns"], "ratio": link["ratio"]})
        share = attention.group_share(work, metrics, tables, set(loc.culprit_ranks), tun) if work is not None else None
        if share is not None and share >= tun.work_explains_share:
            return Cause("data_imbalance", loc.culprit_ranks, f"ranks {list(loc.culprit_ranks)} compute more than the "
                         f"rest of their stage, and their attention work accounts for {min(share, 1.0):.0%} of it "
                         "(compute follows work over the stage's ranks and steps): more work, not slower devices",
                         {"work_explained_share": share})
        ratios = {r: ratio_to_peers(metrics, r, peers(tables, r), "compute_ns") for r in loc.culprit_ranks}
        ratios = {r: v for r, v in ratios.items() if v == v}  # drop NaN (no peers)
        worst = max(ratios, key=lambda r: ratios[r]) if ratios else None
        if worst is not None and ratios[worst] >= tun.slow_compute_ratio:
            return Cause("slow_compute", (worst,), f"rank {worst} computes {ratios[worst]:.2f}x its peers",
                         {"compute_ratio": ratios[worst]})
        return Cause("unexplained", loc.culprit_ranks,
                     "these ranks are late together; no link or compute explains it", {})
    if loc.verdict == "moving":
        cause = _explain_moving(tables, loc, metrics, tun, work)
        link = slowest_link(links)
        if cause.kind == "unexplained" and link:
            # late members that change without computing more, and a link that transfers slowly
            return Cause("slow_link", tuple(link["ranks"]), f"the slowest member moves without computing more, and "
                         f"link {link['name']} is slow ({link['ratio']:.1f}x the same kind)",
                         {**cause.evidence, "link": link["name"], "ratio": link["ratio"]})
        return cause
    if loc.verdict == "no_data":
        return Cause("insufficient_data", (), "no collectives across ranks and no p2p records: nothing to compare", {})
    link = slowest_link(links)
    if link:
        return Cause("slow_link", tuple(link["ranks"]), f"no rank is late, but link {link['name']} is slow "
                     f"({link['ratio']:.1f}x the same kind)", {"link": link["name"], "ratio": link["ratio"]})
    return Cause("none", (), "no straggler: no rank, stage or link stands out beyond noise", {})


def _explain_rank(tables, loc, metrics, links, tun: Tunables, step_ns: float, work,
                  span_ratio: float | None = None) -> Cause:
    r = loc.culprit_rank
    steps = None
    if loc.verdict == "transient":
        steps = list(loc.episode_steps)
    same = peers(tables, r)
    if not same:  # one rank per position (e.g. dp 1 x pp 2): nothing to compare its compute or gaps with
        link = slowest_link(links, {r})
        if link:  # but its link's transfers can be (a pipeline's other stage pairs)
            return Cause("slow_link", tuple(link["ranks"]), f"rank {r} waits on its link {link['name']}, which "
                         f"transfers {link['ratio']:.1f}x slower than the same kind elsewhere",
                         {"peers": 0, "worst_link": link["name"], "worst_link_ratio": link["ratio"]})
        return Cause("unexplained", (r,), f"rank {r} has no peer doing the same work (it alone holds its "
                     "position), so whether it is slow or its stage is heavy cannot be told", {"peers": 0})
    step_ratio = ratio_to_peers(metrics, r, same, "compute_ns", steps)
    # kernel by kernel where it was measured so: a per-step total holds any kernel descheduled
    # 5-30x (the rank's or a peer's); on the fault grid's draws a 1.03x rank read 1.53x that way, a
    # 1.5x rank 1.16x, in the text beside a finding and cost that said 1.03x and 1.59x
    compute_ratio = span_ratio if span_ratio is not None else step_ratio
    m = metrics if steps is None else metrics.filter(pl.col("step").is_in(steps))
    own_gap = m.filter(pl.col("rank") == r)["gap_ns"].median() or 0.0
    peer_gap = m.filter(pl.col("rank").is_in(same))["gap_ns"].median() or 0.0
    gap_excess = (own_gap - peer_gap) / step_ns
    cv, cv_peers = _microbatch_cv(tables, r, same, steps)
    stage = tables.layout.coords(r).pp
    stage_ratio = _stage_ratio(metrics, tables, stage)
    link = slowest_link(links, {r})
    ev = {"compute_ratio": compute_ratio, "step_compute_ratio": step_ratio, "microbatch_cv": cv,
          "peers_microbatch_cv": cv_peers,
          "gap_excess_frac": gap_excess,
          "stage_compute_ratio": stage_ratio, "peers": len(same),
          "worst_link": link["name"] if link else None, "worst_link_ratio": link["ratio"] if link else None}
    work_ratio = attention.work_ratio(work, r, same, steps) if work is not None else None
    explained = None
    ev["work_ratio"] = work_ratio
    stage_peers = [q for q in tables.layout.group(r, ("dp", "cp", "tp")) if q != r]
    if work is not None:
        stage_compute_ratio = ratio_to_peers(metrics, r, stage_peers, "compute_ns", steps)
        explained = attention.explained_share(work, m, r, stage_peers, tun)
        ev.update(stage_peers_compute_ratio=stage_compute_ratio, work_explained_share=explained)
        if (max(compute_ratio, stage_compute_ratio) >= tun.slow_compute_ratio and explained is not None
                and explained >= tun.work_explains_share):
            return Cause("data_imbalance", (r,), f"rank {r} computes {stage_compute_ratio:.2f}x the other ranks of its "
                         f"stage, and its attention work accounts for {min(explained, 1.0):.0%} of that "
                         f"(compute follows work over the stage's ranks and steps): more work, not a slower device", ev)
    slow = compute_ratio >= tun.slow_compute_ratio
    if link and not slow:
        return Cause("slow_link", tuple(link["ranks"]), f"rank {r} arrives on time but its link {link['name']} "
                     f"transfers {link['ratio']:.1f}x slower than the same kind elsewhere", ev)
    if slow:
        if (explained is None and work_ratio is not None
                and work_ratio - 1 >= tun.work_explains_share * (compute_ratio - 1)):
            return Cause("data_imbalance", (r,), f"rank {r} had {work_ratio:.2f}x the attention work of its peers "
                         f"(compute {compute_ratio:.2f}x)", ev)
        if cv == cv and cv - (cv_peers if cv_peers == cv_peers else 0.0) >= tun.data_cv_min:
            return Cause("data_imbalance", (r,), f"rank {r} computes {compute_ratio:.2f}x its peers, unevenly "
                         f"across micro-batches (cv {cv:.2f}): more work, not a slower device", ev)
        return Cause("slow_compute", (r,), f"rank {r} computes {compute_ratio:.2f}x its {len(same)} "
                     f"{'peer' if len(same) == 1 else 'peers'} at the same position, uniformly: a slow worker", ev)
    if gap_excess >= tun.cpu_gap_frac:
        return Cause("cpu_bound", (r,), f"rank {r} idles {gap_excess:.1%} of the step between ops more than its "
                     "peers (CPU launch gaps)", ev)
    if stage_ratio >= tun.stage_compute_ratio:
        return Cause("stage_imbalance", (r,),
                     f"rank {r}'s stage {stage} computes {stage_ratio:.2f}x the median stage", ev)
    return Cause("unexplained", (r,), f"rank {r} is late but its compute, gaps and links look normal", ev)


def _explain_moving(tables, loc, metrics, tun: Tunables, work) -> Cause:
    """The slowest member changes from step to step: is the late member the one with more work?"""
    level = next(lv.level for lv in loc.levels if lv.verdict == "moving")
    co = tables.coords()
    pos = [d for d in ("dp", "pp", "cp", "tp") if d != level]
    m = metrics.join(co, on="rank").with_columns(
        (pl.col("compute_ns") / pl.col("compute_ns").mean().over("step", *pos)).alias("rel"))
    degree = float(m.group_by("step", *pos).agg(pl.col("rel").max())["rel"].median())
    hits = loc.per_step.filter(pl.col(level).is_not_null())
    explained = 0
    for step, member in hits.select("step", level).iter_rows():
        rel = m.filter((pl.col("step") == step) & (pl.col(level) == member))["rel"].mean()
        explained += int(rel is not None and rel >= tun.slow_compute_ratio)
    distinct = hits[level].n_unique() if hits.height else 0
    ev = {"level": level, "imbalance_degree": degree, "steps_with_standout": hits.height,
          "explained_by_compute": explained, "distinct_slowest": distinct}
    if work is not None:
        j = attention.per_cell(work).join(metrics, on=["rank", "step"])
        ev["work_compute_corr"] = float(np.corrcoef(j["work"], j["compute_ns"])[0, 1]) if j.height > 2 else None
    what = {"dp": "replica", "pp": "stage", "cp": "CP rank", "tp": "TP rank"}[level]
    by_work = attention.moving_share(work, m, hits, level, tun) if work is not None else None
    ev["work_explained_share"] = by_work
    device = level in ("tp", "pp") or (by_work is not None and by_work < tun.work_explains_share)
    if device and hits.height and explained / hits.height >= tun.moving_explained_min:
        # TP ranks share their tokens and stages share their micro-batches: no data can make one
        # of them do more work, so a late member with more compute is a slow device, moving.
        ranks = tuple(sorted({int(r) for r in loc.per_step["culprit_rank"].drop_nulls().to_list()}))
        same = "with the same work as its peers" if level in ("tp", "pp") else "more than its work explains"
        return Cause("slow_compute", ranks, f"the slowest {what} changes from step to step ({distinct} different) "
                     f"and computes longer in {explained}/{hits.height} steps, {same}: "
                     f"a slow device that moves (ranks {', '.join(map(str, ranks)) or '?'})", ev)
    if hits.height and explained / hits.height >= tun.moving_explained_min:
        return Cause("data_imbalance", (), f"the slowest {what} changes from step to step ({distinct} different) "
                     f"and is the one with more compute in {explained}/{hits.height} steps; "
                     f"imbalance degree (max/mean compute) {degree:.2f}: data imbalance, no single culprit", ev)
    return Cause("unexplained", (), f"the slowest {what} moves from step to step ({distinct} different) "
                 "without more compute", ev)
