"""Timeline of one step: the selected rank against a healthy peer at the same position, lane by
lane (compute, collectives split into wait and transfer, pipeline sends and receives).

The plot is a DynamicMap over the shared selection, so a new rank or step replaces the data of
the existing figure in the browser instead of rebuilding it (that keeps clicks quick)."""

from __future__ import annotations

import holoviews as hv
import panel as pn
import polars as pl

from apps.data import DashboardData
from apps.selection import Selection

COLORS = {"compute": "#4c78a8", "wait": "#e45756", "transfer": "#f2a541", "send": "#54a24b", "recv": "#b279a2"}
LANES = ("compute", "collective", "p2p")
WHO = ("selected", "peer")
ROWS = [(w, lane) for w in WHO for lane in LANES]
Y = {k: len(ROWS) - i for i, k in enumerate(ROWS)}
VDIMS = ["kind", "name", "rank", "lane"]


def timeline_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    def ranks_of(run_id: str, rank: int) -> list[int]:
        peer = data.healthy_peer(run_id, rank)
        return [rank] + ([peer] if peer is not None else [])

    def spans(run_id: str, rank: int, step: int) -> pl.DataFrame:
        ranks = ranks_of(run_id, rank)
        return data.timeline(run_id, ranks, step).with_columns(
            pl.when(pl.col("rank") == rank).then(pl.lit("selected")).otherwise(pl.lit("peer")).alias("who"))

    def rects(run_id: str, rank: int, step: int) -> hv.Rectangles:
        df = spans(run_id, rank, step)
        df = df.with_columns(
            pl.concat_str("who", pl.lit("|"), "lane").replace_strict({f"{w}|{ln}": Y[(w, ln)] for w, ln in ROWS},
                                                                     return_dtype=pl.Int64).alias("y"))
        df = df.with_columns((pl.col("y") - 0.4).alias("y0"), (pl.col("y") + 0.4).alias("y1"))
        return hv.Rectangles(df.select("start_ms", "y0", "end_ms", "y1", *VDIMS).to_pandas(),
                             kdims=["start_ms", "y0", "end_ms", "y1"], vdims=VDIMS)

    dmap = hv.DynamicMap(pn.bind(rects, sel.param.run_id, sel.param.rank, sel.param.step)).opts(
        color=hv.dim("kind").categorize(COLORS, default="grey"), line_alpha=0, tools=["hover"],
        yticks=[(Y[k], f"{k[0]} {k[1]}") for k in ROWS], xlabel="ms from the step's first span", ylabel="",
        height=90 + 34 * len(ROWS), responsive=True, framewise=True, ylim=(0.4, len(ROWS) + 0.6))

    def header(run_id: str, rank: int, step: int) -> pn.viewable.Viewable:
        ranks = ranks_of(run_id, rank)
        who = f"rank {rank}" + (f" vs healthy peer rank {ranks[1]}" if len(ranks) > 1 else " (no peer)")
        df = spans(run_id, rank, step)
        if not df.height:
            summary = f"no spans recorded for these ranks in step {step}"
        else:
            totals = df.with_columns((pl.col("end_ms") - pl.col("start_ms")).alias("ms")).group_by(
                "rank", "kind").agg(pl.col("ms").sum()).sort("rank", "kind")
            summary = "; ".join(f"rank {r}: " + ", ".join(f"{k} {m:.0f} ms" for _, k, m in
                                totals.filter(pl.col("rank") == r).iter_rows()) for r in ranks)
        return pn.Column(pn.pane.Markdown(f"**Timeline: step {step}, {who}**", css_classes=["tk-timeline-title"]),
                         pn.pane.Markdown(summary), sizing_mode="stretch_width")

    legend = " ".join(f"<span style='color:{c}'>&#9632;</span> {k}" for k, c in COLORS.items())
    return pn.Column(pn.pane.Markdown("## Timeline: selected rank vs a healthy peer"),
                     pn.bind(header, sel.param.run_id, sel.param.rank, sel.param.step),
                     pn.pane.HoloViews(dmap, sizing_mode="stretch_width"), pn.pane.HTML(legend),
                     sizing_mode="stretch_width", css_classes=["tk-timeline"])
