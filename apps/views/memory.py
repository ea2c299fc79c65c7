"""Memory timeline of the selected rank (allocated MiB over its trace, in event order) with the estimator's
prediction for that rank beside it, when the run has memory snapshots and a trainer manifest."""

from __future__ import annotations

import holoviews as hv
import panel as pn

from apps.data import DashboardData
from apps.selection import Selection


def memory_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    def plot(run_id: str, rank: int) -> pn.viewable.Viewable:
        ranks = data.memory_ranks(run_id)
        if not ranks:
            return pn.pane.Markdown("no memory snapshots in this run")
        shown = rank if rank in ranks else ranks[0]
        df = data.memory_timeline(run_id, shown)
        est = data.memory_estimate_mib(run_id, shown)
        peak = df["allocated_mib"].max()
        curve = hv.Curve(df.to_pandas(), "seq", "allocated_mib", label=f"rank {shown} allocated").opts(
            tools=["hover"])
        over = curve
        text = f"rank {shown}: measured peak {peak:.4g} MiB"
        if est is not None:
            over = curve * hv.HLine(est, label="estimate").opts(color="crimson", line_dash="dashed")
            text += f"; estimate {est:.4g} MiB (measured/estimate {peak / est:.2f})" if est else ""
        if shown != rank:
            text += f" (rank {rank} has no snapshot; ranks with one: {ranks})"
        top = max(peak, est or 0.0) * 1.1 or 1.0  # keep the estimate line in view
        plot = over.opts(hv.opts.Overlay(height=240, responsive=True, title="allocated memory (MiB)"),
                         hv.opts.Curve(ylim=(0, top)))
        return pn.Column(pn.pane.HoloViews(plot, sizing_mode="stretch_width"), pn.pane.Markdown(text),
                         sizing_mode="stretch_width")

    return pn.Column(pn.pane.Markdown("## Memory"), pn.bind(plot, sel.param.run_id, sel.param.rank),
                     sizing_mode="stretch_width", css_classes=["tk-memory"])
