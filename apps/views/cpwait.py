"""CP-wait breakdown (Llama 3 sec. 7.3.2): each CP rank's time in CP collectives split into waiting
for the last arrival and transfer, and how long the others waited on it when it was last."""

from __future__ import annotations

import holoviews as hv
import panel as pn
import polars as pl

from apps.data import DashboardData
from apps.selection import Selection


def cpwait_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    only_step = pn.widgets.Checkbox(name="selected step only", value=False)

    shown: dict[tuple, pn.viewable.Viewable] = {}

    def plot(run_id: str, step: int, only: bool) -> pn.viewable.Viewable:
        # all-steps view: a new step changes nothing, so hand back the same object (no redraw)
        key = (run_id, step if only else None)
        if key not in shown:
            shown.clear()
            shown[key] = draw(run_id, step, only)
        return shown[key]

    def draw(run_id: str, step: int, only: bool) -> pn.viewable.Viewable:
        df = data.cp_wait(run_id, step if only else None)
        if not df.height:
            return pn.pane.Markdown("no context-parallel collectives in this run (cp = "
                                    f"{data.layout(run_id).cp})" + (f" in step {step}" if only else ""))
        long = df.unpivot(index="rank", on=["wait_ms", "transfer_ms", "others_waited_ms"],
                          variable_name="part", value_name="ms").with_columns(pl.col("rank").cast(pl.Utf8))
        bars = hv.Bars(long.to_pandas(), kdims=["rank", "part"], vdims=["ms"]).opts(
            multi_level=False, tools=["hover"], height=260, responsive=True, xlabel="rank",
            ylabel="ms" + (f" (step {step})" if only else " (all steps)"),
            xrotation=90, title="CP collectives per rank")
        top = df.sort("others_waited_ms", descending=True).row(0, named=True)
        total_wait = df["wait_ms"].sum()
        share = top["others_waited_ms"] / total_wait if total_wait else 0.0
        note = (f"rank {top['rank']} was the last arrival behind {share:.0%} of all CP waiting "
                f"({top['others_waited_ms']:.1f} of {total_wait:.1f} ms)")
        return pn.Column(pn.pane.HoloViews(bars, sizing_mode="stretch_width"), pn.pane.Markdown(note),
                         sizing_mode="stretch_width")

    return pn.Column(pn.pane.Markdown("## CP-wait breakdown"), only_step,
                     pn.bind(plot, sel.param.run_id, sel.param.step, only_step),
                     sizing_mode="stretch_width", css_classes=["tk-cpwait"])
