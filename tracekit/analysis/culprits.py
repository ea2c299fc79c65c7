"""Every rank that is slow on its own: persistent, transient or moving, each with its cost.

Waits tell who held whom up, but blame travels: a rank waits on its TP peer, which waits on ... A
slow device, though, is slow in its *own* compute, which is measured on its own clock (no skew) and
can be set against the ranks that do the same work (``compute_speed``: the same spans of the same
pipeline stage). So each (step, rank) gets an excess e = its log compute ratio minus the step's
median over ranks; the noise unit sigma is the step-to-step scatter pooled over all ranks (rank and
step effects removed, so neither a culprit nor a busy step inflates it). Then, per rank:
- persistent: its mean excess over the steps (the two extreme steps left out) clears
  ``culprit_margin_min`` noise units (a bar rising with the ranks compared) and at least
  ``compute_effect_min_ratio``, with more than half of it in ``persist_min`` of the steps. Each rank is judged on its own, so two culprits are two findings;
- episode cells: (step, rank) cells whose excess clears a Bonferroni bar over all cells (the
  largest of T x n noisy cells is large by chance) and ``episode_min_ratio``; the bar is a tail
  quantile, so its unit is the noise itself (sigma / ``scatter_bias``: sigma reads it low on
  small tables). Cells of ranks that
  are not persistent make a *moving* straggler when they fill ``moving_min_share`` of the steps over
  two or more ranks with none holding ``persist_min`` of them, else a *transient* one per rank with
  two or more cells.
The cost of a finding is the rank's extra compute over its peers' in the steps concerned (its excess
ratio times the peers' compute of a step, so that a descheduled span elsewhere does not move it):
that is how much later it arrives at the next synchronization than its peers.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist

import numpy as np
import polars as pl

from tracekit.analysis.compute_speed import scatter_bias, step_scatter
from tracekit.analysis.findings import CONFIDENCE_MAX
from tracekit.analysis.standout import biweight_spread
from tracekit.analysis.tunables import Tunables

SENSITIVITY_RATIO = 1.03  # the slowdown a "no straggler" answer says how many steps would take
SENSITIVITY_POWER = 0.9  # "would have stood out": in this share of runs
# a run that could not have seen a rank this much slower cannot be sure there is none: where the
# other ranks' speeds spread for a reason of their own (half a stage with more attention work), a
# "no straggler" said 0.97-0.98 beside a slow device or the imbalance itself (fault grid, mixes)
BLIND_RATIO = 1.2
GUARD_MIN_RANKS = 3  # other ranks' own effects needed to measure how much healthy ranks differ
# The candidate's stage peers count in the guard where their references leave it out: from 4 ranks
# a stage a reference drops the largest other rank (compute_speed), so one slow rank is out of them.
# A second culprit of the stage stays in them and moves them by up to half its excess in a stage of
# 4 (two 1.1x ranks of one stage then read each other as noise), a sixth from 8: so from 8 the peers
# always count, in stages of 4-7 only where the first look named no other rank of the stage. On the
# fault grid's 16 draws (offline, 3,072 cases): 1.03x ranks found 251 -> 254 of 288, clean runs with
# per-rank offsets of sd 1% naming a rank 117 -> 75 of 3,456 (93 with stages of 8+ alone)
STAGE_PEERS_IN_GUARD_MIN = 8
STAGE_PEERS_IF_ALONE_MIN = 4


@dataclass(frozen=True)
class RankFinding:
    kind: str  # persistent | transient | moving
    rank: int
    steps: tuple[int, ...]  # the steps it was slow in
    ratio: float  # its compute over its peers' in those steps
    cost_ns: float  # its extra compute per such step
    margin: float  # effect over the noise bar's unit
    confidence: float
    doubt: str = ""  # why the confidence was capped, for the finding's text; "" when it was not

    def to_dict(self) -> dict:
        return {**asdict(self), "steps": list(self.steps)}


@dataclass(frozen=True)
class ComputeCulprits:
    findings: list[RankFinding] = field(default_factory=list)
    steps_total: int = 0
    ranks_compared: int = 0
    sigma: float = 0.0  # step-to-step scatter of the log compute ratio
    cell_bar: float = 0.0  # log ratio a single (step, rank) must reach to stand out
    has_data: bool = False
    # the smallest persistent slowdown (compute ratio) this run could show, and the steps one of
    # SENSITIVITY_RATIO would need: what "no straggler" can and cannot rule out
    detectable_ratio: float | None = None
    steps_for_sensitivity: int | None = None
    top_margin: float = 0.0  # the highest persistent margin of any rank, in noise units
    bar: float = 0.0  # the margin a persistent culprit must reach
    # how far the rank nearest to a persistent finding stays from it, in its noise units: short of
    # the bar, or of the effect floor (compute_effect_min_ratio), whichever is further; None: the
    # bar alone (bar - top_margin)
    shortfall: float | None = None

    def none_confidence(self) -> float | None:
        """How sure "no persistent straggler" is: how far the nearest candidate stays from a finding,
        in noise units (1 - exp(-distance)); None without the measurement. A rank 1% slower in every
        step, its noise a third of that, is above the bar but half the effect floor away: sure (4
        clean gloo runs of 4 ranks on 2 cores, rank 0 1.0% slower: 'no straggler' at 0.00-0.26 on
        the bar alone)."""
        if self.detectable_ratio is None:
            return None
        short = self.bar - self.top_margin if self.shortfall is None else self.shortfall
        # a rank slower by less than the floor could always be there
        sure = float(min(CONFIDENCE_MAX, 1.0 - math.exp(-max(0.0, short))))
        return min(sure, 0.5) if self.detectable_ratio > BLIND_RATIO else sure

    def sensitivity_text(self) -> str:
        """E.g. 'a rank 4.6% slower than its peers would have stood out (compute scatter 1.9%
        per step over 8 steps; 3% needs about 19 steps)'; '' without the measurement."""
        if self.detectable_ratio is None:
            return ""
        text = (f"a rank {self.detectable_ratio - 1:.1%} slower than its peers would have stood out "
                f"(compute scatter {math.exp(self.sigma) - 1:.1%} per step over {self.steps_total} steps")
        if self.steps_for_sensitivity and self.detectable_ratio > SENSITIVITY_RATIO:
            text += f"; {SENSITIVITY_RATIO - 1:.0%} needs about {self.steps_for_sensitivity} steps"
        return text + ")"

    def of_kind(self, kind: str) -> list[RankFinding]:
        return [f for f in self.findings if f.kind == kind]

    def to_dict(self) -> dict:
        return {"findings": [f.to_dict() for f in self.findings], "steps_total": self.steps_total,
                "ranks_compared": self.ranks_compared, "sigma": self.sigma, "cell_bar": self.cell_bar,
                "detectable_ratio": self.detectable_ratio, "steps_for_sensitivity": self.steps_for_sensitivity,
                "top_margin": self.top_margin, "bar": self.bar, "shortfall": self.shortfall}


@dataclass(frozen=True)
class _Persistent:
    """One rank's persistent test (find_culprits)."""

    noise: float  # its noise unit: standard error or the guard, the larger
    margin: float  # its effect in that unit
    effect: float  # its mean log excess over the steps kept
    slower: float  # share of steps carrying more than half of it
    kept: int  # steps kept (the two extreme ones left out)
    others: int  # ranks the guard measured
    passes: bool
    short: float  # noise units still missing to the bar or the effect floor, the further (<= 0: both met)
    quiet: tuple[int, ...] | None = None  # the steps (indices) its effect is measured on, where not all


def persistent_bar(ranks: int, tun: Tunables = Tunables()) -> float:
    """The margin a persistent culprit must reach among ``ranks`` compared: rising by
    ``compute_margin_per_log`` per ln(ranks / 2) up to ``culprit_margin_knee`` ranks, where the guard
    (the other ranks' spread) comes from few ranks and is itself uncertain, and by
    ``culprit_margin_per_log`` beyond, as the largest of more noisy scores does (a Bonferroni z)."""
    knee = max(2, tun.culprit_margin_knee)
    return (tun.culprit_margin_min + tun.compute_margin_per_log * math.log(min(max(ranks, 2), knee) / 2)
            + tun.culprit_margin_per_log * math.log(max(ranks, knee) / knee))


def margin_confidence(margin: float, bar: float, steps_share: float) -> float:
    """A margin at the bar is a coin flip made firmer by persistence; calibrated on the fault grid
    (benchmarks/diagnosis_grid.py): it only approaches 1 well past the bar."""
    z = (margin - bar) / max(bar, 1e-9) * 4.0
    return float(min(CONFIDENCE_MAX, steps_share / (1.0 + math.exp(-z))))


def find_culprits(speed: pl.DataFrame, tun: Tunables = Tunables(), compared: int | None = None,
                  known: frozenset[int] = frozenset()) -> ComputeCulprits:
    """Persistent, transient and moving slow ranks from ``compute_speed``'s (step, rank) table.
    ``compared``: how many ranks the table's were picked from (a scoped diagnosis of a large job,
    scope.py), so that the bars for the largest of many noisy scores count all of them. ``known``:
    ranks already found slow as a group (``hosts.slow_host_ranks``: half of every stage, where a
    median over the ranks is no longer a healthy one), left out of ``speed``'s references: each
    step is then centred on the other ranks, and the guard measures the other ranks alone."""
    if not speed.height or speed["rank"].n_unique() < 2:
        return ComputeCulprits()
    ranks, steps, mat = _table(speed)
    T, n = mat.shape
    if T == 0:
        return ComputeCulprits()
    ref_ns = {(int(t), int(r)): float(v) for t, r, v in speed.select("step", "rank", "ref_ns").iter_rows()}
    stage_of = dict(speed.select("rank", "pp").unique("rank").iter_rows())
    stage_size = Counter(stage_of.get(r) for r in ranks)
    healthy = [j for j, r in enumerate(ranks) if r not in known]
    if len(healthy) < 2:
        healthy = list(range(n))
    e = mat - _step_level(mat, ranks, stage_of, known)
    sigma = max(step_scatter(mat), tun.compute_noise_floor)
    n_all = max(n, compared or 0)
    cells = max(T * n_all, 2)
    # a single cell's bar is a tail quantile: of the noise itself, not of step_scatter's low reading
    cell_sigma = sigma / scatter_bias(T, n)
    cell_bar = max(NormalDist().inv_cdf(1 - tun.episode_alpha / cells) * cell_sigma, math.log(tun.episode_min_ratio))
    bar = persistent_bar(n_all, tun)
    effects = np.array([persistent_effect(e[:, j][np.isfinite(e[:, j])]) for j in range(n)])
    findings: list[RankFinding] = []
    persistent: set[int] = set()
    units: list[tuple[float, int]] = []  # each rank's noise unit, and its steps kept
    margins: list[float] = []
    shorts: list[float] = []
    if T >= tun.compute_min_steps:
        def test(j: int, peers_too: bool) -> _Persistent | None:
            col = e[:, j][np.isfinite(e[:, j])]
            if not col.size:
                return None
            # the other ranks' own effects vary a little for reasons that are not a fault (and by
            # chance more than the pooled scatter says: its spans' tails); the candidate's stage
            # peers only where their references leave it out (STAGE_PEERS_IN_GUARD_MIN): else a
            # slow rank makes them look fast (with two ranks per stage, its exact mirror image)
            away = [k for k in healthy if k != j and (peers_too or stage_of.get(ranks[k]) != stage_of.get(ranks[j]))]
            others = effects[away] if len(away) >= 2 else np.delete(effects, j)
            kept = np.sort(col)[1:-1] if col.size >= 6 else col
            noise = max(sigma / math.sqrt(kept.size), biweight_spread(others), tun.compute_noise_floor)
            effect = float(effects[j])
            margin = effect / noise
            # persistent means most steps carry it: more than half the effect in persist_min of them
            # (a straggler that moves leaves a mean excess too, but only in its own steps)
            slower = float((col > effect / 2).mean())
            # where a step's noise is as large as the effect, that share is itself noise: then
            # persistent means still clearing the bar without the rank's standout steps (an episode
            # leaves nothing behind once its cells are out). Its standard error takes the noise at
            # its true size (cell_sigma): at 5% kernel noise the plain scatter reads 0.6-0.9 of it,
            # and four quiet steps at +1% then made a 2-step 1.5x episode a persistent 1.08x
            # rank at 0.87 (hold-out draw 14)
            # What persists is then the quiet steps' own effect, which the floor and the finding's
            # ratio and cost take: two 1.3x steps beside six at +1.5% read "1.05x, uniformly, every
            # step" at 0.99 (hold-out draw 31), where the standout steps are an episode.
            quiet = col[col < cell_bar]
            quiet_steps = None
            if slower < tun.persist_min and quiet.size >= tun.compute_min_steps:
                rest = np.sort(quiet)[1:-1] if quiet.size >= 6 else quiet
                rest_effect = float(np.mean(rest))
                if rest_effect / max(cell_sigma / math.sqrt(rest.size), noise) >= bar:
                    slower = float((col > 0).mean())
                    if rest_effect < effect:
                        effect, margin = rest_effect, rest_effect / noise
                        finite = np.flatnonzero(np.isfinite(e[:, j]))
                        quiet_steps = tuple(int(i) for i in finite[col < cell_bar])
            floor = math.log(tun.compute_effect_min_ratio)
            passes = margin >= bar and effect >= floor and slower >= tun.persist_min
            short = max(bar - margin, (floor - effect) / noise)
            return _Persistent(noise, margin, effect, slower, kept.size, others.size, passes, short, quiet_steps)

        def stage_mates(j: int) -> list[int]:
            return [k for k in range(n) if k != j and stage_of.get(ranks[k]) == stage_of.get(ranks[j])]

        large = [stage_size[stage_of.get(r)] >= STAGE_PEERS_IN_GUARD_MIN for r in ranks]
        middle = [STAGE_PEERS_IF_ALONE_MIN <= stage_size[stage_of.get(r)] < STAGE_PEERS_IN_GUARD_MIN for r in ranks]
        # the first look (peers only from STAGE_PEERS_IN_GUARD_MIN) says which stages of 4-7 hold a culprit
        first = {j for j in range(n) if middle[j] and (t := test(j, False)) is not None and t.passes}
        for j, r in enumerate(ranks):
            alone = middle[j] and not any(k in first for k in stage_mates(j))
            t = test(j, large[j] or alone)
            if t is None:
                continue
            units.append((t.noise, t.kept))
            margins.append(t.margin)
            shorts.append(t.short)
            if t.passes:
                persistent.add(j)
                its_steps = steps if t.quiet is None else [steps[i] for i in t.quiet]
                cost = (math.exp(t.effect) - 1) * float(np.median([ref_ns.get((int(s), r), 0.0) for s in its_steps]))
                conf, doubt = margin_confidence(t.margin, bar, t.slower), ""
                if t.others < GUARD_MIN_RANKS and t.effect < math.log(tun.few_ranks_min_ratio):
                    conf = min(conf, 0.5)
                    doubt = (f"only {t.others + 1} ranks do this work, too few to tell a difference this "
                             "small from the ranks' own (chips, placement, a shared host)")
                findings.append(RankFinding("persistent", r, tuple(int(s) for s in its_steps), math.exp(t.effect), cost,
                                            t.margin, conf, doubt))
    # episodes among the ranks the table explains neither way: a known culprit's cells (a slow host's
    # ranks short of the persistent bar at 15% noise) made a healthy rank's one cell 'moving' with them
    hot = [(i, j) for i in range(T) for j in range(n)
           if j not in persistent and ranks[j] not in known and np.isfinite(e[i, j]) and e[i, j] >= cell_bar]
    by_step: dict[int, list[int]] = {}
    for i, j in hot:
        by_step.setdefault(i, []).append(j)
    top_per_step = {i: max(js, key=lambda j: e[i, j]) for i, js in by_step.items()}
    counts: dict[int, int] = {}
    for j in top_per_step.values():
        counts[j] = counts.get(j, 0) + 1
    moving = (len(top_per_step) >= max(2, math.ceil(tun.moving_min_share * T)) and len(counts) >= 2
              and max(counts.values()) / len(top_per_step) < tun.persist_min)
    for j in sorted({j for _, j in hot}):
        cells = sorted(i for i, jj in hot if jj == j)
        if len(cells) >= max(2, tun.persist_min * T) and not moving:  # slow in most steps: not an episode
            vals = e[cells, j]
            findings.append(RankFinding("persistent", ranks[j], tuple(int(steps[i]) for i in cells),
                                        float(math.exp(np.median(e[:, j]))),
                                        float(np.median([(math.exp(e[i, j]) - 1) * ref_ns.get((int(steps[i]), ranks[j]), 0.0)
                                                         for i in cells])),
                                        float(np.min(vals)) / sigma, margin_confidence(float(np.min(vals)) / sigma,
                                                                                 cell_bar / sigma, len(cells) / T)))
            continue
        if not moving and len(cells) < 2:
            continue
        if moving and j not in counts:
            continue
        if moving:
            cells = [i for i in cells if top_per_step.get(i) == j]
        vals = e[cells, j]
        margin = float(np.min(vals)) / sigma
        cost = float(np.median([(math.exp(e[i, j]) - 1) * ref_ns.get((int(steps[i]), ranks[j]), 0.0) for i in cells]))
        z_bar = cell_bar / sigma
        findings.append(RankFinding("moving" if moving else "transient", ranks[j], tuple(int(steps[i]) for i in cells),
                                    float(math.exp(np.median(vals))), cost, margin,
                                    margin_confidence(margin, z_bar, 1.0)))
    findings.sort(key=lambda f: (f.kind != "persistent", -f.cost_ns))
    detectable, steps_needed = _sensitivity(units, bar, tun)
    top = max((m for m in margins if math.isfinite(m)), default=0.0)
    nearest = min((x for x in shorts if math.isfinite(x)), default=None)
    return ComputeCulprits(findings, T, n, float(sigma), float(cell_bar), True, detectable, steps_needed, float(top),
                           float(bar), None if nearest is None else float(nearest))


def measured_again(found: ComputeCulprits, speed: pl.DataFrame) -> ComputeCulprits:
    """``found`` with its persistent culprits' ratios and costs measured on ``speed``: the table
    from ``compute_speed(tables, culprits)``, where every culprit is out of the others'
    references. Which ranks are culprits, and how sure, stays as found: the first look's
    references are what the bars were chosen on; a second culprit left in them biases the
    measure (two 1.5x ranks of 8 read 1.58-1.62x; two of a stage's four, 1.36x), not the finding."""
    if not speed.height or not found.of_kind("persistent"):
        return found
    ranks, steps, mat = _table(speed)
    if not mat.size:
        return found
    stage_of = dict(speed.select("rank", "pp").unique("rank").iter_rows())
    e = mat - _step_level(mat, ranks, stage_of, frozenset(f.rank for f in found.of_kind("persistent")))
    ref_ns = {(int(t), int(r)): float(v) for t, r, v in speed.select("step", "rank", "ref_ns").iter_rows()}
    out = []
    for f in found.findings:
        if f.kind == "persistent" and f.rank in ranks:
            # on the steps it was found slow in: all of them, or its quiet ones beside an episode
            rows = [i for i, t in enumerate(steps) if t in f.steps]
            col = e[rows, ranks.index(f.rank)]
            effect = persistent_effect(col[np.isfinite(col)])
            if math.isfinite(effect):
                cost = (math.exp(effect) - 1) * float(np.median([ref_ns.get((int(steps[i]), f.rank), 0.0) for i in rows]))
                f = replace(f, ratio=math.exp(effect), cost_ns=cost)
        out.append(f)
    return replace(found, findings=out)


def _step_level(mat: np.ndarray, ranks: list[int], stage_of: dict, known: frozenset[int]) -> np.ndarray:
    """Each step's level (a column to subtract): the median over the ranks. With ``known`` culprits
    out of the references (``compute_speed(tables, known)``), the median over the healthy ranks that
    were measured against healthy ranks (another healthy rank in their stage): over all of them,
    half a stage of culprits (a slow host of a two-host job) moved it halfway, and a 1.2x host read
    1.08-1.09x; over healthy ranks whose only peer is a culprit (measured against it), 1.43x. None
    such: 0 (the references are then plain means of healthy ranks already)."""
    if not known:
        return np.nanmedian(mat, axis=1, keepdims=True)
    healthy_in = Counter(stage_of.get(r) for r in ranks if r not in known)
    cols = [j for j, r in enumerate(ranks) if r not in known and healthy_in[stage_of.get(r)] >= 2]
    if not cols:
        return np.zeros((mat.shape[0], 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step none of them recorded: NaN, skipped
        return np.nanmedian(mat[:, cols], axis=1, keepdims=True)


def _table(speed: pl.DataFrame) -> tuple[list[int], list[int], np.ndarray]:
    """(ranks, steps, step x rank log ratios) of ``compute_speed``'s table, steps with two ranks or more."""
    wide = speed.pivot(on="rank", index="step", values="log_ratio").sort("step")
    ranks = [int(c) for c in wide.columns if c != "step"]
    mat = wide.select([str(r) for r in ranks]).to_numpy().astype(float)
    keep = np.isfinite(mat).sum(axis=1) >= 2
    return ranks, [t for t, k in zip(wide["step"].to_list(), keep) if k], mat[keep]


def persistent_effect(col: np.ndarray) -> float:
    """A rank's persistent effect: the mean over steps without the two extreme ones (nearly a mean's
    precision, where a median's standard error is 1.25x larger, which a 3% slowdown cannot afford;
    a step or two of preemption moves nothing); the median below six steps."""
    if not col.size:
        return float("nan")
    return float(np.mean(np.sort(col)[1:-1])) if col.size >= 6 else float(np.median(col))


def _sensitivity(units: list[tuple[float, int]], bar: float, tun: Tunables) -> tuple[float | None, int | None]:
    """The persistent slowdown a typical rank shows in SENSITIVITY_POWER of runs like this one
    (its margin, in its noise unit, must clear the bar: the effect must sit z(power) noise units
    above it), and the steps a SENSITIVITY_RATIO slowdown needs for the same: both parts of the noise
    unit (the standard error over steps, the spread of the ranks' own effects) shrink as 1/sqrt(steps).
    The noise unit is the median over ranks, taken at its upper 80% bound: it is estimated from this
    run (its spread part from the ranks' effects; 1.17 / sqrt(n) is the relative standard error of
    a MAD of n values, kept for the biweight as the cautious side), and an estimate that came out low by chance would
    promise what the run cannot see (at the plain estimate, 83% of 36 simulated runs saw the stated
    slowdown). Checked by simulation (benchmarks/sensitivity_check.py)."""
    if not units:
        return None, None
    noise = float(np.median([u for u, _ in units]))
    kept = int(np.median([k for _, k in units]))
    reach = bar + NormalDist().inv_cdf(SENSITIVITY_POWER)
    noise_high = noise * (1.0 + NormalDist().inv_cdf(0.8) * 1.17 / math.sqrt(max(len(units) - 1, 1)))
    detectable = max(math.exp(reach * noise_high), tun.compute_effect_min_ratio)
    need = kept * (reach * noise_high / math.log(SENSITIVITY_RATIO)) ** 2
    trimmed = 2 if kept + 2 >= 6 else 0  # the two extreme steps left out (find_culprits)
    return detectable, max(tun.compute_min_steps, math.ceil(need) + trimmed)
