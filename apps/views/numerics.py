"""The numerics report stored with a run (precision flags, bitwise comparisons), when present."""

from __future__ import annotations

import panel as pn

from apps.data import DashboardData
from apps.selection import Selection


def numerics_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    def table(run_id: str) -> pn.viewable.Viewable:
        df = data.numerics(run_id)
        if df is None:
            return pn.pane.Markdown("no numerics report stored with this run")
        return pn.pane.DataFrame(df.to_pandas(), max_rows=200, index=False, sizing_mode="stretch_width")

    return pn.Column(pn.pane.Markdown("## Numerics"), pn.bind(table, sel.param.run_id),
                     sizing_mode="stretch_width", css_classes=["tk-numerics"])
