"""The numerics report stored with a run: its verdict as a headline (the check's own diagnosis:
"the first wrong gradient in backward order is ...") and the per-buffer rows as a compact paged
table, the mismatching buffers only unless asked for all."""

from __future__ import annotations

import html

import pandas as pd
import panel as pn
import polars as pl

from apps.data import DashboardData
from apps.data.numerics import numerics_report
from apps.selection import Selection
from tracekit.store import StoreError

COLUMNS = ("step", "buffer", "mismatches", "numel", "max_ulp", "rel_err", "norm_ratio", "where")


class NumericsView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.rows = data, pl.DataFrame()
        self.note = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.all = pn.widgets.Checkbox(name="show every buffer (not only the mismatching ones)", value=False)
        self.table = pn.widgets.Tabulator(pd.DataFrame(), pagination="local", page_size=12, disabled=True,
                                          show_index=False, sizing_mode="stretch_width", layout="fit_data_table",
                                          css_classes=["tk-numerics-table"])
        self.all.param.watch(lambda e: self._fill(), "value")
        self.body = pn.Column(self.all, self.table, sizing_mode="stretch_width")
        self.panel = pn.Column(self.note, self.body, sizing_mode="stretch_width", css_classes=["tk-numerics"])

    def show_run(self, run_id: str) -> None:
        self.body.visible = False
        try:
            rep = numerics_report(self.data, run_id)
        except StoreError as e:
            self.note.object = f"## Numerics\n\nnumerics report unreadable: {e}"
            return
        if rep is None:
            self.note.object = "## Numerics\n\nno numerics report stored with this run"
            return
        self.rows = rep.rows
        bad = self._mismatching().height
        self.note.object = (f"## Numerics\n\n<div class='tk-numerics-headline'><b>{html.escape(rep.headline)}</b>"
                            f"</div>\n\n{html.escape(rep.detail)}\n\n{bad} of {rep.rows.height} buffers differ")
        self.all.value = bad == 0
        self.body.visible = True
        self._fill()

    def _mismatching(self) -> pl.DataFrame:
        if "mismatches" not in self.rows.columns:
            return self.rows
        return self.rows.filter(pl.col("mismatches").cast(pl.Int64, strict=False) > 0)

    def _fill(self) -> None:
        df = self.rows if self.all.value else self._mismatching()
        cols = [c for c in COLUMNS if c in df.columns] or df.columns
        self.table.value = df.select(cols).to_pandas()

    def show_focus(self, rank: int, step: int) -> None:
        pass
