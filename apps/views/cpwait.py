"""CP-wait breakdown (Llama 3 sec. 7.3.2): the library's attribution of the run's exposed CP time;
per CP position over all groups, the waiting, the transfer and how long the others waited on that
position when it arrived last; and the same for the members of the selected rank's CP group (all
steps, or the selected one). A click on a member's bar selects that rank."""

from __future__ import annotations

import panel as pn
import polars as pl
from bokeh.models import ColumnDataSource, FactorRange, HoverTool
from bokeh.transform import factor_cmap

from apps.data import DashboardData
from apps.data.cpwait import by_position, group_members
from apps.selection import Selection
from apps.views.plots import bokeh_pane, new_figure

PARTS = {"wait_ms": "waited", "transfer_ms": "transfer", "others_waited_ms": "others waited on it"}
PART_COLORS = ["#e45756", "#f2a541", "#4c78a8"]
HEADING = "## CP-wait breakdown\n\n"


def _bars(title: str, tools: str, name: str) -> tuple:
    src = ColumnDataSource({"x": [], "ms": [], "part": [], "who": [], "last": [], "instances": []})
    fig = new_figure(230, tools=tools, name=name, title=title, x_range=FactorRange(factors=[]), y_axis_label="ms")
    fig.vbar(x="x", top="ms", width=0.85, source=src, line_color=None, nonselection_fill_alpha=1.0,
             fill_color=factor_cmap("x", PART_COLORS, list(PARTS.values()), start=1, end=2))
    fig.add_tools(HoverTool(tooltips=[("", "@who: @part"), ("", "@ms{0.0} ms"),
                                      ("last arrival", "@last of @instances instances")]))
    fig.xaxis.major_label_orientation = 0.0
    fig.xaxis.group_text_font_size = "11px"
    fig.xgrid.visible = False
    return fig, src


def _long(df: pl.DataFrame, who: pl.Expr) -> dict:
    """One bar per (member, part), members in the frame's order."""
    long = df.with_columns(who.alias("who")).with_row_index("i").unpivot(
        index=["i", "who", "last", "instances"], on=list(PARTS), variable_name="col", value_name="ms")
    long = long.with_columns(pl.col("col").replace_strict(PARTS).alias("part")).sort("i", maintain_order=True)
    return {"x": list(zip(long["who"].to_list(), long["part"].to_list())), "ms": long["ms"].to_numpy(),
            "part": long["part"].to_list(), "who": long["who"].to_list(), "last": long["last"].to_numpy(),
            "instances": long["instances"].to_numpy()}


class CPWaitView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.sel, self.run_id = data, sel, None
        self.members: list[int] = []
        self.headline = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.position_fig, self.position_src = _bars("CP positions, all groups and steps", "", "tk-cp-position-fig")
        self.group_fig, self.group_src = _bars("the selected rank's CP group: click a member to select it", "tap",
                                             "tk-cp-group-fig")
        self.group_src.selected.on_change("indices", self._picked)
        self.position_note = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.group_note = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.only_step = pn.widgets.Checkbox(label="selected step only", value=False)
        self.only_step.param.watch(lambda e: self.show_focus(self.sel.rank, self.sel.step), "value")
        self.plots = pn.Column(self.position_note, bokeh_pane(self.position_fig), self.only_step, self.group_note,
                               bokeh_pane(self.group_fig), sizing_mode="stretch_width")
        self.panel = pn.Column(self.headline, self.plots,
                               sizing_mode="stretch_width", css_classes=["tk-cpwait"])

    def show_run(self, run_id: str) -> None:
        self.run_id = run_id
        pos = by_position(self.data, run_id)
        self.plots.visible = bool(pos.height)
        if not pos.height:
            self.headline.object = (f"{HEADING}no context-parallel collectives in this run "
                                    f"(cp = {self.data.layout(run_id).cp})")
            return
        self.headline.object = f"{HEADING}**{self.data.cp_wait(run_id).headline}**"
        data = _long(pos, pl.format("cp {}", "cp"))
        self.position_fig.x_range.factors = data["x"]
        self.position_src.data = data
        top = pos.sort("others_waited_ms", descending=True).row(0, named=True)
        total = pos["wait_ms"].sum()
        self.position_note.object = (
            f"CP position {top['cp']} arrived last in {top['last']} of {top['instances']} instances; the others "
            f"waited {top['others_waited_ms']:.1f} ms on it, {top['others_waited_ms'] / total if total else 0:.0%} "
            f"of all CP waiting ({total:.1f} ms)")

    def show_focus(self, rank: int, step: int) -> None:
        if self.run_id is None or not self.plots.visible:
            return
        only = self.only_step.value
        df = group_members(self.data, self.run_id, rank, step if only else None)
        self.members = df["rank"].to_list()
        data = _long(df, pl.format("rank {} (cp {})", "rank", "cp"))
        self.group_fig.x_range.factors = data["x"]
        self.group_src.data = data
        self.group_src.selected.indices = []
        scope = f"step {step}" if only else "all steps"
        if df["instances"].sum() == 0:
            self.group_note.object = f"rank {rank}'s CP group {self.members}: no CP collectives in {scope}"
            return
        top = df.sort("others_waited_ms", descending=True).row(0, named=True)
        self.group_note.object = (f"rank {rank}'s CP group {self.members}, {scope}: rank {top['rank']} was the "
                                  f"last arrival in {top['last']} of {top['instances']} instances; the others "
                                  f"waited {top['others_waited_ms']:.1f} ms on it")

    def _picked(self, attr: str, old: list[int], new: list[int]) -> None:
        if new:
            who = self.group_src.data["who"][new[0]]
            rank = int(who.split()[1])
            if rank != self.sel.rank:
                self.sel.rank = rank
