"""Rank x step heatmap laid out by the 4D coordinates: ranks top to bottom in [dp, pp, cp, tp]
order (outermost first, the order of global ranks), each labelled with its coordinates, white
lines between pipeline stages and thicker ones between data-parallel replicas. The
colour is step time, lateness (how long peers waited on the rank) or wait share. A click on a
cell selects its rank and step; the selected cell is outlined."""

from __future__ import annotations

import panel as pn
import polars as pl
from bokeh.events import Tap
from bokeh.models import ColorBar, ColumnDataSource, FixedTicker, HoverTool, LinearColorMapper, Range1d
from bokeh.palettes import Inferno256, Viridis256

from apps.data import DashboardData
from apps.data.heatmap import rank_step
from apps.selection import Selection
from apps.views.plots import ACCENT, bokeh_pane, new_figure

LABELS = {"step_ms": "step time (ms)", "lateness_ms": "lateness: peers waited on it (ms)",
          "wait_share": "share of the step spent waiting"}
ROW_PX = 14


class HeatmapView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.sel = data, sel
        self.frame = pl.DataFrame()
        self.steps: list[int] = []
        self.source = ColumnDataSource({c: [] for c in ("x", "rank", "value", "step", "step_ms", "lateness_ms",
                                                        "wait_share", "coords")})
        self.mapper = LinearColorMapper(palette=Inferno256, low=0, high=1)
        fig = new_figure(300, name="tk-heatmap-fig", x_axis_label="step", y_axis_label="rank: coordinates")
        cells = fig.rect("x", "rank", 1, 1, source=self.source, line_color=None,
                         fill_color={"field": "value", "transform": self.mapper})
        fig.add_tools(HoverTool(renderers=[cells], tooltips=[("rank", "@rank (@coords)"), ("step", "@step"),
                                          ("step time", "@step_ms{0.0} ms"), ("lateness", "@lateness_ms{0.0} ms"),
                                          ("wait share", "@wait_share{0%}")]))
        # lines between data-parallel replicas (thick) and pipeline stages (thin): the 4D layout
        self.bounds = ColumnDataSource({"y": [], "width": []})
        fig.hspan(y="y", line_width="width", line_color="white", source=self.bounds)
        self.marker = ColumnDataSource({"x": [], "rank": []})
        fig.rect("x", "rank", 1, 1, source=self.marker, fill_alpha=0, line_color=ACCENT, line_width=3)
        self.colorbar = ColorBar(color_mapper=self.mapper, width=12, title_text_font_size="11px")
        fig.add_layout(self.colorbar, "right")
        fig.x_range, fig.y_range = Range1d(-0.5, 0.5), Range1d(0.5, -0.5)  # ranks top to bottom
        fig.xaxis.ticker, fig.yaxis.ticker = FixedTicker(ticks=[]), FixedTicker(ticks=[])
        fig.yaxis.major_label_text_font_size = "10px"
        fig.grid.visible = False
        fig.on_event(Tap, self._tap)
        self.fig = fig
        self.heading = pn.pane.Markdown("## Rank x step", sizing_mode="stretch_width")
        metric = pn.widgets.RadioButtonGroup.from_param(sel.param.metric)
        sel.param.watch(lambda e: self._color(e.new), "metric")
        self.plot = bokeh_pane(fig, css_classes=["tk-heatmap-plot"])
        self.panel = pn.Column(self.heading, metric, self.plot,
                               sizing_mode="stretch_width", css_classes=["tk-heatmap"])

    def show_run(self, run_id: str) -> None:
        df = rank_step(self.data, run_id)
        self.heading.object = "## Rank x step" + ("" if df.height else "\n\nno per-rank step records in this run")
        self.steps = sorted(df["step"].unique().to_list())
        self.plot.visible = bool(df.height)  # an empty state is a message, not empty axes
        index = {s: i for i, s in enumerate(self.steps)}
        df = df.with_columns(pl.col("step").replace_strict(index, return_dtype=pl.Int64).alias("x"),
                             pl.format("dp {} pp {} cp {} tp {}", "dp", "pp", "cp", "tp").alias("coords"))
        self.frame = df
        ranks = sorted(df["rank"].unique().to_list())
        labels = df.unique("rank").sort("rank")
        every = max(1, -(-len(ranks) * 11 // 880))  # a label per row while 11 px rows fit in 880 px
        self.fig.yaxis.ticker.ticks = ranks[::every]
        self.fig.yaxis.major_label_overrides = {
            r: f"{r}: dp{d} pp{p} cp{c} tp{t}" for r, d, p, c, t in
            labels.select("rank", "dp", "pp", "cp", "tp").iter_rows()}
        every_step = max(1, len(self.steps) // 16)
        self.fig.xaxis.ticker.ticks = list(range(0, len(self.steps), every_step))
        self.fig.xaxis.major_label_overrides = {i: str(s) for i, s in enumerate(self.steps)}
        self.fig.x_range.update(start=-0.5, end=len(self.steps) - 0.5)
        self.fig.y_range.update(start=(max(ranks) if ranks else 0) + 0.5, end=-0.5)
        self.fig.height = max(260, min(900, ROW_PX * len(ranks) + 90))
        lay = self.data.layout(run_id)
        stage, replica = lay.cp * lay.tp, lay.pp * lay.cp * lay.tp
        thick = [r for r in range(replica, lay.world_size, replica)] if replica > 1 else []
        thin = [r for r in range(stage, lay.world_size, stage) if r % replica] if stage > 1 and lay.pp > 1 else []
        self.bounds.data = {"y": [r - 0.5 for r in thick + thin], "width": [2.5] * len(thick) + [1.0] * len(thin)}
        self.source.data = {**{c: df[c].to_numpy() for c in ("x", "rank", "step", "step_ms", "lateness_ms",
                                                             "wait_share")},
                            "coords": df["coords"].to_list(), "value": df[self.sel.metric].to_numpy()}
        self._color(self.sel.metric)

    def _color(self, metric: str) -> None:
        if not self.frame.height:
            return
        values = self.frame[metric]
        self.source.data["value"] = values.to_numpy()  # that column only
        self.mapper.update(palette=Inferno256 if metric == "lateness_ms" else Viridis256,
                           low=float(values.min()), high=float(values.max()) or 1.0)
        self.fig.title.text = LABELS[metric] + ": click a cell to select its rank and step"

    def show_focus(self, rank: int, step: int) -> None:
        x = self.steps.index(step) if step in self.steps else None
        self.marker.data = {"x": [x] if x is not None else [], "rank": [rank] if x is not None else []}

    def _tap(self, event: Tap) -> None:
        if event.x is None or event.y is None or not self.frame.height:
            return
        i, rank = round(event.x), round(event.y)
        if 0 <= i < len(self.steps) and 0 <= rank <= int(self.frame["rank"].max()):
            self.sel.param.update(rank=rank, step=self.steps[i])
