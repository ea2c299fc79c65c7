"""Stage imbalance as findings: a pipeline stage whose compute exceeds the median stage in every
replica (``rootcause.stage_ratios``), and when such a finding is in doubt. Wherever the stage's
ranks could all be slow devices (no replica repeats the stage, or it has two ranks in all), more
work and slower devices read the same in compute, so the finding is capped and says why."""

from __future__ import annotations

import polars as pl

from tracekit.analysis.findings import NEXT_STEP, Finding
from tracekit.analysis.rootcause import stage_ratios
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables

STAGE_DOUBT_CONFIDENCE = 0.7  # a stage imbalance that slower devices on its ranks would read the same as
STAGE_FEW_RANKS = 2  # a stage of this many ranks in all (one per replica, two replicas) is such a stage


def stages_alone(tables: RunTables) -> bool:
    """A pipeline that no other replica repeats (dp = 1, pp > 1): nothing else does a stage's work."""
    lay = tables.layout
    return lay.dp == 1 and lay.pp > 1


def stage_doubt(tables: RunTables, ranks: tuple[int, ...]) -> str:
    """Why a stage imbalance on ``ranks`` may be slow devices instead ("" where it cannot be):
    - one replica (dp 1): no rank does the stage's work elsewhere, so one slow host holding it reads
      the same as more layers; 3 such answers at 0.95 were slow hosts (fault grid, kind host, draws
      29 and 30), the only findings at >= 0.9 wrong there;
    - two ranks in all: two culprits of tp 1 x cp 1 x pp 8 x dp 2 land on one stage's only ranks in
      1 of 15 draws, and one such hold-out case (kind two, draw 29) read "stage imbalance" at 0.95."""
    if stages_alone(tables):
        return ("in doubt: with one replica (dp 1) no other rank does this stage's work, so slower devices on "
                "all of its ranks (one slow host) read the same as more work")
    if len(ranks) <= STAGE_FEW_RANKS:
        return (f"in doubt: the stage has {len(ranks)} ranks in all (ranks {', '.join(map(str, ranks))}), so "
                "slower devices on each of them read the same as more work")
    return ""


def stage_findings(tables: RunTables, metrics: pl.DataFrame, tun: Tunables, step_ns: float) -> list[Finding]:
    """A finding per stage that computes ``stage_compute_ratio`` x the median stage in ``persist_min``
    of the steps, in every replica."""
    lay = tables.layout
    if lay.pp < 2:
        return []
    out = []
    for stage, ratio, excess_ns, share in stage_ratios(metrics, tables, tun.stage_compute_ratio):
        if ratio >= tun.stage_compute_ratio and share >= tun.persist_min:
            ranks = tuple(r for r in range(lay.world_size) if lay.coords(r).pp == stage)
            members = f"ranks {list(ranks)}" if len(ranks) <= 16 else f"{len(ranks):,} ranks: pp {stage} of every replica"
            doubt = stage_doubt(tables, ranks)
            sure = min(0.95, share, STAGE_DOUBT_CONFIDENCE if doubt else 1.0)
            out.append(Finding("stage_imbalance", ranks, f"pipeline stage {stage} ({members})", (), excess_ns,
                               excess_ns / step_ns, sure, "stage_imbalance",
                               f"pipeline stage {stage} computes {ratio:.2f}x the median stage in every replica"
                               + (f"; {doubt}" if doubt else ""),
                               NEXT_STEP["stage_imbalance"].format(who=stage),
                               {"stage": stage, "stage_compute_ratio": ratio, "steps_share": share}))
    return out
