"""Rank x step heatmap laid out by the 4D coordinates: ranks in [dp, pp, cp, tp] order (outermost
first, the order of global ranks), labelled with their coordinates. A click selects rank and step."""

from __future__ import annotations

import holoviews as hv
import panel as pn
import polars as pl

from apps.data import DashboardData
from apps.selection import Selection

LABELS = {"step_ms": "step time (ms)", "lateness_ms": "lateness: peers waited on it (ms)",
          "wait_share": "share of the step spent waiting"}


def heatmap_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    cache: dict[str, pl.DataFrame] = {}

    def frame(run_id: str) -> pl.DataFrame:
        if run_id not in cache:
            cache[run_id] = data.rank_step(run_id)
        return cache[run_id]

    def plot(run_id: str, metric: str) -> pn.viewable.Viewable:
        df = frame(run_id)
        if not df.height:
            return pn.pane.Markdown("no per-rank step records in this run")
        steps = sorted(df["step"].unique().to_list())
        index = {s: i for i, s in enumerate(steps)}
        df = df.with_columns(pl.col("step").replace_strict(index).alias("step_index"))
        ranks = sorted(df["rank"].unique().to_list())
        co = df.unique("rank").sort("rank")
        yticks = [(r, f"{r}: dp{d} pp{p} cp{c} tp{t}") for r, d, p, c, t in
                  co.select("rank", "dp", "pp", "cp", "tp").iter_rows()]
        every = max(1, len(steps) // 12)
        xticks = [(i, str(s)) for i, s in enumerate(steps) if i % every == 0]
        hm = hv.HeatMap(df.to_pandas(), kdims=["step_index", "rank"],
                        vdims=[metric, "step", "step_ms", "lateness_ms", "wait_share", "dp", "pp", "cp", "tp"])
        hm = hm.opts(cmap="viridis" if metric != "lateness_ms" else "inferno", colorbar=True,
                     tools=["hover", "tap"], xticks=xticks, yticks=yticks, invert_yaxis=True,
                     xlabel="step", ylabel="rank: coordinates", title=LABELS[metric],
                     height=max(260, min(900, 14 * len(ranks) + 90)), responsive=True,
                     toolbar="above", default_tools=[], active_tools=["tap"],
                     nonselection_alpha=1.0, selection_alpha=1.0)
        tap = hv.streams.Tap(source=hm, x=None, y=None)

        def on_tap(x: float | None, y: float | None) -> None:
            if x is None or y is None:
                return
            i, r = round(x), round(y)
            if 0 <= i < len(steps) and r in ranks:
                sel.param.update(rank=r, step=steps[i])

        tap.add_subscriber(on_tap)

        def marker(rank: int, step: int) -> hv.Points:
            pts = [(index[step], rank)] if step in index else []
            return hv.Points(pts, ["step_index", "rank"]).opts(marker="square", size=14, fill_alpha=0,
                                                                 line_color="cyan", line_width=3)

        mark = hv.DynamicMap(pn.bind(marker, sel.param.rank, sel.param.step))
        return pn.pane.HoloViews(hm * mark, sizing_mode="stretch_width", css_classes=["tk-heatmap-plot"])

    metric = pn.widgets.RadioButtonGroup.from_param(sel.param.metric, button_type="default")
    return pn.Column(pn.pane.Markdown("## Rank x step"), metric, pn.bind(plot, sel.param.run_id, sel.param.metric),
                     sizing_mode="stretch_width", css_classes=["tk-heatmap"])
