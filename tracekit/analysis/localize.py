"""Top-down slow-rank localization: DP -> PP -> CP -> TP (ALGORITHMS.md, Llama 3 sec. 6.1).

Scores (``scores.py``), per step and rank, say how much the rank's peers waited on it: in
collectives of the level's groups (dp, cp, tp), or as the producer blamed by pipeline receives (pp).
A candidate's score is the mean over its ranks within the range found so far. Within one replica,
a stage's pipeline blame is taken relative to the same stage in the other replicas, removing the
bubbles every replica shares; with no replica to compare against it must clear a larger bar.
At each level the member with the highest score is kept if it stands out beyond noise (a bar that
rises with the number of members competing) and persists across steps; if nothing stands out over
the whole range, the level is searched one group (combination of open outer coordinates) at a time,
and a clear culprit there fixes those coordinates too; otherwise the level stays open (and is
revisited, group by group, once inner levels have narrowed the range; a last open coordinate is
resolved by each remaining rank's lateness in its own inner groups). An outer level whose top
member changes from step to step (data imbalance) ends the search with "moving". A plain descent
(no group search) also runs on each step alone, so transient and moving stragglers show in
``per_step``.

Waits carry every kind of timing noise, so the descent is checked against each rank's compute speed
(``compute_speed.py``: the same compute spans compared among the ranks of a stage; ``episodes.py``). A rank that
computes persistently slower than its peers names the culprit when the waits alone stayed open,
narrows a late group to its slow member, and a "moving" straggler needs, step by step, a rank whose
compute stood out (or no compute records to check against): moving wait noise is not a finding;
nor is a transient one whose compute did not stand out in the steps that name it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import polars as pl

from tracekit.analysis.collectives import match_collectives
from tracekit.analysis.compute_speed import ComputeFinding, compute_outlier, compute_speed
from tracekit.analysis.episodes import moving_supported, with_compute
from tracekit.analysis.scores import collective_scores, level_matrix, pipeline_scores
from tracekit.analysis.standout import margin_bar, spread, standout
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables
from tracekit.topology import OUTER_TO_INNER

COLLECTIVE_LEVELS = ("dp", "cp", "tp")


@dataclass(frozen=True)
class LevelFinding:
    level: str  # dp | pp | cp | tp
    candidates: tuple[int, ...]  # coordinate values searched (within the range found so far)
    scores_ns: dict[int, float]  # per candidate, mean per step of how long peers waited on it
    chosen: int | None
    effect_ns: float  # top candidate's mean score minus the others' median
    noise_ns: float  # spread of healthy peers (floored)
    margin: float  # effect / noise
    steps_total: int
    steps_standout: int  # steps in which one member stood out at this level
    steps_agree: int  # steps whose top member is the chosen one
    verdict: str  # culprit | none | moving | skipped (size 1 or no data)
    within: dict[str, int] = field(default_factory=dict)  # the coordinates fixed when this level searched
    # what the scores are: waits in this level's groups (collectives / p2p), or, for the last open
    # coordinate, each candidate rank's lateness in its own inner groups ("own-groups")
    basis: str = "groups"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["scores_ns"] = {str(k): v for k, v in self.scores_ns.items()}
        return d


@dataclass(frozen=True)
class Localization:
    # straggler (one rank) | group (several ranks) | stage (one stage in every replica) |
    # transient (one rank, some steps only) | moving (slowest member changes per step) |
    # no_straggler | no_data (no level had cross-rank records to compare)
    verdict: str
    culprit_rank: int | None
    culprit_ranks: tuple[int, ...]
    coords: dict[str, int]  # the coordinates narrowed down (open dimensions are absent)
    confidence: float
    step_time_ns: float
    levels: list[LevelFinding] = field(default_factory=list)
    per_step: pl.DataFrame = field(default_factory=pl.DataFrame)  # step, dp, pp, cp, tp, culprit_rank, effect_ns
    compute: ComputeFinding | None = None  # the compute-speed check (None: not run)
    # what named the culprit: waits (the top-down descent), compute (the compute-speed check, the
    # waits having stayed open or named a group), or both (they agree)
    basis: str = "waits"
    episode_steps: tuple[int, ...] = ()  # a transient straggler's steps

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "episode_steps": list(self.episode_steps), "culprit_rank": self.culprit_rank,
                "culprit_ranks": list(self.culprit_ranks), "coords": self.coords,
                "confidence": self.confidence, "step_time_ns": self.step_time_ns, "basis": self.basis,
                "levels": [lv.to_dict() for lv in self.levels], "per_step": self.per_step.to_dicts(),
                "compute": self.compute.to_dict() if self.compute else None}


def step_time_ns(tables: RunTables) -> float:
    """Median step duration over ranks and steps (from the steps table, else the events' span)."""
    if tables.steps.height:
        d = tables.steps.select((pl.col("end_ns") - pl.col("start_ns")).median()).item()
    else:
        d = tables.events.group_by("rank", "step").agg(
            ((pl.col("ts_ns") + pl.col("dur_ns")).max() - pl.col("ts_ns").min()).alias("d"))["d"].median()
    return float(d or 0.0)


def _stage_wide(level: str, rng: dict[str, int], lay) -> bool:
    """Pipeline blame with no other replica to compare against (dp open, or dp = 1) includes the
    schedule's own bubbles and first/last-stage asymmetry, so it needs a larger effect."""
    return level == "pp" and (lay.dp == 1 or "dp" not in rng)


def _evaluate(level: str, mat: np.ndarray, step_ns: float, tun: Tunables, effect_min_frac: float,
              within: dict[str, int], groups: int = 1) -> LevelFinding:
    """Aggregate decision for one level over all steps (steps x candidates score matrix), when
    ``groups`` such matrices are searched for the clearest culprit."""
    T, n = mat.shape
    margin_min = margin_bar(tun, n * groups)
    floor = tun.noise_floor_frac * step_ns
    per_step = [standout(row, step_ns, tun, effect_min_frac) for row in mat]
    tops = [p[0] for p in per_step]
    effects = [p[1] for p in per_step]
    stood_out = [p[2] for p in per_step]
    mean = mat.mean(axis=0)
    top = int(np.argmax(mean))
    others = np.delete(mean, top)
    diffs = mat[:, top] - np.median(np.delete(mat, top, axis=1), axis=1)
    effect = float(mean[top] - np.median(others))
    sem = float(np.std(diffs) / math.sqrt(T)) if T > 1 else 0.0
    noise = max(spread(others), floor, sem)
    margin = effect / noise if noise > 0 else math.inf
    agree = sum(1 for t in tops if t == top)
    n_out = sum(stood_out)
    agree_out = sum(1 for t, s in zip(tops, stood_out) if s and t == top)
    passes = margin >= margin_min and effect >= effect_min_frac * step_ns
    persistent = agree / T >= tun.persist_min or (n_out > 0 and agree_out / n_out >= tun.persist_min)
    winners = [t for t, s in zip(tops, stood_out) if s]
    # moving: standouts in most steps, and no member holds the top in persist_min of them
    dominant = max((winners.count(w) for w in set(winners)), default=0) / max(len(winners), 1)
    if passes and persistent:
        verdict = "culprit"
    elif (n_out >= max(2, math.ceil(tun.moving_min_share * T)) and len(set(winners)) >= 2
          and dominant < tun.persist_min and float(np.median(effects)) >= tun.episode_effect_min_frac * step_ns):
        verdict = "moving"
    else:
        verdict = "none"
    return LevelFinding(level=level, candidates=tuple(range(n)), scores_ns={i: float(v) for i, v in enumerate(mean)},
                        chosen=top if verdict == "culprit" else None, effect_ns=effect, noise_ns=noise,
                        margin=float(margin), steps_total=T, steps_standout=n_out, steps_agree=agree, verdict=verdict,
                        within=dict(within))


def localize(tables: RunTables, tunables: Tunables = Tunables()) -> Localization:
    """Top-down DP -> PP -> CP -> TP search for the rank that holds the job back."""
    lay = tables.layout
    coords = tables.coords()
    step_ns = step_time_ns(tables)
    matched = match_collectives(tables)
    scores = {lv: collective_scores(tables, lv, matched) for lv in COLLECTIVE_LEVELS}
    scores["pp"] = pipeline_scores(tables)
    speed = compute_speed(tables)
    rng: dict[str, int] = {}
    levels: list[LevelFinding] = []
    for level in OUTER_TO_INNER:
        size = getattr(lay, level)
        steps, mat = level_matrix(scores[level], coords, rng, level, lay) if size > 1 else ([], np.zeros((0, 1)))
        if size == 1 or not steps:
            levels.append(LevelFinding(level, tuple(range(size)), {}, 0 if size == 1 else None, 0.0, 0.0, 0.0,
                                       0, 0, 0, "skipped", dict(rng)))
            if size == 1:
                rng[level] = 0
            continue
        # A stage is only blamed across every replica if the effect is large (pipelines are uneven).
        eff_min = tunables.stage_effect_min_frac if _stage_wide(level, rng, lay) else tunables.effect_min_frac
        finding = _evaluate(level, mat, step_ns, tunables, eff_min, rng)
        if finding.verdict == "moving" and not moving_supported(level, steps, mat, speed, coords, rng, step_ns,
                                                                 tunables):
            finding = replace(finding, verdict="none")  # moving wait noise: no compute stood out
        if finding.verdict == "none":
            finding = _search_open(level, scores[level], coords, rng, lay, step_ns, tunables) or finding
        levels.append(finding)
        if finding.verdict == "culprit" and not any(lv.verdict == "moving" for lv in levels[:-1]):
            rng.update(finding.within)
            rng[level] = finding.chosen
    _revisit_open(levels, scores, coords, rng, lay, step_ns, tunables)
    _resolve_last_open(levels, scores, rng, lay, step_ns, tunables)
    per_step = _per_step(scores, coords, lay, step_ns, tunables)
    waits = _conclude(lay, rng, levels, step_ns, per_step, tunables)
    return with_compute(waits, compute_outlier(speed, tunables), lay, speed, tunables)


def _revisit_open(levels: list[LevelFinding], scores, coords, rng: dict[str, int], lay, step_ns: float,
                  tun: Tunables) -> None:
    """Once inner levels have narrowed the range, a level that stayed open is evaluated again
    within it: its groups now hold only the suspect's peers, not healthy groups that dilute it."""
    if any(lv.verdict == "moving" for lv in levels) or not any(lv.verdict == "culprit" for lv in levels):
        return
    for i, lv in enumerate(levels):
        level = lv.level
        if lv.verdict != "none" or level in rng:
            continue
        within = {d: v for d, v in rng.items() if d != level}
        open_dims = [d for d in OUTER_TO_INNER if d != level and d not in within and getattr(lay, d) > 1]
        again = _search_groups(level, scores[level], coords, within, open_dims, lay, step_ns, tun)
        if again is not None:
            levels[i] = again
            rng.update(again.within)
            rng[level] = again.chosen


def _resolve_last_open(levels: list[LevelFinding], scores: dict[str, pl.DataFrame], rng: dict[str, int], lay,
                       step_ns: float, tun: Tunables) -> None:
    """When every coordinate but one is narrowed, the few remaining ranks (e.g. one per stage) sit
    in different groups at the inner levels; the one that is late in its *own* groups (its summed
    collective scores) is the culprit, if it stands out."""
    open_dims = [d for d in OUTER_TO_INNER if d not in rng]
    if len(open_dims) != 1 or any(lv.verdict == "moving" for lv in levels):
        return
    dim = open_dims[0]
    ranks = [lay.rank_of(**{**rng, dim: v}) for v in range(getattr(lay, dim))]
    inner = [scores[lv].select("step", "rank", "score") for lv in COLLECTIVE_LEVELS
             if lv != dim and getattr(lay, lv) > 1]
    if not inner:
        return
    own = pl.concat(inner).filter(pl.col("rank").is_in(ranks)).group_by("step", "rank").agg(pl.col("score").sum())
    if not own.height:
        return
    steps = sorted(own["step"].unique().to_list())
    pos, col = {t: i for i, t in enumerate(steps)}, {r: v for v, r in enumerate(ranks)}
    mat = np.zeros((len(steps), len(ranks)))
    for t, r, v in own.iter_rows():
        mat[pos[t], col[r]] = v
    found = _evaluate(dim, mat, step_ns, tun, tun.effect_min_frac, {d: v for d, v in rng.items()})
    if found.verdict == "culprit":
        i = next(i for i, lv in enumerate(levels) if lv.level == dim)
        levels[i] = replace(found, basis="own-groups")
        rng[dim] = found.chosen


def _search_open(level: str, scores: pl.DataFrame, coords: pl.DataFrame, rng: dict[str, int], lay,
                 step_ns: float, tun: Tunables) -> LevelFinding | None:
    """When a level shows nothing over the whole range because outer levels stayed open, look in
    each combination of the open outer coordinates separately (one group at a time, where a
    straggler is not diluted by healthy groups) and keep the clearest culprit."""
    idx = OUTER_TO_INNER.index(level)
    open_outer = [d for d in OUTER_TO_INNER[:idx] if d not in rng and getattr(lay, d) > 1]
    return _search_groups(level, scores, coords, rng, open_outer, lay, step_ns, tun) if open_outer else None


def _search_groups(level: str, scores: pl.DataFrame, coords: pl.DataFrame, rng: dict[str, int],
                   split: list[str], lay, step_ns: float, tun: Tunables) -> LevelFinding | None:
    """Evaluate the level within each combination of the ``split`` coordinates and return the
    clearest culprit; searching more groups raises the bar (``standout.margin_bar``)."""
    combos = list(itertools.product(*[range(getattr(lay, d)) for d in split]))
    # only the combinations that hold a scored rank have anything to score (a large job's scope holds
    # 128 of 16,384 ranks: 3,136 empty matrices were 0.9 s); the bar still counts every combination
    scored = scores.filter(pl.col("score").is_not_null()).select(pl.col("rank").cast(coords["rank"].dtype)).unique()
    held = set(coords.join(scored, on="rank", how="semi").select(split).unique().iter_rows()) if split else {()}
    best = None
    for combo in combos:
        if combo not in held:
            continue
        within = {**rng, **dict(zip(split, combo))}
        steps, mat = level_matrix(scores, coords, within, level, lay)
        if not steps:
            continue
        eff_min = tun.stage_effect_min_frac if _stage_wide(level, within, lay) else tun.effect_min_frac
        f = _evaluate(level, mat, step_ns, tun, eff_min, within, groups=len(combos))
        if f.verdict == "culprit" and (best is None or f.margin > best.margin):
            best = f
    return best


def _per_step(scores, coords, lay, step_ns: float, tun: Tunables) -> pl.DataFrame:
    """A plain descent on each step alone (a level stays open when nothing stands out)."""
    all_steps = sorted(set().union(*[set(s["step"].unique().to_list()) for s in scores.values()]))
    rows = []
    for t in all_steps:
        rng: dict[str, int] = {}
        first_effect = None
        for level in OUTER_TO_INNER:
            size = getattr(lay, level)
            if size == 1:
                rng[level] = 0
                continue
            s = scores[level].filter(pl.col("step") == t)
            _, mat = level_matrix(s, coords, rng, level, lay)
            if not mat.shape[0]:
                continue
            eff_min = tun.stage_effect_min_frac if _stage_wide(level, rng, lay) else tun.effect_min_frac
            top, eff, ok = standout(mat[0], step_ns, tun, eff_min)
            if ok:
                rng[level] = top
                first_effect = eff if first_effect is None else first_effect
        narrowed = any(getattr(lay, d) > 1 and d in rng for d in OUTER_TO_INNER)
        full = all(d in rng for d in OUTER_TO_INNER) and narrowed
        rows.append({"step": t, **{d: rng.get(d) if getattr(lay, d) > 1 or narrowed else None for d in OUTER_TO_INNER},
                     "culprit_rank": lay.rank_of(**rng) if full else None, "effect_ns": first_effect})
    schema = {"step": pl.Int64, "dp": pl.Int64, "pp": pl.Int64, "cp": pl.Int64, "tp": pl.Int64,
              "culprit_rank": pl.Int64, "effect_ns": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def _conclude(lay, rng: dict[str, int], levels: list[LevelFinding], step_ns: float,
              per_step: pl.DataFrame, tun: Tunables) -> Localization:
    """Turn the level findings into one verdict. An outer level whose slowest member moves from
    step to step (data imbalance) outranks anything found below it."""
    active = [lv for lv in levels if lv.verdict != "skipped"]
    if not active:  # no level had anything to compare (no multi-rank collectives, no p2p)
        return Localization("no_data", None, (), {}, 0.0, step_ns, levels, per_step)
    first = next((lv for lv in active if lv.verdict in ("culprit", "moving")), None)
    if first is not None and first.verdict == "moving":
        share = first.steps_standout / max(first.steps_total, 1)
        return Localization("moving", None, (), {}, float(share), step_ns, levels, per_step)
    found = [lv for lv in levels if lv.verdict == "culprit"]
    if found:
        dims = list(OUTER_TO_INNER)
        open_dims = [d for d in dims if d not in rng]
        ranks = tuple(r for r in range(lay.world_size)
                      if all(getattr(lay.coords(r), d) == rng[d] for d in dims if d in rng))
        conf = min(lv.steps_agree / max(lv.steps_total, 1) * (1 - math.exp(-lv.margin / tun.margin_min))
                   for lv in found)
        coords = {d: v for d, v in rng.items() if getattr(lay, d) > 1 or not open_dims}
        if not open_dims:
            return Localization("straggler", lay.rank_of(**rng), ranks, coords, float(conf), step_ns, levels, per_step)
        only_pp = [lv.level for lv in found] == ["pp"]
        verdict = "stage" if only_pp and ("dp" in open_dims or lay.dp == 1) else "group"
        return Localization(verdict, None, ranks, coords, float(conf), step_ns, levels, per_step)
    # Nothing persistent; a transient straggler (a few steps only) is looked for beside the compute
    # records (_transient).
    margins = [lv.margin for lv in active]
    conf = 1 - math.exp(-max(0.0, tun.margin_min - max(margins, default=0.0)))  # how far below the bar
    return Localization("no_straggler", None, (), {}, float(conf), step_ns, levels, per_step)
