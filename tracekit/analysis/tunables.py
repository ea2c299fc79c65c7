"""Every threshold the straggler analyses use, in one place."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tunables:
    # A member stands out at a level when its score beats the healthy peers' median by this many
    # noise units (robust spread of the others, floored below) ...
    margin_min: float = 4.0
    # ... the noise unit is never taken below this fraction of the median step time ...
    noise_floor_frac: float = 0.001
    # ... and its lateness is at least this fraction of the step time (smaller costs nothing).
    effect_min_frac: float = 0.005
    # The largest of many noisy scores is large by chance: with n members competing for the top
    # (all candidates of all groups searched), the bar is margin_min + this * ln(n / 2). A level
    # that shows nothing over its whole range is also searched group by group (each combination
    # of the open outer coordinates), which counts every group's members.
    margin_per_log: float = 1.5
    # A culprit must be the top member in at least this share of all steps, or of the steps in
    # which the level stands out.
    persist_min: float = 0.6
    # "Moving" straggler: a standout in at least this share of steps, but not the same member (none
    # holds the top in persist_min of those steps);
    # it is data imbalance when the late member had more compute in this share of those steps.
    moving_min_share: float = 0.5
    moving_explained_min: float = 0.5
    # ... and, where compute spans were recorded, the standout member's extra compute explains
    # moving_explained_min of the wait it caused in this share of those steps (else: noise).
    moving_compute_agree_min: float = 0.7
    # "Transient": nothing persists, but one rank, named in at least two steps, holds this share of
    # the lateness (effect) of all the steps that name a rank, and its compute stood out in the steps
    # carrying moving_compute_agree_min of its lateness.
    transient_share_min: float = 0.8
    # Moving and transient stragglers are only reported when their per-step effect (median over
    # the steps concerned) is at least this share of the step: below it, it is timing noise.
    episode_effect_min_frac: float = 0.02
    # A culprit the cause analysis cannot explain (its compute, gaps and links are normal) is only
    # reported above this effect (share of the step): below, it is systematic timing noise.
    unexplained_effect_min_frac: float = 0.05
    # A stage across all replicas is only called out above this effect (pipelines are uneven).
    stage_effect_min_frac: float = 0.05
    # Cause thresholds: compute slower than same-position peers by this ratio is "slow compute".
    slow_compute_ratio: float = 1.03
    # CPU gaps (time neither computing nor communicating) above peers by this share of the step.
    cpu_gap_frac: float = 0.03
    # A link is slow when its median transfer (end minus last arrival) is this many times the same
    # kind's elsewhere (a large transfer, e.g. a DP all-gather, delayed by a few ms is only 1.06x
    # slower yet costs several % of a step: the cost floor below is what keeps small ones out), its instances rank above the others' (one-sided Mann-Whitney) beyond the
    # Bonferroni bar for link_alpha over all links (and at least link_z_min) (links.py) ...
    slow_link_ratio: float = 1.05
    link_alpha: float = 0.001
    link_z_min: float = 3.0
    # ... and the link's excess transfer time costs at least this share of a step, or, for a link
    # link_broken_ratio x slower than its kind elsewhere, link_broken_min_frac: a link that slow is
    # broken (a port fallen back to a slower path) whatever it costs today (at 16,384 ranks a DP
    # group's link 8.2x slower cost 0.9% of a 4.5 s step and was no finding). Not on a CPU
    # transport (gloo), where a "link" within a host is its processes' share of the cores.
    link_effect_min_frac: float = 0.01
    link_broken_ratio: float = 3.0
    link_broken_min_frac: float = 0.002
    # a "no straggler" answer names the ranks whose p2p ops the link level could not measure when
    # fewer than this share of p2p ops entered a transfer (its confidence scales with the share)
    p2p_coverage_note: float = 0.95
    # Spread (coefficient of variation) of a rank's per-micro-batch compute within a step, above
    # its peers' spread by this much: the extra compute is uneven work (data), not a slow device.
    data_cv_min: float = 0.10
    # Extra compute all in attention kernels (others within half the work_explains_share of it) is
    # data imbalance when the attention kernels take at least this ratio of their peers'.
    attention_imbalance_ratio: float = 1.10
    # A stage whose compute exceeds the median stage's by this ratio is heavier work.
    stage_compute_ratio: float = 1.15
    # Known attention work explains extra compute when the work excess is at least this share of
    # the compute excess (work ratio - 1 >= share * (compute ratio - 1)).
    work_explains_share: float = 0.5
    # ... and only when compute demonstrably follows work: the fitted slope is positive by this many
    # standard errors (a dense kernel whose cost ignores the mask fits a slope of noise).
    work_fit_t_min: float = 3.0
    # Steps: a step is slow when the job's step time exceeds the median step by this ratio and by
    # this many robust spreads (MAD x 1.4826) of the step times.
    slow_step_ratio: float = 1.10
    slow_step_spreads: float = 3.0
    # CP wait: a member's wait counts as explained by compute imbalance up to the compute it lacked
    # against the CP group's slowest member; the imbalance is called the cause above this share.
    cp_explained_min: float = 0.5

    # Large jobs (scope.py): at and above this many ranks the diagnosis reads a scope chosen top-down
    # from aggregates: per level the top scope_candidates ranks (replicas) whose score reaches the bar
    # (robust z over all ranks: persistent over the steps' mean, or in one step), each with the same
    # cells of enough reference replicas to give scope_min_peers peers per stage.
    scope_above_ranks: int = 256
    scope_candidates: int = 4
    scope_z_persistent: float = 4.0
    scope_z_step: float = 5.0
    scope_min_peers: int = 8

    # Compute speed (compute_speed.py): a rank computes persistently slower than its same-stage
    # peers when the median per-step excess of its log compute ratio reaches this many noise units
    # (bar rising with the ranks compared, as margin_per_log), is at least this ratio, and holds in
    # persist_min of the steps; fewer steps than compute_min_steps are not evidence. The noise unit
    # is never taken below compute_noise_floor (log ratio).
    compute_margin_min: float = 3.0
    compute_margin_per_log: float = 1.0
    # culprits.py's persistent test (its noise unit: the larger of the standard error over steps and
    # the biweight spread of the other ranks' means) has a bar of culprit_margin_min +
    # compute_margin_per_log * ln(ranks / 2) up to culprit_margin_knee ranks (3.64 at 8), and beyond
    # them rises by culprit_margin_per_log * ln(ranks / knee) only: past 8 ranks the guard is measured
    # over many ranks, and the bar need only rise as a Bonferroni z does (by 0.2 from 8 to 16 ranks).
    # It rose by a whole ln(ranks / 2) before (4.33 at 16), and 16-rank runs lost 3% ranks standing
    # 4.0-4.3 units out. Measured (docs/analysis.md): the fault grid's published draws, 1.03x found
    # 414 -> 426 of 480, clean runs naming a rank 1 -> 3 of 1,440; benchmarks/culprit_bar.py's 800
    # runs, 162 -> 165 of 187, clean runs naming a rank once chips differ by 1% 4 -> 6 of 402
    culprit_margin_min: float = 2.25
    culprit_margin_knee: int = 8
    culprit_margin_per_log: float = 0.3
    # hosts.py's whole-host test: host_margin_min + compute_margin_per_log * ln(hosts / 2)
    host_margin_min: float = 2.25
    compute_effect_min_ratio: float = 1.02
    # Where fewer than culprits.GUARD_MIN_RANKS other ranks do the same work, their own spread (the
    # guard against ranks that differ for reasons that are not a fault) cannot be measured: a
    # persistent slowdown below this ratio is then put in doubt (confidence at most 0.5). A clean
    # 2-rank torch-native job on a shared 2-core host had one process 3% slower in every step (0.99).
    few_ranks_min_ratio: float = 1.10
    compute_min_steps: int = 4
    compute_noise_floor: float = 0.003
    # Episodes (culprits.py): a single (step, rank) cell stands out when its log compute excess
    # clears the normal quantile of 1 - episode_alpha / cells (Bonferroni over every cell) in
    # scatter units, and this ratio.
    episode_alpha: float = 0.01
    episode_min_ratio: float = 1.08

    def to_dict(self) -> dict:
        return asdict(self)
