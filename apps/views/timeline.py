"""Timeline of one step: the selected rank against a healthy peer at the same position, lane by
lane (compute, collectives split into wait and transfer, pipeline sends and receives), in ms from
when the selected rank began the step (the memory view uses the same origin).

A crowded lane arrives as an occupancy raster (apps/data/timeline.py); zooming in asks the server
for the narrower window, where it resolves into its spans."""

from __future__ import annotations

import panel as pn
import polars as pl
from bokeh.events import RangesUpdate, Tap
from bokeh.models import ColumnDataSource, FixedTicker, HoverTool, Range1d
from bokeh.transform import factor_cmap

from apps.data import DashboardData
from apps.data.timeline import healthy_peer, lane_glyphs, step_spans
from apps.selection import Selection
from apps.views.plots import KIND_COLORS, bokeh_pane, ms, new_figure

LANES = ("compute", "collective", "p2p")
ROWS = [(who, lane) for who in ("selected", "peer") for lane in LANES]
Y = {k: len(ROWS) - i for i, k in enumerate(ROWS)}  # selected rank on top
COLUMNS = ("left", "right", "bottom", "top", "kind", "name", "rank", "lane", "dur", "spans")


class TimelineView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.sel, self.run_id = data, sel, None
        self.spans = pl.DataFrame()
        self.focus: tuple[int, int | None, int] | None = None  # rank, peer, step
        self.window: tuple[float, float] | None = None  # the window the glyphs were made for (None: all)
        self.extent = (0.0, 1.0)  # the step's time range (ms): the x range after a click
        self.rastered = False
        self._pending = 0
        self.source = ColumnDataSource({c: [] for c in COLUMNS})
        fig = new_figure(300, name="tk-timeline-fig", tools="xpan,xwheel_zoom,xbox_zoom,reset", x_axis_label="ms from the selected rank's step start", y_range=Range1d(0.4, len(ROWS) + 0.6),
                         x_range=Range1d(0, 1))
        fig.quad(left="left", right="right", bottom="bottom", top="top", source=self.source, line_alpha=0,
                 fill_color=factor_cmap("kind", list(KIND_COLORS.values()), list(KIND_COLORS)))
        fig.add_tools(HoverTool(tooltips=[("", "@kind: @name"), ("rank", "@rank (@lane)"),
                                          ("at", "@left{0.000} .. @right{0.000} ms"), ("lasts", "@dur{0.000} ms")]))
        fig.yaxis.ticker = FixedTicker(ticks=sorted(Y.values()))
        fig.yaxis.major_label_text_font_size = "11px"
        fig.ygrid.visible = False
        fig.on_event(RangesUpdate, self._zoomed)
        fig.on_event(Tap, self._tap)
        self.fig = fig
        self.title = pn.pane.Markdown("", css_classes=["tk-timeline-title"], sizing_mode="stretch_width")
        legend = " &nbsp; ".join(f"<span style='color:{c}'>&#9632;</span> {k}" for k, c in KIND_COLORS.items())
        legend += " &nbsp; (click the peer's lanes to select the peer)"
        self.plot = bokeh_pane(fig)
        self.panel = pn.Column(self.title, self.plot, pn.pane.HTML(legend + " &nbsp; (a lane too crowded "
                                                                             "to draw span by span shows how busy "
                                                                             "each pixel was; zoom in for spans)"),
                               sizing_mode="stretch_width", css_classes=["tk-timeline"])

    def show_run(self, run_id: str) -> None:
        self.run_id = run_id

    def show_focus(self, rank: int, step: int) -> None:
        peer = healthy_peer(self.data, self.run_id, rank)
        ranks = [rank] + ([peer] if peer is not None else [])
        self.focus = (rank, peer, step)
        self.spans, _ = step_spans(self.data, self.run_id, ranks, step)
        who = f"rank {rank}" + (f" vs healthy peer rank {peer}" if peer is not None else " (no peer)")
        self.title.object = (f"## Timeline: selected rank vs a healthy peer\n\n**Timeline: step {step}, {who}**\n\n"
                             + self._totals(ranks, step))
        self.fig.yaxis.major_label_overrides = {
            Y[(w, lane)]: f"{w} {'-' if r is None else r} {lane}" for w, r in (("selected", rank), ("peer", peer))
            for lane in LANES}
        self.plot.visible = bool(self.spans.height)  # an empty state is a message, not empty axes
        self._draw(None)
        lo, hi = (float(self.spans["start_ms"].min()), float(self.spans["end_ms"].max())) if self.spans.height \
            else (0.0, 1.0)
        pad = (hi - lo) * 0.01 or 1.0
        self.extent = (lo - pad, hi + pad)
        self.fig.x_range.update(start=lo - pad, end=hi + pad, reset_start=lo - pad, reset_end=hi + pad)

    def _totals(self, ranks: list[int], step: int) -> str:
        if not self.spans.height:
            return f"no spans recorded for these ranks in step {step}"
        totals = self.spans.group_by("rank", "kind").agg((pl.col("end_ms") - pl.col("start_ms")).sum().alias("t"))
        return "; ".join(f"rank {r}: " + ", ".join(f"{k} {ms(t)}" for _, k, t in
                                                   totals.filter(pl.col("rank") == r).sort("kind").iter_rows())
                         for r in ranks)

    def _draw(self, window: tuple[float, float] | None) -> None:
        glyphs, self.rastered = lane_glyphs(self.spans, window)
        self.window = window
        rank = self.focus[0]
        g = glyphs.with_columns(pl.when(pl.col("rank") == rank).then(pl.lit("selected")).otherwise(pl.lit("peer"))
                                .alias("who"))
        g = g.with_columns(pl.concat_str("who", pl.lit("|"), "lane").replace_strict(
            {f"{w}|{ln}": y for (w, ln), y in Y.items()}, return_dtype=pl.Float64).alias("y"))
        # a raster's kinds stack within their bin; a span fills its lane's height
        g = g.sort("y", "start_ms", "kind").with_columns(
            pl.when(pl.col("binned")).then(pl.col("share").cum_sum().over("y", "start_ms", "binned") - pl.col("share"))
            .otherwise(0.0).alias("below"))
        g = g.with_columns((pl.col("y") - 0.4 + 0.8 * pl.col("below")).alias("bottom")).with_columns(
            (pl.col("bottom") + 0.8 * pl.col("share")).alias("top"))
        self.source.data = {"left": g["start_ms"].to_numpy(), "right": g["end_ms"].to_numpy(),
                            "bottom": g["bottom"].to_numpy(), "top": g["top"].to_numpy(),
                            "kind": g["kind"].to_list(), "name": g["name"].to_list(), "rank": g["rank"].to_numpy(),
                            "lane": g["lane"].to_list(), "dur": (g["end_ms"] - g["start_ms"]).to_numpy(),
                            "spans": g["spans"].to_numpy()}

    def _tap(self, event: Tap) -> None:
        """A click on the peer's lanes selects the peer (same step): every view follows."""
        if event.y is None or self.focus is None or self.focus[1] is None:
            return
        if min(Y[("peer", lane)] for lane in LANES) - 0.5 <= event.y <= max(Y[("peer", lane)] for lane in LANES) + 0.5:
            self.sel.rank = self.focus[1]

    def _zoomed(self, event: RangesUpdate) -> None:
        """Re-bin crowded lanes for the window in view, once the zoom or pan has settled."""
        whole = event.x0 <= self.extent[0] + 1e-9 and event.x1 >= self.extent[1] - 1e-9
        if self.window is None and (whole or not self.rastered):
            return  # what is drawn already holds everything in view (this also ends each click's echo)
        self._pending += 1
        ticket, doc = self._pending, self.fig.document
        window = None if whole else (event.x0, event.x1)

        def apply() -> None:
            if ticket == self._pending and self.focus is not None:
                self._draw(window)
        if doc is not None:
            doc.add_timeout_callback(apply, 200)
