"""The whole job on one clock, ranks x time: every rank's compute, collective wait and transfer and
pipeline p2p, rasterized by Datashader on the server (the browser gets an image, whatever the
number of ranks and spans); zooming re-rasterizes the window in view until single spans show.
The findings' culprits are shaded red and their group orange (a hang: the rank that never joined
and the ranks blocked behind it); the selected rank's selected step is outlined. A click selects
the rank under it and the step it was in at that time (a HoloViews Tap stream), which moves every
other view.
"""

from __future__ import annotations

import datashader as ds
import holoviews as hv
import panel as pn
from holoviews.operation.datashader import datashade, dynspread
from bokeh.models import BoxAnnotation
from holoviews.streams import Pipe, Tap

from apps.data import DashboardData
from apps.data.jobtimeline import JOB_KINDS, job_timeline, marked_ranks, step_at, step_window
from apps.selection import Selection
from apps.views.plots import ACCENT, KIND_COLORS

hv.extension("bokeh", logo=False)
JOB_COLORS = {k: KIND_COLORS.get(k, KIND_COLORS["send"]) for k in JOB_KINDS}
EMPTY = {"x0": [], "y0": [], "x1": [], "y1": [], "kind": []}


class JobTimelineView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.sel, self.run_id, self.job = data, sel, None, None
        self.rects = Pipe(data=None)
        self.culprit_rows, self.group_rows = Pipe(data=[]), Pipe(data=[])
        # the selection's outline is a plain Bokeh annotation on the figure HoloViews made: a click
        # moves it with one small message (a HoloViews stream update cost 0.2 s of the server's time)
        self.box = BoxAnnotation(fill_alpha=0.0, line_color=ACCENT, line_width=3, line_alpha=1.0, visible=False)
        self.steps = Pipe(data=[])
        spans = hv.DynamicMap(self._rectangles, streams=[self.rects])
        shaded = dynspread(datashade(spans, aggregator=ds.count_cat("kind"), color_key=JOB_COLORS,
                                     min_alpha=120), threshold=0.3, max_px=2)
        self.tap = Tap(source=shaded, transient=True)
        self.tap.add_subscriber(self._tapped)
        culprit = hv.DynamicMap(lambda data: hv.HSpans(data, kdims=["y0", "y1"]), streams=[self.culprit_rows]).opts(
            color="crimson", alpha=0.18)
        group = hv.DynamicMap(lambda data: hv.HSpans(data, kdims=["y0", "y1"]), streams=[self.group_rows]).opts(
            color="orange", alpha=0.12)
        steps = hv.DynamicMap(lambda data: hv.VLines(data, kdims=["x"]), streams=[self.steps]).opts(
            color="#888888", line_dash="dotted", line_width=1)
        plot = (group * culprit * shaded * steps).opts(
            hv.opts.RGB(responsive=True, height=420, invert_yaxis=True, xlabel="ms from the run's first step start",
                        ylabel="rank", active_tools=["wheel_zoom"],
                        default_tools=["pan", "wheel_zoom", "box_zoom", "reset"], hooks=[self._on_figure]))
        self.title = pn.pane.Markdown("", css_classes=["tk-job-title"], sizing_mode="stretch_width")
        legend = " &nbsp; ".join(f"<span style='color:{c}'>&#9632;</span> {k}" for k, c in JOB_COLORS.items())
        legend += (" &nbsp; <span style='color:crimson'>&#9632;</span> culprit &nbsp; <span style='color:orange'>"
                   "&#9632;</span> its group &nbsp; <span style='color:%s'>&#9633;</span> selected rank and step"
                   " (zoom for spans; click to select)" % ACCENT)
        self.plot = plot
        # the HoloViews pane joins the page once it is up (attach): the page's first message does not
        # wait for the raster, which arrives a moment later
        self.pane = pn.Column(pn.pane.Markdown("rasterizing the whole job ..."), sizing_mode="stretch_width",
                              min_height=420)
        self.panel = pn.Column(self.title, self.pane, pn.pane.HTML(legend), sizing_mode="stretch_width",
                               css_classes=["tk-job-timeline"])

    def attach(self) -> None:
        """Put the rasterized plot in its place (after the page's first render, in a session)."""
        self.pane.objects = [pn.pane.HoloViews(self.plot, sizing_mode="stretch_width", css_classes=["tk-job-plot"])]

    def _on_figure(self, plot, element) -> None:
        fig = plot.state
        fig.name = "tk-job-fig"  # how tests and the benchmark find the figure in the page
        if self.box not in fig.center:
            fig.add_layout(self.box)

    @staticmethod
    def _rectangles(data) -> hv.Rectangles:
        return hv.Rectangles(EMPTY if data is None else data, kdims=["x0", "y0", "x1", "y1"], vdims=["kind"])

    def show_run(self, run_id: str) -> None:
        self.run_id = run_id
        self.job = job = job_timeline(self.data, run_id)
        culprits, group, what = marked_ranks(self.data, run_id)
        marked = (f"; culprit {'ranks' if len(culprits) > 1 else 'rank'} {', '.join(map(str, culprits))} in red, "
                  f"{what} ({len(group)} ranks) in orange") if culprits else "; no culprit to mark"
        if job.spans:
            self.title.object = (f"## Whole job: {job.ranks} ranks x {job.steps['step'].n_unique()} steps, "
                                 f"{job.spans:,} spans{marked}")
        else:
            self.title.object = "## Whole job\n\nno spans recorded in this run"
        self.pane.visible = bool(job.spans)
        first = job.steps.filter(job.steps["rank"] == job.steps["rank"].min()) if job.steps.height else job.steps
        self.rects.send(job.rects)
        self.culprit_rows.send([(r - 0.5, r + 0.5) for r in culprits])
        self.group_rows.send([(r - 0.5, r + 0.5) for r in group])
        self.steps.send(first["start_ms"].to_list() if first.height else [])

    def show_focus(self, rank: int, step: int) -> None:
        if self.job is None:
            return
        win = step_window(self.job, rank, step)
        self.box.visible = win is not None
        if win is not None:
            self.box.update(left=win[0], right=win[1], bottom=rank - 0.5, top=rank + 0.5)

    def _tapped(self, x=None, y=None, **_) -> None:
        if x is None or y is None or self.job is None or not self.job.ranks:
            return
        rank = int(round(y))
        if not 0 <= rank < self.data.layout(self.run_id).world_size:
            return
        step = step_at(self.job, rank, x)
        if step is not None:
            self.sel.param.update(rank=rank, step=step)
