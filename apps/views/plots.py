"""What the views share: the view protocol, a figure with the dashboard's defaults, colours.

Plots are Bokeh figures built once per session; a click changes their ColumnDataSources and a few
numbers (ranges, a span's location), never the models themselves. Why: Bokeh recomputes the whole
document's model graph whenever models are added or replaced (0.1-0.2 s for this page, measured)
and the browser then lays the page out again; a data-source update is a few milliseconds on both
sides. Building through HoloViews cost 250-400 ms per plot per session, and its stream updates
160-250 ms each (measured on this machine), so the plots are Bokeh directly.
"""

from __future__ import annotations

from typing import Protocol

import panel as pn
from bokeh.plotting import figure

KIND_COLORS = {"compute": "#4c78a8", "wait": "#e45756", "transfer": "#f2a541", "send": "#54a24b",
               "recv": "#b279a2"}
ACCENT = "#00b3c7"  # the selection marker, wherever it is drawn
CULPRIT = "crimson"


class View(Protocol):
    panel: pn.viewable.Viewable

    def show_run(self, run_id: str) -> None:
        """Load a run: every plot's data and text for it."""

    def show_focus(self, rank: int, step: int) -> None:
        """Follow the selection: only what depends on rank and step changes."""


def new_figure(height: int, tools: str = "", **kw) -> figure:
    """A stretch-width figure with a fixed height (so text changes around it never resize it) and
    only the tools asked for (every tool is a model to build, send and draw)."""
    fig = figure(height=height, sizing_mode="stretch_width", tools=tools, toolbar_location="right",
                 min_border_left=10, min_border_right=10, **kw)
    fig.toolbar.logo = None
    fig.toolbar.autohide = True
    fig.title.text_font_size = "12px"
    fig.axis.axis_label_text_font_size = "11px"
    fig.axis.axis_label_text_font_style = "normal"
    return fig


def bokeh_pane(fig, **kw) -> pn.pane.Bokeh:
    return pn.pane.Bokeh(fig, sizing_mode="stretch_width", **kw)


def ms(value: float) -> str:
    return f"{value:,.1f} ms" if value < 100 else f"{value:,.0f} ms"
