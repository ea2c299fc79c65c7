"""Run overview: what ran (layout, config, injected faults), the verdict, and step times over the
run. A click on the step-time plot selects that step."""

from __future__ import annotations

import html
import json

import pandas as pd
import panel as pn
from bokeh.events import Tap
from bokeh.models import BasicTicker, ColumnDataSource, HoverTool, Legend, LegendItem, NumeralTickFormatter, Span

from apps.data import DashboardData
from apps.data.overview import step_times
from apps.selection import Selection
from apps.views.plots import ACCENT, CULPRIT, bokeh_pane, new_figure
from tracekit.topology import Layout


def _compact(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def config_md(info: dict, layout: Layout) -> str:
    """The run's identity, the layout the analyses use, the whole trainer config (key=value,
    wrapping rather than cut off) and the injected faults, one per line."""
    lay = " x ".join(f"{d} {getattr(layout, d)}" for d in ("dp", "pp", "cp", "tp"))
    lines = [f"**run** `{info['run_id']}` &nbsp; **source** {info['source']} &nbsp; "
             f"**world size** {info['world_size']} &nbsp; **layout** {lay} ({info['layout_source']})"
             f" &nbsp; **backend** {info['backend'] or 'n/a'}"]
    cfg = info["manifest"].get("config")
    if isinstance(cfg, dict) and cfg:
        chips = "".join(f"<code>{html.escape(k)}={html.escape(_compact(v))}</code>" for k, v in sorted(cfg.items()))
        lines.append(f"<details class='tk-config'><summary><b>config</b> ({len(cfg)} settings)</summary>"
                     "<div style='display:flex;flex-wrap:wrap;gap:2px 14px;font-size:12px;overflow-wrap:anywhere'>"
                     f"{chips}</div></details>")
    truth = info["manifest"].get("faults") or info["manifest"].get("ground_truth")
    if truth:
        items = truth if isinstance(truth, list) else [truth]
        lines.append("**injected (ground truth)**<br>" + "<br>".join(
            html.escape(", ".join(f"{k}={_compact(v)}" for k, v in t.items()) if isinstance(t, dict) else _compact(t))
            for t in items))
    return "\n\n".join(lines)


def findings_frame(diagnosis) -> pd.DataFrame:
    """The diagnosis' findings, one row each, with the fields `tracekit report --json` gives."""
    return pd.DataFrame([{"kind": f.kind, "where": f.where, "ranks": ", ".join(map(str, f.ranks)),
                          "ms/step": round(f.cost_ns / 1e6, 1),
                          "share": f"{'at most ' if f.cost_upper_bound else ''}{f.cost_share:.1%}",
                          "confidence": round(f.confidence, 2), "cause": f.cause, "next step": f.next_step}
                         for f in diagnosis.findings],
                        columns=["kind", "where", "ranks", "ms/step", "share", "confidence", "cause", "next step"])


class OverviewView:
    def __init__(self, data: DashboardData, sel: Selection) -> None:
        self.data, self.sel = data, sel
        self.config = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.verdict = pn.pane.Alert("", alert_type="light", css_classes=["tk-verdict"], sizing_mode="stretch_width")
        self.source = ColumnDataSource({"step": [], "median_ms": [], "max_ms": [], "slowest_rank": []})
        fig = new_figure(220, tools="xwheel_zoom,reset", name="tk-steps-fig", title="step time (ms): click a step to select it", x_axis_label="step",
                         y_axis_label="ms")
        med = fig.line("step", "median_ms", source=self.source, line_width=2, color="#4c78a8")
        mx = fig.line("step", "max_ms", source=self.source, line_width=2, color=CULPRIT)
        dots = fig.scatter("step", "max_ms", source=self.source, size=6, color=CULPRIT)
        fig.add_tools(HoverTool(renderers=[dots], tooltips=[("step", "@step"), ("slowest", "@max_ms{0.0} ms"),
                                                            ("slowest rank", "@slowest_rank"),
                                                            ("median", "@median_ms{0.0} ms")]))
        fig.add_layout(Legend(items=[LegendItem(label="median over ranks", renderers=[med]),
                                     LegendItem(label="slowest rank", renderers=[mx, dots])],
                              orientation="horizontal", location="top_left", label_text_font_size="11px",
                              border_line_alpha=0, background_fill_alpha=0.0), "above")
        fig.xaxis.ticker = BasicTicker(min_interval=1)  # steps are whole numbers
        fig.xaxis.formatter = NumeralTickFormatter(format="0")
        self.marker = Span(location=0, dimension="height", line_color=ACCENT, line_width=2, line_dash="dashed")
        fig.add_layout(self.marker)
        fig.on_event(Tap, self._tap)
        self.fig = fig
        self.plot = bokeh_pane(fig)
        self.findings = pn.widgets.Tabulator(pd.DataFrame(), pagination="local", page_size=6, disabled=True,
                                             show_index=False, sizing_mode="stretch_width", layout="fit_data_table",
                                             css_classes=["tk-findings"], visible=False)
        self.findings.on_click(self._finding_clicked)
        self.panel = pn.Column(self.config, self.verdict, self.findings,
                               self.plot, sizing_mode="stretch_width", css_classes=["tk-overview"])

    def show_run(self, run_id: str) -> None:
        tables = self.data.tables(run_id)  # the layout the analyses use (assumed when none was recorded)
        info = {**self.data.run_info(run_id), "layout_source": tables.runs["layout_source"][0]}
        st = step_times(self.data, run_id)
        self.config.object = "## Run overview\n\n" + config_md(info, tables.layout) + (
            "" if st.height else "\n\nno step records in this run")
        try:
            d = self.data.diagnosis(run_id)
        except ValueError as e:  # tables the analysis cannot work from: say so, show the rest
            self.verdict.object, self.verdict.alert_type = f"**Verdict:** none, the analysis failed: {e}", "warning"
        else:
            lead = d.findings[0].summary if len(d.findings) > 1 else d.headline
            more = f" (and {len(d.findings) - 1} more findings, below)" if len(d.findings) > 1 else ""
            self.verdict.object = f"**Verdict:** {html.escape(lead)}{more}"
            self.verdict.alert_type = "success" if not d.findings and d.localization.verdict != "hang" else "danger"
            self.findings.value = findings_frame(d)
            self.findings.visible = bool(d.findings)
        self.source.data = {c: st[c].to_numpy() for c in ("step", "median_ms", "max_ms", "slowest_rank")}
        self.plot.visible = bool(st.height)  # an empty state is a message, not empty axes

    def show_focus(self, rank: int, step: int) -> None:
        self.marker.location = step

    def _finding_clicked(self, event) -> None:
        """A finding's row selects its first rank."""
        rows = self.findings.value
        if event.row is not None and rows is not None and len(rows):
            self.sel.rank = int(str(rows.iloc[event.row]["ranks"]).split(",")[0])

    def _tap(self, event: Tap) -> None:
        steps = self.source.data["step"]
        if event.x is None or not len(steps):
            return
        self.sel.step = int(min(steps, key=lambda s: abs(s - event.x)))
