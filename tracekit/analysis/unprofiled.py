"""Ranks without a profiler trace, judged by their flight-recorder durations.

Real jobs often profile some ranks only, or lose a rank's trace. Its peers' waits then say little
(``diagnosis`` never blames a rank without data on them), and before this a straggler among such
ranks left "no straggler" at 0.97. Their flight recorder still holds every collective with its
duration (CUDA events on NCCL with ``TORCH_NCCL_ENABLE_TIMING``; the reference trainer's own
records on gloo). A collective completes on all members together and each member's duration runs
from its own arrival, so the member that arrives last has the shortest: per collective, a member's
lateness is the other members' mean duration less its own (the whole gap, in a pair as in a group
of 64), each measured on its own clock, so no clock skew enters. A rank late across its
collectives by more than their noise, and by enough of a step to matter, is a finding, unless its
own p2p receives waited that long (a slow pipeline neighbour's victim); where the recorder has no
durations, such ranks cannot be judged at all, and "no straggler" says so (diagnosis).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Iterable

import numpy as np
import polars as pl

from tracekit.analysis.culprits import SENSITIVITY_POWER, margin_confidence, persistent_effect
from tracekit.analysis.findings import CONFIDENCE_MAX, NEXT_STEP, Finding, named_ranks, where
from tracekit.analysis.tables import RunTables
from tracekit.analysis.standout import spread
from tracekit.analysis.tunables import Tunables
from tracekit.analysis.wait_cost import slack_unseen

ALPHA = 0.01  # the chance that a run without a late rank names one, over all the ranks compared
# a rank 1.2x slower (culprits.BLIND_RATIO) whose compute is half of a step or more is late by a
# tenth of a step: a test that could miss that much says nothing sure
BLIND_FRAC = 0.1
# recorder rows read at most (their groups' entries, every member's): about 60 bytes a row in memory.
# Past it (thousands of untraced ranks of a large job), the ranks stay unjudged, and say why.
ROWS_MAX = 4_000_000
COLUMNS = ("rank", "pg_name", "pg_desc", "collective_seq_id", "duration_ms", "time_created_ns", "state", "is_p2p",
           "profiling_name")
# a late rank whose extra p2p receive waits (over its group peers') make up this share of its
# lateness is late because it waited for a pipeline neighbour: the neighbour is the straggler
WAITED_SHARE = 0.5


@dataclass(frozen=True)
class LateRank:
    rank: int
    late_ns: float  # over its collectives (the two extreme left out), the other members' mean duration less its own
    collectives: int  # timed collectives it was compared in
    last_share: float  # share of them it reached last
    late_share: float  # share of them it reached after the others' mean
    margin: float  # late_ns over its noise unit
    bar: float  # the margin it had to clear
    cost_ns: float  # the waits it caused in a step, in the group where they sum least
    groups: tuple[str, ...]  # the groups it was late in (their descriptions, else names)
    confidence: float


@dataclass(frozen=True)
class RecorderJudgement:
    """What the flight recorder says of the ranks asked about."""

    judged: tuple[int, ...] = ()  # ranks with timed collectives beside timed peers
    unjudged: tuple[int, ...] = ()  # ranks without: a straggler among them would not show
    late: tuple[LateRank, ...] = ()
    why_unjudged: str = "no timed flight-recorder entries"  # what the unjudged ranks lack
    waited: tuple[int, ...] = ()  # late, but by waiting on p2p receives (a slow neighbour's victims)
    # how far the judged rank nearest to a finding stays from one, in noise units (None: none measured)
    shortfall: float | None = None
    # the lateness a judged rank would need, per step and as a share of it, to stand out in
    # SENSITIVITY_POWER of runs: its noisiest one's (None: none measured)
    detectable_frac: float | None = None

    def none_confidence(self) -> float:
        """How sure "none of the untraced ranks is late" is, as ``ComputeCulprits.none_confidence``:
        from the nearest judged rank's distance to a finding; 0.5 at most where a rank late by
        BLIND_FRAC of a step could have gone unseen (reduce-scatters of 100-250 ms that scatter by
        as much hid a 1.3x rank on a grid draw, and "no straggler" read 0.99), or where ranks could
        not be judged at all (half of a 16-rank job unprofiled, its slow rank there: 0.97 before)."""
        sure = CONFIDENCE_MAX if self.shortfall is None else \
            float(min(CONFIDENCE_MAX, 1.0 - math.exp(-max(0.0, self.shortfall))))
        blind = (self.detectable_frac or 0.0) > BLIND_FRAC or bool(self.unjudged)
        return min(sure, 0.5) if blind else sure

    def limits_text(self) -> str:
        """What "no straggler" cannot say of the untraced ranks ('' where nothing); those judged on
        their recorder the headline names."""
        parts = []
        if self.unjudged:
            parts.append(f"{named_ranks(self.unjudged)} have no profiler trace, and {self.why_unjudged}: a straggler "
                         "among them would not show (profile every rank, or set TORCH_NCCL_ENABLE_TIMING=1 so that "
                         "the flight recorder times each collective)")
        if self.judged and (self.detectable_frac or 0.0) > BLIND_FRAC:
            parts.append(f"the flight recorder shows a rank without a trace only when it is late by about "
                         f"{self.detectable_frac:.0%} of a step (its collectives' durations scatter that much)")
        return "; ".join(parts)


def recorder_lateness(fr: pl.DataFrame, ranks: Iterable[int], step_ns: float,
                      tun: Tunables = Tunables()) -> RecorderJudgement:
    """Judge ``ranks`` (ranks without a profiler trace) on ``fr`` (``fr_entries`` rows of the
    collective groups they belong to, every member's, and those members' p2p entries): which of them
    reach their collectives persistently late, not by waiting for a pipeline neighbour.
    ``step_ns``: the run's step time (from the profiled ranks), for the cost and its floor."""
    asked = sorted({int(r) for r in ranks})
    if not asked:
        return RecorderJudgement()
    if not fr.height or any(c not in fr.columns for c in COLUMNS):
        return RecorderJudgement(unjudged=tuple(asked))
    timed = fr.filter(~pl.col("is_p2p").fill_null(False) & (pl.col("state") == "completed")
                      & pl.col("collective_seq_id").is_not_null() & pl.col("duration_ms").is_finite()
                      & (pl.col("duration_ms") > 0))
    key = ["pg_name", "collective_seq_id"]
    timed = timed.unique(["rank", *key]).with_columns(
        pl.len().over(key).alias("n"), pl.col("duration_ms").sum().over(key).alias("sum_ms"),
        pl.col("duration_ms").min().over(key).alias("min_ms"))
    # the others' mean: where one member is late, every other waited for it alike (a rank late in
    # another group arrives late here too, and then reads late here: its own finding, not this one's)
    others = (pl.col("sum_ms") - pl.col("duration_ms")) / (pl.col("n") - 1)
    timed = timed.filter(pl.col("n") >= 2).with_columns(
        ((others - pl.col("duration_ms")) * 1e6).alias("late_ns"),
        (pl.col("duration_ms") == pl.col("min_ms")).alias("last"))
    recv = _recv_ns(fr)
    have = set(timed["rank"].unique().to_list())
    judged = tuple(r for r in asked if r in have)
    unjudged = tuple(r for r in asked if r not in have)
    if not judged:
        return RecorderJudgement(judged, unjudged)
    by_rank = {int(r): g.sort("time_created_ns") for (r,), g in timed.group_by("rank")}
    effects = {r: persistent_effect(g["late_ns"].to_numpy()) for r, g in by_rank.items()}
    # the collectives' own scatter: every rank's lateness less its own mean (a late rank moves its
    # mean, not the scatter around it)
    resid = np.concatenate([g["late_ns"].to_numpy() - effects[r] for r, g in by_rank.items()])
    sigma = max(spread(resid), tun.noise_floor_frac * step_ns)
    bar = NormalDist().inv_cdf(1 - ALPHA / max(len(by_rank), 2))
    steps_of = {r: _steps(g, step_ns) for r, g in by_rank.items()}
    late, waited, shorts, detectable = [], [], [], []
    reach = bar + NormalDist().inv_cdf(SENSITIVITY_POWER)
    for r in judged:
        g = by_rank[r]
        col = g["late_ns"].to_numpy()
        kept = col.size - 2 if col.size >= 6 else col.size
        if kept < tun.compute_min_steps:
            continue
        effect = effects[r]
        margin = effect / (sigma / math.sqrt(kept))
        # persistence: late at most of them (the gaps differ in size, by the work since each
        # group's last collective, so a share above half the mean would miss a persistent one)
        slower = float((col > 0).mean())
        steps = steps_of[r]
        # per group, the waits it caused summed over a step; the smallest of those sums over groups
        # that meet at least once a step: a TP peer waits for its every slow kernel, while the
        # pipeline hides part of that from the step (a 1.5x trainer rank: TP 553, DP 284 and the
        # step-end PP group 261 ms per step, against 259 by the what-if replay of its trace)
        sums = g.group_by("pg_name").agg(pl.len().alias("n"), pl.col("late_ns").clip(0, None).sum().alias("ns"))
        regular = sums.filter(pl.col("n") >= steps)
        cost = float((regular if regular.height else sums)["ns"].min()) / steps
        # whether it matters, though, by the group where it makes its peers wait most: where the
        # whole replica runs late behind it (a pipeline), its DP lateness is its replica's, and a
        # 1.1x rank's 40 ms of TP waits a step fell under the floor in its DP group (grid draw 33)
        waits = float(sums["ns"].max()) / steps
        # a rank late by `reach` units at each collective of its densest group, per step
        per_step = float(sums["n"].max()) / steps
        unit = sigma / math.sqrt(kept)
        detectable.append(reach * unit * per_step / step_ns if step_ns > 1 else float("inf"))
        floor = tun.link_effect_min_frac * step_ns
        # its distance from a finding: the clipped waits of a punctual rank are positive by half
        # its collectives' noise, so the floor is measured against its mean lateness
        # ... and from being late in persist_min of its collectives (a binomial share's z): on a
        # busy 2-core gloo run a punctual rank ran a little late on average, far past the bar, in
        # about half of its collectives, and "no straggler" read 0.00 on three clean trainer runs
        persist = (tun.persist_min - slower) * math.sqrt(col.size) / 0.5
        shorts.append(max(bar - margin, (floor - effect * per_step) / max(unit * per_step, 1.0), persist))
        if margin >= bar and slower >= tun.persist_min and waits >= floor:
            where = g.filter(pl.col("late_ns") > 0)
            # its stage peers in other replicas (the other members of the groups it was late in):
            # a rank that waited longer than they did on its p2p receives is a slow neighbour's
            # victim, late to the next collective by that wait (a 1.3x stage-1 rank made its stage-0
            # neighbour late at 0.73 on a grid draw)
            peers = timed.filter(pl.col("pg_name").is_in(where["pg_name"].unique().implode())
                                 & (pl.col("rank") != r))["rank"].unique().to_list()
            peer_waits = [recv[p] / steps_of[p] for p in peers if p in recv and p in steps_of]
            if r in recv and peer_waits and recv[r] / steps - float(np.median(peer_waits)) >= WAITED_SHARE * cost:
                waited.append(r)
                continue
            groups = tuple(sorted({d or n for d, n in where.select("pg_desc", "pg_name").iter_rows()}))
            late.append(LateRank(r, float(effect), int(col.size), float(g["last"].mean()), slower, float(margin),
                                 float(bar), cost, groups, margin_confidence(margin, bar, slower)))
    return RecorderJudgement(judged, unjudged, tuple(late), waited=tuple(waited),
                             shortfall=min(shorts) if shorts else None,
                             detectable_frac=max(detectable) if detectable else None)


def recorder_findings(tables: RunTables, recorder: RecorderJudgement, findings: list[Finding], damaged: set[int],
                      step_ns: float) -> list[Finding]:
    """``findings`` with a straggler finding per late untraced rank, and without the slow links of
    the groups such a rank belongs to: their traced members' transfers wait for a member whose
    arrival no trace shows (a DP group's traced half of a grid draw read 'transfers 1.07x slower'
    beside the untraced 1.1x rank that was its cause)."""
    if not recorder.late:
        return findings
    late = {x.rank for x in recorder.late}
    traced_parts = [set(rs) - damaged for rs in tables.groups["ranks"].to_list() if rs and set(rs) & late]
    kept = [f for f in findings if not (f.kind == "slow_link" and set(f.ranks) in traced_parts)]
    return kept + [_late_finding(tables, x, step_ns) for x in recorder.late]


def _late_finding(tables: RunTables, x: LateRank, step_ns: float) -> Finding:
    place = where(tables, (x.rank,))
    summary = (f"{place} is a straggler: it has no profiler trace, and its flight recorder says it reached its "
               f"collectives last in {x.last_share:.0%} of {x.collectives}, {x.late_ns / 1e6:.2f} ms after the other "
               f"members on average ({', '.join(x.groups)}); why (compute, host, data) needs its trace")
    return Finding("straggler", (x.rank,), place, (), x.cost_ns, x.cost_ns / step_ns, x.confidence, "late_no_trace",
                   summary, NEXT_STEP["late_no_trace"].format(who=f"rank {x.rank}"),
                   {"late_ns": x.late_ns, "collectives": x.collectives, "last_share": x.last_share,
                    "margin": x.margin, "bar": x.bar, "cost_from": "flight-recorder durations"},
                   cost_upper_bound=slack_unseen(tables.layout, ("dp",) if tables.layout.dp > 1 else ()))


def _steps(rows: pl.DataFrame, step_ns: float) -> float:
    """How many steps a rank's recorder entries span (at least 1)."""
    created = rows["time_created_ns"].drop_nulls()
    if created.len() < 2 or step_ns <= 1:
        return 1.0
    return max(1.0, round(float(created.max() - created.min()) / step_ns))


def _recv_ns(fr: pl.DataFrame) -> dict[int, float]:
    """Each rank's timed p2p receives, summed (ns): how long it waited for its pipeline neighbours."""
    p2p = fr.filter(pl.col("is_p2p").fill_null(False) & (pl.col("state") == "completed")
                    & pl.col("profiling_name").str.contains("recv") & pl.col("duration_ms").is_finite())
    if not p2p.height:
        return {}
    return {int(r): float(v) * 1e6 for r, v in p2p.group_by("rank").agg(pl.col("duration_ms").sum()).iter_rows()}
