"""Timeline of one step: the selected rank against a healthy peer at the same position, lane by
lane (compute, collectives split into wait and transfer, pipeline sends and receives)."""

from __future__ import annotations

import holoviews as hv
import panel as pn
import polars as pl

from apps.data import DashboardData
from apps.selection import Selection

COLORS = {"compute": "#4c78a8", "wait": "#e45756", "transfer": "#f2a541", "send": "#54a24b", "recv": "#b279a2"}
LANES = ("compute", "collective", "p2p")


def timeline_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    def plot(run_id: str, rank: int, step: int) -> pn.viewable.Viewable:
        peer = data.healthy_peer(run_id, rank)
        ranks = [rank] + ([peer] if peer is not None else [])
        who = f"rank {rank}" + (f" vs healthy peer rank {peer}" if peer is not None else " (no peer)")
        header = pn.pane.Markdown(f"**Timeline: step {step}, {who}**", css_classes=["tk-timeline-title"])
        spans = data.timeline(run_id, ranks, step)
        if not spans.height:
            return pn.Column(header, pn.pane.Markdown(f"no spans recorded for these ranks in step {step}"))
        rows = [(r, lane) for r in ranks for lane in LANES]
        pos = {k: len(rows) - i for i, k in enumerate(rows)}
        df = spans.with_columns(
            pl.struct("rank", "lane").map_elements(lambda s: pos[(s["rank"], s["lane"])], return_dtype=pl.Int64)
            .alias("y")).with_columns((pl.col("y") - 0.4).alias("y0"), (pl.col("y") + 0.4).alias("y1"))
        rects = hv.Rectangles(df.to_pandas(), kdims=["start_ms", "y0", "end_ms", "y1"],
                              vdims=["kind", "name", "rank", "lane"]).opts(
            color=hv.dim("kind").categorize(COLORS, default="grey"), line_alpha=0, tools=["hover"],
            yticks=[(pos[k], f"rank {k[0]} {k[1]}") for k in rows], xlabel="ms from the step's first span",
            ylabel="", height=90 + 34 * len(rows), responsive=True, title=f"step {step}")
        legend = " ".join(f"<span style='color:{c}'>&#9632;</span> {k}" for k, c in COLORS.items())
        totals = spans.with_columns((pl.col("end_ms") - pl.col("start_ms")).alias("ms")).group_by(
            "rank", "kind").agg(pl.col("ms").sum()).sort("rank", "kind")
        summary = "; ".join(f"rank {r}: " + ", ".join(f"{k} {m:.0f} ms" for _, k, m in
                            totals.filter(pl.col("rank") == r).iter_rows()) for r in ranks)
        return pn.Column(header, pn.pane.HTML(legend), pn.pane.HoloViews(rects, sizing_mode="stretch_width"),
                         pn.pane.Markdown(summary), sizing_mode="stretch_width")

    return pn.Column(pn.pane.Markdown("## Timeline: selected rank vs a healthy peer"),
                     pn.bind(plot, sel.param.run_id, sel.param.rank, sel.param.step),
                     sizing_mode="stretch_width", css_classes=["tk-timeline"])
