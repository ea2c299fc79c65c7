"""Memory of the selected rank over time (allocated MiB) with the estimator's prediction for that
rank as a line beside it. When the snapshot's times are on the steps' clock, the x axis is the
timeline's (ms from the selected rank's step start), step starts are marked and the selected step
shaded; otherwise time runs from the first recorded allocation and the plot says why."""

from __future__ import annotations

import html

import pandas as pd
import panel as pn
import polars as pl
from bokeh.events import Tap
from bokeh.models import BoxAnnotation, ColumnDataSource, HoverTool, Range1d, Span

from apps.data import DashboardData
from apps.data.memory import estimate_mib, memory_ranks, rank_curve
from apps.selection import Selection
from apps.views.plots import ACCENT, CULPRIT, bokeh_pane, new_figure


# the hover: the event and the whole stack of the allocation (innermost first), as memory_viz shows it
STACK_TOOLTIP = """<div class="tk-memory-hover" style="max-width: 560px">
<div>@t_ms{0.00} ms: <b>@allocated_mib{0.000} MiB</b> allocated; @action @size_kib{0,0.0} KiB</div>
<div>allocated by <b>@frame</b></div>
<pre style="font-size: 10px; margin: 2px 0 0 0; white-space: pre-wrap">@stack</pre></div>"""


class MemoryView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.sel, self.run_id, self.ranks = data, sel, None, []
        self.step_windows: list[tuple[int, float, float]] = []  # step, start, end (ms on the x axis)
        self.source = ColumnDataSource({"t_ms": [], "allocated_mib": [], "action": [], "size_kib": [], "frame": [],
                                        "stack": []})
        self.step_starts = ColumnDataSource({"x": [], "step": []})
        fig = new_figure(240, name="tk-memory-fig", tools="xpan,xwheel_zoom,reset", title="allocated memory (MiB)", y_range=Range1d(0, 1), y_axis_label="MiB")
        line = fig.line("t_ms", "allocated_mib", source=self.source, line_width=1.5, color="#4c78a8")
        fig.add_tools(HoverTool(renderers=[line], mode="vline", tooltips=STACK_TOOLTIP))
        fig.vspan(x="x", source=self.step_starts, line_color="#888888", line_dash="dotted")
        self.window = BoxAnnotation(fill_color=ACCENT, fill_alpha=0.12, line_alpha=0, visible=False)
        fig.add_layout(self.window)
        self.estimate = Span(location=0, dimension="width", line_color=CULPRIT, line_dash="dashed", line_width=2,
                             visible=False)
        fig.add_layout(self.estimate)
        fig.on_event(Tap, self._tap)
        self.fig = fig
        self.text = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.plot = bokeh_pane(fig)
        self.sites = pn.widgets.Tabulator(pd.DataFrame(), pagination="local", page_size=8, disabled=True,
                                          show_index=False, sizing_mode="stretch_width", layout="fit_data_table",
                                          css_classes=["tk-memory-sites"], visible=False)
        self.panel = pn.Column(self.text, self.plot, self.sites, sizing_mode="stretch_width",
                               css_classes=["tk-memory"])

    def show_run(self, run_id: str) -> None:
        self.run_id, self.step_windows = run_id, []
        self.ranks = memory_ranks(self.data, run_id)
        self.plot.visible = self.sites.visible = bool(self.ranks)
        if not self.ranks:
            self.text.object = "## Memory\n\nno memory snapshots in this run"

    def show_focus(self, rank: int, step: int) -> None:
        if not self.ranks:
            return
        shown = rank if rank in self.ranks else self.ranks[0]
        curve = rank_curve(self.data, self.run_id, shown)
        starts = curve.steps.filter(pl.col("step") == step)["start_ns"]
        if curve.on_step_clock:
            origin = int(starts[0]) if starts.len() else int(curve.steps["start_ns"].min())
            self.fig.xaxis.axis_label = f"ms from rank {shown}'s step {step} start (the timeline's origin)"
        else:
            origin = int(curve.points["t_ns"].min()) if curve.points.height else 0
            self.fig.xaxis.axis_label = ("ms from the first recorded allocation: the snapshot's clock is not the "
                                         "steps' clock, so it is not aligned with the timeline")
        pts = curve.points
        self.source.data = {"t_ms": ((pts["t_ns"] - origin) / 1e6).to_numpy(), "allocated_mib": pts["allocated_mib"].to_numpy(),
                            "action": pts["action"].to_list(), "size_kib": (pts["size"] / 1024).to_numpy(),
                            "frame": pts["frame"].to_list(), "stack": pts["stack"].to_list()}
        self.sites.value = curve.sites.select(
            pl.col("frame").alias("allocation site (live at the peak)"), (pl.col("bytes") / 2**20).round(3).alias("MiB"),
            "blocks", (pl.col("share") * 100).round(1).alias("% of peak")).to_pandas()
        st = curve.steps if curve.on_step_clock else curve.steps.clear()
        self.step_windows = [(int(k), (a - origin) / 1e6, (b - origin) / 1e6) for k, a, b in
                             st.select("step", "start_ns", "end_ns").iter_rows()]
        self.step_starts.data = {"x": ((st["start_ns"] - origin) / 1e6).to_numpy(), "step": st["step"].to_numpy()}
        sel = st.filter(pl.col("step") == step)
        self.window.visible = bool(sel.height)
        if sel.height:
            self.window.update(left=(sel["start_ns"][0] - origin) / 1e6, right=(sel["end_ns"][0] - origin) / 1e6)
        est = estimate_mib(self.data, self.run_id, shown)
        self.estimate.visible = est is not None
        self.estimate.location = est or 0.0
        self.fig.y_range.update(start=0, end=max(curve.peak_mib, est or 0.0) * 1.1 or 1.0)
        text = f"rank {shown}: measured peak {curve.peak_mib:.4g} MiB"
        if curve.peak_t_ns is not None:
            text += f" at {(curve.peak_t_ns - origin) / 1e6:.1f} ms"
        text += f", allocated by {html.escape(curve.peak_frame)} ({html.escape(curve.peak_category)})"
        if est:
            text += f"; estimate {est:.4g} MiB (measured/estimate {curve.peak_mib / est:.2f})"
        if curve.peak_stack:
            text += ("<details class='tk-memory-peak-stack'><summary>its stack</summary><pre style='font-size: 11px'>"
                     f"{html.escape(curve.peak_stack)}</pre></details>")
        elif not curve.stacks_stored:
            text += "<br>stacks not stored: this store was written before tracekit kept them (ingest the run again)"
        if curve.peak_frame == "<unknown>":
            text += ("<br>allocation sites unknown: the snapshot recorded no stacks (torch's _profile_to_snapshot "
                     "writes none; CUDA snapshots and the reference trainer's CPU snapshots record them)")
        if shown != rank:
            text += f" (rank {rank} has no snapshot; ranks with one: {self.ranks})"
        self.text.object = "## Memory\n\n" + text
        key = ["allocated (blue)"] + (["estimate (dashed red)"] if est is not None else []) + (
            ["step starts (dotted), selected step shaded"] if curve.on_step_clock else [])
        self.fig.title.text = "allocated memory (MiB): " + ", ".join(key)

    def _tap(self, event: Tap) -> None:
        """A click on the curve (on the steps' clock) selects the step in progress at that time
        (the nearest one between steps): every view follows."""
        if event.x is None or not self.step_windows:
            return
        step = min(self.step_windows, key=lambda w: (max(w[1] - event.x, event.x - w[2], 0.0), w[0]))[0]
        if step != self.sel.step:
            self.sel.step = step
