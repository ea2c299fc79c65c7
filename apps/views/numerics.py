"""The numerics report stored with a run (precision flags, bitwise comparisons), when present."""

from __future__ import annotations

import panel as pn

from apps.data import DashboardData
from apps.data.numerics import numerics_report
from apps.selection import Selection
from tracekit.store import StoreError


class NumericsView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data = data
        self.note = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.table = pn.pane.DataFrame(None, max_rows=200, index=False, sizing_mode="stretch_width")
        self.panel = pn.Column(self.note, self.table,
                               sizing_mode="stretch_width", css_classes=["tk-numerics"])

    def show_run(self, run_id: str) -> None:
        try:
            df = numerics_report(self.data, run_id)
        except StoreError as e:
            df, self.note.object = None, f"## Numerics\n\nnumerics report unreadable: {e}"
        else:
            self.note.object = "## Numerics" + ("" if df is not None else "\n\nno numerics report stored with this run")
        self.table.object = df.to_pandas() if df is not None else None
        self.table.visible = df is not None

    def show_focus(self, rank: int, step: int) -> None:
        pass
