"""Run overview: what ran (layout, config), how long its steps took, and the verdict."""

from __future__ import annotations

import json

import holoviews as hv
import panel as pn

from apps.data import DashboardData
from apps.selection import Selection


def _config_md(info: dict) -> str:
    lay = " x ".join(f"{d} {info[d]}" for d in ("dp", "pp", "cp", "tp"))
    lines = [f"**run** `{info['run_id']}` &nbsp; **source** {info['source']} &nbsp; "
             f"**world size** {info['world_size']} &nbsp; **layout** {lay} ({info['layout_source']})"
             f" &nbsp; **backend** {info['backend'] or 'n/a'}"]
    cfg = info["manifest"].get("config")
    if cfg:
        lines.append("**config** `" + json.dumps(cfg, sort_keys=True)[:600] + "`")
    truth = info["manifest"].get("faults") or info["manifest"].get("ground_truth")
    if truth:
        lines.append("**injected (ground truth)** `" + json.dumps(truth, sort_keys=True)[:300] + "`")
    return "\n\n".join(lines)


def overview_view(data: DashboardData, sel: Selection) -> pn.viewable.Viewable:
    def verdict(run_id: str) -> pn.viewable.Viewable:
        d = data.diagnosis(run_id)
        kind = "success" if d.localization.verdict == "no_straggler" else "danger"
        return pn.pane.Alert(f"**Verdict:** {d.headline}", alert_type=kind, css_classes=["tk-verdict"],
                             sizing_mode="stretch_width")

    def marker(step: int) -> hv.VLine:
        return hv.VLine(step).opts(color="black", line_dash="dashed")

    def steps(run_id: str) -> pn.viewable.Viewable:
        st = data.step_times(run_id)
        if not st.height:
            return pn.pane.Markdown("no step records in this run")
        df = st.to_pandas()
        med = hv.Curve(df, "step", "median_ms", label="median over ranks")
        mx = hv.Curve(df, "step", "max_ms", label="slowest rank")
        mark = hv.DynamicMap(pn.bind(marker, sel.param.step))  # moves without redrawing the curves
        return pn.pane.HoloViews((med * mx * hv.Scatter(df, "step", "max_ms") * mark).opts(
            hv.opts.Curve(tools=["hover"]), hv.opts.Overlay(title="step time (ms)", height=220,
                                                             responsive=True, legend_position="top_left")),
            sizing_mode="stretch_width")

    return pn.Column(
        pn.pane.Markdown("## Run overview"),
        pn.bind(lambda r: pn.pane.Markdown(_config_md(data.run_info(r)), sizing_mode="stretch_width"),
                sel.param.run_id),
        pn.bind(verdict, sel.param.run_id),
        pn.bind(steps, sel.param.run_id),
        sizing_mode="stretch_width", css_classes=["tk-overview"])
