"""Hang view, shown instead of the straggler views when the run hung: the library's HangReport (what
`tracekit hangs` prints) as where each rank stopped (the collective it waits in, or the one it
never joined, with group and sequence), the rank that never joined and the ranks blocked behind
it, and the stuck collectives one per row. A click on a rank's row selects it."""

from __future__ import annotations

import html

import pandas as pd
import panel as pn

from apps.data import DashboardData
from apps.selection import Selection
from tracekit.analysis.hangs import HangReport


def rank_rows(report: HangReport, world_size: int, coords) -> pd.DataFrame:
    """One row per rank: its role (never joined / blocked / no record / not involved) and where it stopped."""
    culprits, blocked, no_data = set(report.culprits), set(report.blocked), set(report.no_data)
    rows = []
    for r in range(world_size):
        waits = [f"{s.op} #{s.seq} of {s.pg_desc or s.pg_name} {list(s.members)}" for s in report.stuck
                 if r in s.joined]
        if not waits and r in report.waiting:
            waits = [report.waiting[r]]
        missed = [f"{s.op} #{s.seq} of {s.pg_desc or s.pg_name} {list(s.members)} (its last: #{s.last_seq.get(r, '-')})"
                  for s in report.stuck if r in s.missing or r in s.no_record]
        role = ("never joined (culprit)" if r in culprits else "blocked" if r in blocked
                else "no flight-recorder data" if r in no_data else "not involved")
        rows.append({"rank": r, "coords": coords(r), "role": role, "waits in": "; ".join(waits) or "-",
                     "never joined": "; ".join(missed) or "-"})
    return pd.DataFrame(rows)


def stuck_rows(report: HangReport) -> pd.DataFrame:
    return pd.DataFrame([{"group": s.pg_desc or s.pg_name, "pg": s.pg_name, "collective": s.op, "seq": s.seq,
                          "members": str(list(s.members)), "waiting": str(list(s.joined)),
                          "never joined": str(list(s.missing) + list(s.no_record))} for s in report.stuck])


class HangView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.sel = data, sel
        self.note = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.ranks = pn.widgets.Tabulator(pd.DataFrame(), pagination="local", page_size=16, disabled=True,
                                          show_index=False, sizing_mode="stretch_width", layout="fit_data_stretch",
                                          css_classes=["tk-hang-ranks"])
        self.stuck = pn.widgets.Tabulator(pd.DataFrame(), pagination="local", page_size=8, disabled=True,
                                          show_index=False, sizing_mode="stretch_width", layout="fit_data_stretch")
        self.ranks.on_click(self._clicked)
        self.panel = pn.Column(self.note, self.ranks, pn.pane.Markdown("**Stuck collectives** (the first is where "
                                                                       "the job stopped)"), self.stuck,
                               sizing_mode="stretch_width", css_classes=["tk-hang"], visible=False)
        self.hung = False

    def show_run(self, run_id: str) -> None:
        d = self.data.diagnosis(run_id)
        report = self.data.hangs(run_id)
        self.hung = d.localization.verdict == "hang"
        self.panel.visible = self.hung
        if not self.hung:
            return
        lay = self.data.layout(run_id)
        c = lambda r: ", ".join(f"{k} {v}" for k, v in lay.coords(r).as_dict().items() if getattr(lay, k) > 1)  # noqa: E731
        never = sorted({r for s in report.stuck[:1] for r in (*s.missing, *s.no_record)})
        self.note.object = (
            "## Hang: where each rank stopped\n\n"
            f"<div class='tk-hang-headline'>{html.escape(report.headline if report.hung else d.cause.summary)}</div>\n\n"
            f"**never joined:** {', '.join(map(str, report.culprits)) or 'unknown'} &nbsp; "
            f"**blocked behind it:** {len(report.blocked)} ranks &nbsp; "
            f"**no flight-recorder data:** {', '.join(map(str, report.no_data)) or 'none'}"
            + (f" &nbsp; (first stuck collective: ranks {never} never joined)" if never else ""))
        self.ranks.value = rank_rows(report, lay.world_size, c)
        self.stuck.value = stuck_rows(report)

    def show_focus(self, rank: int, step: int) -> None:
        pass

    def _clicked(self, event) -> None:
        row = event.row
        if row is not None and self.ranks.value is not None and len(self.ranks.value):
            self.sel.rank = int(self.ranks.value.iloc[row]["rank"])
