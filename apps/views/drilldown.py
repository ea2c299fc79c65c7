"""Top-down drill-down DP -> PP -> CP -> TP: at each level the candidates' scores (how long peers
waited on them), the member chosen, and the evidence (effect, noise, margin, persistence); then
the cause with its evidence. The selected rank's coordinates are listed above the levels (the bar
charts stay as they are on a click, which keeps clicks quick)."""

from __future__ import annotations

import holoviews as hv
import panel as pn
import polars as pl

from apps.data import DashboardData
from apps.selection import Selection


def _level_md(lv) -> str:
    within = ", ".join(f"{k} {v}" for k, v in lv.within.items()) or "whole job"
    chosen = "none" if lv.chosen is None else f"{lv.level} {lv.chosen}"
    return (f"**{lv.level.upper()}** ({within}, scores from {lv.basis}): verdict **{lv.verdict}**, "
            f"chosen **{chosen}**; effect {lv.effect_ns / 1e6:.1f} ms vs noise {lv.noise_ns / 1e6:.1f} ms "
            f"(margin {lv.margin:.1f}); stood out in {lv.steps_standout}/{lv.steps_total} steps, "
            f"agreeing in {lv.steps_agree}")


def drilldown_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    def levels(run_id: str) -> pn.viewable.Viewable:
        d = data.diagnosis(run_id)
        rows: list[pn.viewable.Viewable] = []
        for lv in d.localization.levels:
            rows.append(pn.pane.Markdown(_level_md(lv), sizing_mode="stretch_width"))
            if lv.scores_ns:
                df = pl.DataFrame({"member": [str(k) for k in lv.scores_ns],
                                   "score_ms": [v / 1e6 for v in lv.scores_ns.values()],
                                   "role": ["chosen" if k == lv.chosen else "other" for k in lv.scores_ns]})
                bars = hv.Bars(df.to_pandas(), kdims=["member"], vdims=["score_ms", "role"]).opts(
                    color="role", cmap={"chosen": "crimson", "other": "grey"},
                    height=150, width=90 + 40 * len(lv.scores_ns), tools=["hover"], toolbar=None,
                    xlabel=lv.level, ylabel="waited on (ms)", show_legend=False)
                rows.append(pn.pane.HoloViews(bars))
        c = d.cause
        ev = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in c.evidence.items()
                       if v is not None)
        rows.append(pn.pane.Markdown(f"**Cause: {c.kind}** ({c.category}), ranks {list(c.ranks)}: {c.summary}"
                                     + (f"\n\nevidence: {ev}" if ev else ""), sizing_mode="stretch_width"))
        return pn.Column(*rows, sizing_mode="stretch_width")

    def mine(run_id: str, rank: int) -> pn.viewable.Viewable:
        c = data.layout(run_id).coords(rank)
        chosen = {lv.level: lv.chosen for lv in data.diagnosis(run_id).localization.levels}
        marks = ", ".join(f"{d} {getattr(c, d)}" + (" (chosen)" if chosen.get(d) == getattr(c, d) else "")
                          for d in ("dp", "pp", "cp", "tp"))
        return pn.pane.Markdown(f"selected rank {rank}: {marks}")

    return pn.Column(pn.pane.Markdown("## Top-down drill-down: DP -> PP -> CP -> TP"),
                     pn.bind(mine, sel.param.run_id, sel.param.rank),
                     pn.bind(levels, sel.param.run_id),
                     sizing_mode="stretch_width", css_classes=["tk-drilldown"])
