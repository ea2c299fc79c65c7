"""Which ranks or links made the run slow, what each costs, and what to do: ``tracekit stragglers``.

One place decides the verdict, from four kinds of evidence, in this order:
1. a hang (flight-recorder entries show a collective some members never joined, or the traces end
   inside collectives that are incomplete): no performance verdict at all, ``hangs`` tells the rest;
2. ranks slow on their own (``culprits``: each rank's compute against the ranks doing the same
   work, on its own clock): every persistent, transient or moving slow rank is a finding;
3. links (``links``: transfer times once every side is ready, measured within one rank's clock) and
   stage imbalance (a stage computing more than the others in every replica);
4. the top-down wait analysis (``localize``: who waited on whom, DP -> PP -> CP -> TP), which
   orders the explanation and is the evidence where no compute was recorded; where compute was
   recorded and shows nothing, a late rank without slower compute is kept only when its cause is
   found (CPU launch gaps or a slow link): waits alone carry every kind of timing noise.
Each finding carries its cost (ms per step and share of the step, over which steps), where it shows
(coordinates, group or pair named by members) and a next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import polars as pl

from tracekit.analysis.compute_speed import attention_split, compute_speed, steady_compute
from tracekit.analysis.culprits import ComputeCulprits, RankFinding, find_culprits, measured_again
from tracekit.analysis.data_heavy import data_heavy, heavy_findings, merge_data_imbalance, more_attention_work
from tracekit.analysis.data_needs import missing_data
from tracekit.analysis.findings import NEXT_STEP, Finding, where
from tracekit.analysis.hangs import HangReport, rank_list
from tracekit.analysis.hosts import slow_host_ranks, slow_hosts
from tracekit.analysis.link_findings import link_findings, links_beside_stragglers, minor_links
from tracekit.analysis.links import P2PCoverage, link_transfers, lone_groups, one_pipeline, p2p_coverage
from tracekit.analysis.localize import Localization, localize
from tracekit.analysis.scope import Scope
from tracekit.analysis.rootcause import Cause, explain, rank_step_metrics
from tracekit.analysis.stage_findings import stage_findings, stages_alone
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables
from tracekit.analysis.unprofiled import RecorderJudgement, recorder_findings
from tracekit.analysis.wait_cost import rank_cost

@dataclass(frozen=True)
class Diagnosis:
    """Localization, cause and every finding: what `tracekit stragglers` renders."""

    localization: Localization
    cause: Cause
    findings: list[Finding] = field(default_factory=list)
    compute: ComputeCulprits | None = None
    damaged: dict[int, str] = field(default_factory=dict)  # ranks without data: named, never blamed on waits
    scope: Scope | None = None  # a large job's: the ranks read, and why (scope.py)
    recorder: RecorderJudgement | None = None  # ranks without a trace, judged by their flight recorder

    @property
    def headline(self) -> str:
        text = self._verdict()
        judged = set(self.recorder.judged) if self.recorder is not None else set()
        for title, ranks in (("judged on their flight-recorder durations alone", judged),
                             ("not judged (no data)", set(self.damaged) - judged)):
            if ranks:
                text += f"; {title}: " + ", ".join(f"rank {r}: {self.damaged.get(r, 'no data')}" for r in sorted(ranks))
        return text

    def _verdict(self) -> str:
        loc = self.localization
        if loc.verdict == "hang":
            return f"no performance verdict: the run hung ({self.cause.summary}); see `tracekit hangs`"
        if not self.findings:
            if loc.verdict == "no_data":
                return f"not enough cross-rank records to localize: {self.cause.summary}"
            return f"no straggler (confidence {loc.confidence:.2f}): {self.cause.summary}"
        parts = [f"{f.summary}; costs {f.cost_text()}"
                 f"{_steps_text(f)} (cause {f.cause}, confidence {f.confidence:.2f})" for f in self.findings]
        lead = f"{len(self.findings)} findings: " if len(self.findings) > 1 else ""
        return lead + " | ".join(parts)

    def to_dict(self) -> dict:
        return {"headline": self.headline, "localization": self.localization.to_dict(), "cause": self.cause.to_dict(),
                "findings": [f.to_dict() for f in self.findings],
                "damaged": {str(r): why for r, why in self.damaged.items()},
                "compute_culprits": self.compute.to_dict() if self.compute else None,
                "scope": self.scope.to_dict() if self.scope else None,
                "recorder": None if self.recorder is None else {
                    "judged": list(self.recorder.judged), "unjudged": list(self.recorder.unjudged),
                    "late": [x.rank for x in self.recorder.late]}}


def _steps_text(f: Finding) -> str:
    return f" in steps {', '.join(map(str, f.steps))}" if f.kind in ("transient", "moving") and f.steps else ""


def _hung(hang: HangReport | None, tables: RunTables, damaged: dict[int, str], scope: Scope | None = None
          ) -> str | None:
    """Why the run has no performance verdict (it hung), or None. In a scope, a group's expected
    members are those in it (the others' records were not read)."""
    if hang is not None and hang.hung:
        return hang.headline
    c = tables.collectives
    if not c.height or "pg_name" not in c.columns:
        return None
    # the traces end inside collectives some members never recorded (a hang before the dump)
    last = c.drop_nulls("pg_name").group_by("pg_name", "seq").agg(pl.col("rank").n_unique().alias("n"))
    # a group's expected members are those with data: a rank whose trace failed is not a hang
    gone = list(damaged)
    members = pl.col("ranks") if scope is None else pl.col("ranks").list.set_intersection(
        pl.lit(list(scope.ranks), pl.List(pl.Int32)))
    sizes = tables.groups.select("pg_name", (members.list.len() - members.list.set_intersection(
        pl.lit(gone, pl.List(pl.Int32))).list.len()).alias("size")).unique("pg_name")
    top = last.join(last.group_by("pg_name").agg(pl.col("seq").max().alias("top")), on="pg_name")
    top = top.filter(pl.col("seq") == pl.col("top")).join(sizes, on="pg_name")
    short = top.filter(pl.col("n") < pl.col("size"))
    full_before = last.join(sizes, on="pg_name").filter(pl.col("n") == pl.col("size"))
    if short.height and full_before.height and short.height * 2 >= top.filter(pl.col("size") > 1).height:
        return (f"{short.height} groups' last collectives are missing members; the traces end in a hang or were "
                "cut short")
    return None


def _rank_finding(tables: RunTables, f: RankFinding, loc: Localization, tun: Tunables, work,
                  step_ns: float, device_only: bool = False, others: Sequence[RankFinding] = ()) -> Finding:
    kind = {"persistent": "straggler", "transient": "transient", "moving": "moving"}[f.kind]
    one = replace(loc, verdict="transient" if f.kind != "persistent" else "straggler", culprit_rank=f.rank,
                  culprit_ranks=(f.rank,), coords=tables.layout.coords(f.rank).as_dict(),
                  episode_steps=f.steps if f.kind != "persistent" else ())
    cause = explain(tables, one, tun, work, f.ratio)
    split = attention_split(tables, f.rank)  # every step: the work a rank gets differs in all of them
    if split is not None and cause.kind != "data_imbalance":
        attn, other = split
        if more_attention_work(attn, other, tun):
            cause = Cause("data_imbalance", (f.rank,), f"rank {f.rank}'s extra compute is in its attention kernels "
                          f"({attn:.2f}x its peers; other kernels {other:.2f}x): more attention work "
                          "(document-mask imbalance), not a slower device", {"attention_ratio": attn,
                                                                              "other_ratio": other})
    if device_only and cause.kind == "data_imbalance":
        # found on the kernels whose cost does not follow the data: a slow device, whatever its
        # attention work (on a heavy CP position, its micro-batches' spread and attention say data)
        cause = Cause("slow_compute", (f.rank,), f"rank {f.rank} computes {f.ratio:.2f}x its peers in the kernels "
                      "whose cost does not follow the data (attention left out): a slow worker",
                      {"compute_ratio": f.ratio, "data_cause_also": cause.summary})
    if cause.kind in ("none", "unexplained", "insufficient_data", "stage_imbalance", "slow_link"):
        cause = Cause("slow_compute", (f.rank,), f"rank {f.rank} computes {f.ratio:.2f}x its peers",
                      {"compute_ratio": f.ratio})
    what = {"straggler": "is a straggler", "transient": "is a transient straggler",
            "moving": "is slow in some steps (the slowness moves)"}[kind]
    summary = f"{where(tables, (f.rank,))} {what}: {cause.summary}" + (f"; in doubt: {f.doubt}" if f.doubt else "")
    cost, how, bound = rank_cost(tables, f.rank, list(f.steps) if kind != "straggler" else None, f.cost_ns,
                                 [(o.rank, None if o.kind == "persistent" else o.steps) for o in others if o.rank != f.rank])
    return Finding(kind, (f.rank,), where(tables, (f.rank,)), f.steps, cost, cost / step_ns, f.confidence, cause.kind,
                   summary, NEXT_STEP.get(cause.kind, NEXT_STEP["unexplained"]).format(who=f"rank {f.rank}"),
                   {"compute_ratio": f.ratio, **cause.evidence, "span_ratio": f.ratio, "margin": f.margin,
                    "extra_compute_ns": max(f.cost_ns, 0.0), "cost_from": how}, cost_upper_bound=bound)


def diagnose(tables: RunTables, tunables: Tunables = Tunables(), work: pl.DataFrame | None = None,
             hang: HangReport | None = None, damaged: dict[int, str] | None = None,
             scope: Scope | None = None, recorder: RecorderJudgement | None = None) -> Diagnosis:
    """Which ranks or links made this job slow, why, and what each costs. ``damaged``: ranks whose
    data failed to ingest or is missing (``Store.damaged_ranks``): named, never blamed on their
    peers' waits. ``scope``: ``tables`` hold only these ranks of a large job (scope.py), picked from
    all of its ranks. ``recorder``: what the flight recorder says of the ranks without a profiler
    trace (``unprofiled.recorder_lateness``): a late one is a finding."""
    tun = tunables
    damaged = dict(damaged or {})
    loc = localize(tables, tun)
    step_ns = loc.step_time_ns or 1.0
    why_hung = _hung(hang, tables, damaged, scope)
    if why_hung:
        culprits = tuple(hang.culprits) if hang is not None and hang.hung else ()
        quiet = replace(loc, verdict="hang", culprit_rank=None, culprit_ranks=culprits, coords={}, confidence=0.0)
        cause = Cause("hang", culprits, why_hung, {})
        return Diagnosis(quiet, cause, [], damaged=damaged, scope=scope)
    compared = scope.world_size if scope else None
    # where ranks get unequal attention work, device speed is measured on the other kernels
    heavy = data_heavy(tables, tun, compared)
    speed = compute_speed(tables, device_only=bool(heavy))
    compute = find_culprits(speed, tun, compared)
    # a host slow as a whole can be half of every stage, where no rank stands out from its peers
    hosts = slow_host_ranks(speed, tables, tun) if scope is None else {}
    if hosts:
        whole = frozenset().union(*(ranks for ranks, _ in hosts.values()))
        compute = find_culprits(compute_speed(tables, whole, device_only=bool(heavy)), tun, compared, known=whole)
    slow = frozenset(f.rank for f in compute.findings if f.kind == "persistent")
    if slow:  # their ratios and costs measured with them out of every other rank's reference
        compute = measured_again(compute, compute_speed(tables, slow, device_only=bool(heavy)))
    metrics = rank_step_metrics(tables)
    findings: list[Finding] = [_rank_finding(tables, f, loc, tun, work, step_ns, bool(heavy), compute.findings)
                               for f in compute.findings]
    findings += heavy_findings(tables, heavy, step_ns)
    steady = steady_compute(tables)  # descheduled spans are not a stage's work
    findings += stage_findings(tables, steady if steady.height else metrics, tun, step_ns)
    links = link_transfers(tables, step_ns, tun)
    findings += link_findings(tables, links, step_ns, metrics)
    findings = _data_or_device(tables, loc, findings, tun, work, metrics, step_ns)
    # a scope holds partial groups: there, waits alone name no one (compute and links do)
    if not compute.has_data and loc.verdict in ("straggler", "group", "transient", "stage", "moving"):
        cause = explain(tables, loc, tun, work)
        waits = _waits_finding(tables, loc, cause, step_ns)
        # a lateness no level measured beyond its noise costs nothing: not a finding (a moving top
        # stage at 0.48 noise units cost '0.0 ms per step' on a clean torch-native dp 1 x pp 2 job)
        # a link already found is the finding: the ranks waiting on it are not one more
        known = cause.kind == "slow_link" and any(f.kind == "slow_link" and set(f.ranks) == set(cause.ranks)
                                                  for f in findings)
        if (cause.kind not in ("none", "unexplained") or loc.confidence >= 0.5) and \
                waits.cost_share >= tun.effect_min_frac and not known:
            findings.append(waits)
    elif scope is None and compute.has_data and not findings and loc.verdict in ("straggler", "group", "transient"):
        cause = explain(tables, loc, tun, work)
        if cause.kind == "cpu_bound":  # late without computing more: launch gaps on its host
            findings.append(_waits_finding(tables, loc, cause, step_ns))
    findings = links_beside_stragglers(merge_data_imbalance(findings, tables))
    # a rank without data is never blamed (its peers' waits on it say nothing of its speed)
    findings = [f for f in findings if not set(f.ranks) & set(damaged) or f.kind == "slow_link"
                and not set(f.ranks) <= set(damaged)]
    findings = slow_hosts(findings, tables, step_ns, hosts)
    if recorder is not None:
        findings = recorder_findings(tables, recorder, findings, set(damaged), step_ns)
    minor = minor_links(tables, links, step_ns, tun)
    cause = _primary_cause(findings, loc, tables, compute, minor, tun, scope, recorder)
    return Diagnosis(_primary(loc, findings, tables, compute, bool(minor), scope, recorder), cause, findings, compute,
                     damaged, scope, recorder)


def _data_or_device(tables: RunTables, loc: Localization, findings: list[Finding], tun: Tunables, work,
                    metrics: pl.DataFrame, step_ns: float) -> list[Finding]:
    """When the waits see the slowest member move from step to step (``localize``'s moving verdict),
    its cause (``rootcause``: does the late member compute more, at a level whose members see
    different data?) tells data imbalance from a slow device that moves. Data imbalance is one
    finding, of the data rather than of ranks; it replaces the moving ranks' findings."""
    moving = [f for f in findings if f.kind == "moving"]
    others = [f for f in findings if f.kind != "moving"]
    # compute must see the slowness move too: on waits alone, noise and preemption move the slowest
    # member of a clean run from step to step as well (measured on the fault grid's clean runs)
    if loc.verdict != "moving" or len({f.ranks for f in moving}) < 2 or any(f.kind == "straggler" for f in others):
        return findings
    # each moving rank's own kernels already say more attention work: the ranks are the answer
    # (merge_data_imbalance names them), not 'every replica in turn' (a CP rank heavier in every
    # replica made the replicas' waits move: 2 of 12 CP imbalances of a grid draw with 2-layer stages)
    if all(f.cause == "data_imbalance" for f in moving):
        return findings
    # where kernels are named, the kind of extra compute decides: more data lands in the attention
    # kernels (their cost follows the documents), a slow device slows every kernel alike
    splits = [attention_split(tables, f.ranks[0], list(f.steps)) for f in moving]
    known = [sp for sp in splits if sp is not None]
    if known:
        in_attention = sum(1 for attn, other in known
                           if attn >= tun.attention_imbalance_ratio and other - 1 <= 0.5 * (attn - 1))
        if in_attention * 2 <= len(known):
            return findings
    cause = explain(tables, loc, tun, work)
    if cause.kind != "data_imbalance":
        return findings
    lay = tables.layout
    level = str(cause.evidence.get("level", "dp"))
    pos = [d for d in ("dp", "pp", "cp", "tp") if d != level]
    # what balancing would save: per step, the most loaded member's compute over the mean of its peers
    per = metrics.join(tables.coords().select("rank", *pos, level), on="rank").group_by("step", *pos).agg(
        (pl.col("compute_ns").max() - pl.col("compute_ns").mean()).alias("x"))
    cost = float(per.group_by("step").agg(pl.col("x").max())["x"].median() or 0.0) if per.height else 0.0
    what = {"dp": "replica", "pp": "stage", "cp": "CP rank", "tp": "TP rank"}.get(level, level)
    steps = tuple(sorted({s for f in moving for s in f.steps}))
    conf = max(f.confidence for f in moving)
    return [Finding("data_imbalance", (), f"every {what} in turn ({level.upper()} groups of {getattr(lay, level)})",
                    steps, cost, cost / step_ns, conf, "data_imbalance", cause.summary,
                    NEXT_STEP["data_imbalance"], dict(cause.evidence))] + others


def _waits_finding(tables: RunTables, loc: Localization, cause: Cause, step_ns: float) -> Finding:
    ranks = loc.culprit_ranks or ((loc.culprit_rank,) if loc.culprit_rank is not None else ())
    # what the levels measured beyond their noise (a moving top member's lateness included); a
    # transient's, its lateness in the steps it stood out in (no level names it over all steps)
    named = [lv for lv in loc.levels if lv.verdict == "culprit" or lv.verdict == "moving" and lv.margin >= 1.0]
    cost = max((lv.effect_ns for lv in named), default=0.0)
    if loc.verdict == "transient" and loc.episode_steps and loc.per_step.height:
        late = loc.per_step.filter(pl.col("step").is_in(list(loc.episode_steps))
                                   & (pl.col("culprit_rank") == loc.culprit_rank))["effect_ns"].drop_nulls()
        cost = max(cost, float(late.mean()) if late.len() else 0.0)
    kind = {"straggler": "straggler", "transient": "transient", "moving": "moving"}.get(loc.verdict, cause.kind)
    place = where(tables, tuple(ranks)) if ranks else "the job"
    # a rank without peers is late against the other stages only, whose load differs by design
    alone = cause.evidence.get("peers") == 0
    return Finding(kind, tuple(ranks), place, tuple(loc.episode_steps), cost, cost / step_ns,
                   min(loc.confidence, 0.5 if alone else 0.9), cause.kind, f"{place}: {cause.summary}",
                   NEXT_STEP.get(cause.kind, NEXT_STEP["unexplained"]).format(who=place), dict(cause.evidence))


def _no_data_reason(tables: RunTables) -> str:
    """Why nothing could be compared, and what to turn on (``data_needs``), never a bare 'no data'."""
    if (tables.runs["world_size"][0] or 0) == 1:
        return "the run has one rank: there are no peers to compare it with"
    missing = missing_data(tables)
    if not missing:
        return "no collectives across ranks and no p2p records: nothing to compare"
    return "; ".join(m.text() for m in missing)


def _p2p_cover(tables: RunTables, scope: Scope | None) -> P2PCoverage:
    """The p2p the links could be measured on: in a scope, the whole job's as its links level measured
    it (the scope's own ranks hold few pairs of ops) or the scope's ranks' (which take peers from the
    flight recorder where the records name none, as NCCL's do), whichever measured more."""
    own = p2p_coverage(tables)
    if scope is not None and scope.p2p_cover is not None and scope.p2p_cover.share > own.share:
        return scope.p2p_cover
    return own


def _primary(loc: Localization, findings: list[Finding], tables: RunTables,
             compute: ComputeCulprits | None = None, minor_link: bool = False,
             scope: Scope | None = None, recorder: RecorderJudgement | None = None) -> Localization:
    """The Localization the findings amount to (the costliest rank finding leads). ``minor_link``:
    a link stands out beyond noise but costs less than the reporting floor."""
    if not findings:
        verdict = "no_data" if loc.verdict == "no_data" else "no_straggler"
        # compute, measured on each rank's own clock, is the evidence findings come from; the waits'
        # margins (loc.confidence) only where no compute was recorded
        sure = compute.none_confidence() if compute is not None and verdict == "no_straggler" else None
        if sure is None and compute is not None and not compute.has_data and verdict == "no_straggler":
            sure = min(loc.confidence, 0.5)  # the waits alone: a slow rank shows there only as its stage
        if verdict == "no_straggler":
            # a slow pipeline link shows only in the transfers that could be measured: on a grid draw
            # a 10 ms link went unseen at 0.95 where its ranks' recorder ring held 2 of 8 steps
            sure = (loc.confidence if sure is None else sure) * _p2p_cover(tables, scope).share
            if stages_alone(tables):
                # no replica holds a stage twice: every rank of one stage slower (a slow host holding
                # it) shows only against the other stages, whose work differs by design; a 1.1x host
                # holding two of four stages was "no straggler" at 0.87-0.91 (grid, kind host)
                sure = min(sure, 0.5)
            if lone_groups(tables):
                # a slow link in a group that holds every rank slows that group's every transfer
                # alike: nothing in the run is faster to hold it against (1,024 ranks of DP alone, a
                # DP link 20 ms late, 5% of a step: "no straggler" at 0.98)
                sure = min(sure, 0.5)
            if minor_link:
                # then "no straggler" rests on the cost floor alone: over 8 grid draws 4 of 10 such
                # answers were right (5 slow DP links of 0.7% of a step among the wrong ones)
                sure = min(sure, 0.5)
            if recorder is not None:  # the untraced ranks' verdict is only as sure as their recorder's
                sure = min(sure, recorder.none_confidence())
        return replace(loc, verdict=verdict, culprit_rank=None, culprit_ranks=(), coords={},
                       confidence=loc.confidence if sure is None else sure)
    ranked = [f for f in findings if f.kind in ("straggler", "transient", "moving")]
    if ranked:
        kinds = {f.kind for f in ranked}
        lead = max(ranked, key=lambda f: (f.kind == "straggler", f.cost_ns))
        # a moving slowness seen in waits alone names no rank (nothing to lead with)
        if "straggler" not in kinds and "moving" in kinds and (len({f.ranks for f in ranked}) > 1 or not lead.ranks):
            return replace(loc, verdict="moving", culprit_rank=None, culprit_ranks=tuple(sorted(
                {r for f in ranked for r in f.ranks})), coords={}, confidence=lead.confidence)
        r = lead.ranks[0]
        all_ranks = tuple(sorted({x for f in ranked if f.kind == lead.kind for x in f.ranks}))
        return replace(loc, verdict="straggler" if lead.kind == "straggler" else "transient", culprit_rank=r,
                       culprit_ranks=all_ranks, coords=tables.layout.coords(r).as_dict(), confidence=lead.confidence,
                       episode_steps=lead.steps if lead.kind != "straggler" else (),
                       basis="both" if loc.culprit_rank == r else "compute")
    lead = max(findings, key=lambda f: f.cost_ns)
    verdict = {"stage_imbalance": "stage"}.get(lead.kind, "group")
    if lead.kind == "data_imbalance" and not lead.ranks:  # the slowest member moves with the data
        verdict = "moving"
    coords = {"pp": tables.layout.coords(lead.ranks[0]).pp} if verdict == "stage" else {}
    return replace(loc, verdict=verdict, culprit_rank=None, culprit_ranks=lead.ranks, coords=coords,
                   confidence=lead.confidence)


def _primary_cause(findings: list[Finding], loc: Localization, tables: RunTables,
                   compute: ComputeCulprits | None = None, minor: str = "", tun: Tunables = Tunables(),
                   scope: Scope | None = None, recorder: RecorderJudgement | None = None) -> Cause:
    if not findings:
        if loc.verdict == "no_data":
            return Cause("insufficient_data", (), _no_data_reason(tables), {})
        limit = compute.sensitivity_text() if compute is not None else ""
        if compute is not None and not compute.has_data:
            limit = ("no two ranks' compute could be compared (no rank shares its position, or no compute "
                     "spans were recorded): a slow rank shows only in the waits, as its stage")
        evidence = {"detectable_ratio": compute.detectable_ratio,
                    "steps_for_sensitivity": compute.steps_for_sensitivity} if limit else {}
        cover = _p2p_cover(tables, scope)
        unseen = ""
        if cover.share < tun.p2p_coverage_note:
            who = f"ranks {rank_list(cover.ranks)}" if len(cover.ranks) <= 16 else rank_list(cover.ranks)
            unseen = (f"p2p links were measured in {cover.measured} of {cover.ops} p2p ops ({cover.share:.0%}): ops of "
                      f"{who} name no peer that pairs them, so a slow pipeline link there would not "
                      "show (dump the flight recorder with TORCH_FR_BUFFER_SIZE above the profiled steps' "
                      "collectives and p2p ops, or record the peer in the profiler's record_param_comms)")
            evidence = {**evidence, "p2p_ops": cover.ops, "p2p_measured": cover.measured}
        if stages_alone(tables):
            limit = "; ".join(x for x in (limit, (
                f"with one replica, a whole pipeline stage slower on all of its ranks (a slow host holding "
                f"it) shows only against the other stages, whose work differs by design: under "
                f"{tun.stage_compute_ratio:.2f}x it would not stand out (rerun a step with the stages "
                "placed on other hosts, or compare the stages' kernels)")) if x)
        lone = lone_groups(tables)
        if lone:
            names = " and ".join(d.upper() for d in lone)
            limit = "; ".join(x for x in (limit, (
                f"one {names} group holds every rank, so its transfers have no other group to be compared "
                "with: a slow link there slows every transfer alike and would not stand out (measure its bus "
                "bandwidth against the fabric's, e.g. with nccl-tests, or compare with an earlier run)")) if x)
        if one_pipeline(tables):
            unseen_link = ("a slow link between its two stages slows both directions alike and would not stand "
                           "out" if tables.layout.pp == 2 else
                           f"a link under {tun.link_broken_ratio:g}x slower would not stand out")
            limit = "; ".join(x for x in (limit, (
                "one pipeline holds every rank, so each p2p link is compared with the other stage pairs' "
                f"(whose place in the schedule shapes their transfers): {unseen_link}")) if x)
        head = ("no rank or stage stands out beyond noise, and no link costs "
                f"{tun.link_effect_min_frac:.0%} of a step or more") if minor else \
            "no rank, stage or link stands out beyond noise"
        untraced = recorder.limits_text() if recorder is not None else ""
        if recorder is not None and recorder.unjudged:
            evidence = {**evidence, "unjudged_ranks": len(recorder.unjudged)}
        text = "; ".join(x for x in (head, limit, unseen, minor, untraced) if x)
        return Cause("none", (), text, evidence)
    lead = max(findings, key=lambda f: (f.kind == "straggler", f.cost_ns))
    return Cause(lead.cause, lead.ranks, lead.summary,
                 {**lead.evidence, "cost_ns": lead.cost_ns, "cost_share": lead.cost_share})
