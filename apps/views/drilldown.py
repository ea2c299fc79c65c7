"""Top-down drill-down DP -> PP -> CP -> TP, as the localizer walked it: at each level the
candidates' scores (how long peers waited on them) as bars, the member chosen, and the evidence
(effect against noise, margin, steps it stood out in); then the cause with its evidence. The
selected rank's coordinate is marked at every level. Plain HTML: a rank change rewrites one
string, no plot is rebuilt."""

from __future__ import annotations

import html

import panel as pn

from apps.data import DashboardData
from apps.selection import Selection
from apps.views.plots import ACCENT, CULPRIT

STYLE = f"""<style>
.tk-dd-level, .tk-dd-text {{ overflow-wrap: anywhere; white-space: normal; max-width: 100%; }}
.tk-dd-level {{ margin: 6px 0 10px 0; }}
.tk-dd-bars {{ display: grid; grid-template-columns: max-content minmax(80px, 320px) max-content;
  gap: 2px 8px; align-items: center; font-size: 12px; margin-top: 4px; }}
.tk-dd-bar {{ height: 12px; background: #9a9a9a; min-width: 1px; }}
.tk-dd-bar.chosen {{ background: {CULPRIT}; }}
.tk-dd-sel {{ outline: 2px solid {ACCENT}; outline-offset: 1px; }}
</style>"""


MAX_MEMBERS = 16  # bars per level; a wide level shows its highest scores, the chosen and the selected


def _members_shown(lv, selected: int) -> set[int]:
    ranked = sorted(lv.scores_ns, key=lambda k: lv.scores_ns[k], reverse=True)
    return set(ranked[:MAX_MEMBERS]) | {m for m in (lv.chosen, selected) if m in lv.scores_ns}


def _level_html(lv, selected: int) -> str:
    within = ", ".join(f"{k} {v}" for k, v in lv.within.items()) or "whole job"
    chosen = "none" if lv.chosen is None else f"{lv.level} {lv.chosen}"
    head = (f"<b>{lv.level.upper()}</b> ({html.escape(within)}, scores from {html.escape(lv.basis)}): verdict "
            f"<b>{lv.verdict}</b>, chosen <b>{chosen}</b>; effect {lv.effect_ns / 1e6:.1f} ms vs noise "
            f"{lv.noise_ns / 1e6:.1f} ms (margin {lv.margin:.1f}); stood out in {lv.steps_standout}/"
            f"{lv.steps_total} steps, agreeing in {lv.steps_agree}")
    rows = []
    top = max((abs(v) for v in lv.scores_ns.values()), default=0.0) or 1.0
    shown = _members_shown(lv, selected)
    for member, score in lv.scores_ns.items():
        if member not in shown:
            continue
        cls = "tk-dd-bar chosen" if member == lv.chosen else "tk-dd-bar"
        mark = " tk-dd-sel" if member == selected else ""
        note = " (selected rank's)" if member == selected else ""
        rows.append(f"<span>{lv.level} {member}{note}</span><div class='{cls}{mark}' "
                    f"style='width:{max(score, 0) / top * 100:.1f}%'></div><span>{score / 1e6:.1f} ms</span>")
    if len(shown) < len(lv.scores_ns):
        rows.append(f"<span>({len(lv.scores_ns) - len(shown)} more, lower)</span><span></span><span></span>")
    bars = f"<div class='tk-dd-bars'>{''.join(rows)}</div>" if rows else ""
    return f"<div class='tk-dd-level'>{head}{bars}</div>"


class DrilldownView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.run_id = data, None
        self.body = pn.pane.HTML("", sizing_mode="stretch_width", styles={"overflow-wrap": "anywhere", "min-width": "0"})
        self.panel = pn.Column(self.body,
                               sizing_mode="stretch_width", css_classes=["tk-drilldown"])

    def show_run(self, run_id: str) -> None:
        self.run_id = run_id

    def show_focus(self, rank: int, step: int) -> None:
        d = self.data.diagnosis(self.run_id)
        c = self.data.coords(self.run_id, rank)
        chosen = {lv.level: lv.chosen for lv in d.localization.levels}
        marks = ", ".join(f"{dim} {getattr(c, dim)}" + (" (chosen)" if chosen.get(dim) == getattr(c, dim) else "")
                          for dim in ("dp", "pp", "cp", "tp"))
        parts = [STYLE, "<h2>Top-down drill-down: DP -&gt; PP -&gt; CP -&gt; TP</h2>", f"<p class='tk-dd-text'>selected rank {rank}: {marks}</p>"]
        parts += [_level_html(lv, getattr(c, lv.level)) for lv in d.localization.levels]
        cause = d.cause
        ev = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in cause.evidence.items()
                       if v is not None)
        parts.append(f"<p class='tk-dd-text'><b>Cause: {html.escape(cause.kind)}</b> ({cause.category}), ranks {list(cause.ranks)}: "
                     f"{html.escape(cause.summary)}" + (f"<br>evidence: {html.escape(ev)}" if ev else "") + "</p>")
        self.body.object = "".join(parts)
