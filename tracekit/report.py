"""The whole analysis of one run in one object (what ``tracekit report`` renders), and its markdown.

The library builds data and text; the CLI (``tracekit.cli.analysis``) prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tracekit.layout_infer import ASSUMED_LAYOUTS

if TYPE_CHECKING:
    from tracekit.analysis.cp_wait import CPWait
    from tracekit.analysis.hangs import HangReport
    from tracekit.analysis.diagnosis import Diagnosis
    from tracekit.analysis.steps import StepReport
    from tracekit.store import Store

PARTS = ("stragglers", "steps", "cp_wait", "hangs")


@dataclass(frozen=True)
class Findings:
    run_id: str
    diagnosis: Diagnosis | None = None
    steps: StepReport | None = None
    cp_wait: CPWait | None = None
    hangs: HangReport | None = None
    layout_source: str | None = None  # "assumed-dp" / "assumed-pp" when the run had no layout
    skipped: dict[str, str] | None = None  # part -> why it could not be analysed
    layout_note: str | None = None  # why the inferred layout may be wrong (ingest's warning)
    damaged: dict[int, str] | None = None  # ranks without data: named by every analysis, never judged

    @property
    def any_finding(self) -> bool:
        """Something a ``--check`` should fail on."""
        return bool(
            (self.diagnosis is not None and self.diagnosis.localization.verdict not in ("no_straggler", "no_data"))
            or (self.steps is not None and self.steps.slow)
            or (self.cp_wait is not None and self.cp_wait.cause not in ("none", "no_cp"))
            or (self.hangs is not None and self.hangs.hung))

    def to_dict(self) -> dict:
        out: dict = {"run_id": self.run_id, "finding": self.any_finding, "layout_source": self.layout_source,
                     "layout_note": self.layout_note, "skipped": self.skipped or {},
                     "damaged": {str(r): why for r, why in (self.damaged or {}).items()}}
        for name, part in (("stragglers", self.diagnosis), ("steps", self.steps), ("cp_wait", self.cp_wait),
                           ("hangs", self.hangs)):
            if part is not None:
                out[name] = part.to_dict()
        return out


def gather(store: Store, run_id: str | None = None, parts: tuple[str, ...] = PARTS) -> Findings:
    """Run the named analyses (``PARTS``) on one run of the store (the newest by default)."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown report parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    rid = run_id or store.newest_run()
    methods = {"stragglers": store.diagnose, "steps": store.steps, "cp_wait": store.cp_wait, "hangs": store.hangs}
    results, skipped = {}, {}
    for part in parts:
        try:
            results[part] = methods[part](rid)
        except ValueError as e:  # tables this analysis cannot work from; the others still run
            skipped[part] = str(e)
    layout = store.layout_source(rid)
    notes = store.sql("SELECT error FROM ingest_log WHERE run_id = $rid AND status = 'warning' AND error LIKE 'layout %'",
                      {"rid": rid})
    return Findings(run_id=rid, diagnosis=results.get("stragglers"), steps=results.get("steps"),
                    cp_wait=results.get("cp_wait"), hangs=results.get("hangs"), layout_source=layout,
                    skipped=skipped, layout_note=notes["error"][0] if notes.height else None,
                    damaged=store.damaged_ranks(rid))


def markdown(f: Findings) -> str:
    """The findings as a markdown report."""
    lines = [f"# tracekit report: {f.run_id}", ""]
    if f.layout_note:
        lines += [f"_warning: {f.layout_note}_", ""]
    if f.damaged:
        lines += ["_not judged (no data): " + "; ".join(f"rank {r}: {why}" for r, why in sorted(f.damaged.items()))
                  + "_", ""]
    if f.layout_source in ASSUMED_LAYOUTS:
        lines += [f"_{ASSUMED_LAYOUTS[f.layout_source][0].upper()}{ASSUMED_LAYOUTS[f.layout_source][1:]}._", ""]
    for part, why in (f.skipped or {}).items():
        lines += [f"_{part}: not analysed: {why}_", ""]
    if f.diagnosis is not None:
        loc = f.diagnosis.localization
        lines += ["## Stragglers", "", f"**{f.diagnosis.headline}**", ""]
        if f.diagnosis.scope is not None:
            lines += [f"_{f.diagnosis.scope.summary}_", ""]
        if f.diagnosis.findings:
            lines += ["| finding | where | ms/step | of step | steps | confidence | next step |", "|---|---|---|---|---|---|---|"]
            lines += [f"| {x.kind} ({x.cause}) | {x.where} | {'<= ' if x.cost_upper_bound else ''}{x.cost_ns / 1e6:.1f} | "
                      f"{x.cost_share:.1%} | "
                      f"{','.join(map(str, x.steps)) if x.kind in ('transient', 'moving') else 'all'} | "
                      f"{x.confidence:.2f} | {x.next_step} |" for x in f.diagnosis.findings]
            lines.append("")
        lines += ["| level | verdict | chosen | margin | steps agree | effect ms | noise ms |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {lv.level} | {lv.verdict} | {lv.chosen} | {lv.margin:.1f} | {lv.steps_agree}/{lv.steps_total} "
                  f"| {lv.effect_ns / 1e6:.2f} | {lv.noise_ns / 1e6:.2f} |" for lv in loc.levels]
        lines.append("")
    if f.steps is not None:
        lines += ["## Steps", "", f.steps.headline, ""]
        if f.steps.slow:
            lines += ["| step | ms | excess ms | cause | ranks | why |", "|---|---|---|---|---|---|"]
            lines += [f"| {s.step} | {s.step_ns / 1e6:.1f} | {s.excess_ns / 1e6:.1f} | {s.cause} | "
                      f"{','.join(map(str, s.ranks))} | {s.summary} |" for s in f.steps.slow]
            lines.append("")
    if f.cp_wait is not None:
        lines += ["## CP wait", "", f.cp_wait.headline, ""]
    if f.hangs is not None:
        lines += ["## Hangs", "", f.hangs.headline, ""]
    return "\n".join(lines)
