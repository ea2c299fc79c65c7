"""The tracekit dashboard: post-mortems and straggler hunts over a tracekit store.

Serve it with ``tracekit dashboard <store or run dir>`` or ``panel serve apps/dashboard.py --args
<store>``. It opens on the newest run; the run selector switches runs. Every view reads one shared
selection (run, rank, step); a click on a heatmap cell, or the rank/step widgets, set it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import holoviews as hv
import panel as pn

from apps.data import DashboardData
from apps.selection import Selection
from apps.views.cpwait import cpwait_view
from apps.views.drilldown import drilldown_view
from apps.views.heatmap import heatmap_view
from apps.views.memory import memory_view
from apps.views.numerics import numerics_view
from apps.views.overview import overview_view
from apps.views.timeline import timeline_view


def initial_focus(data: DashboardData, run_id: str) -> tuple[int, int]:
    """Where a run opens: the culprit (else rank 0) in its latest step among the slowest ones."""
    d = data.diagnosis(run_id)
    rank = d.localization.culprit_rank
    if rank is None:
        rank = d.localization.culprit_ranks[0] if d.localization.culprit_ranks else 0
    st = data.step_times(run_id)
    step = int(st.sort("max_ms")["step"][-1]) if st.height else 0
    return int(rank), step


def build_app(store: str | Path, data: DashboardData | None = None) -> pn.viewable.Viewable:
    """One session's page over the store (a fresh selection; the data access may be shared)."""
    hv.extension("bokeh")
    data = data or DashboardData(store)
    runs = data.runs()["run_id"].to_list()
    sel = Selection()
    sel.param.run_id.objects = runs
    sel.run_id = data.newest_run()
    rank, step = initial_focus(data, sel.run_id)
    sel.param.update(rank=rank, step=step)

    def on_run(event) -> None:
        r, s = initial_focus(data, event.new)
        sel.param.update(rank=r, step=s)

    sel.param.watch(on_run, "run_id")
    run_pick = pn.widgets.Select.from_param(sel.param.run_id, name="run")
    rank_pick = pn.widgets.IntInput.from_param(sel.param.rank, name="rank")
    step_pick = pn.widgets.IntInput.from_param(sel.param.step, name="step")
    focus = pn.bind(lambda r, k, s: pn.pane.Markdown(
        f"**Selected:** run `{r}`, rank {k} ({_coords(data, r, k)}), step {s}", css_classes=["tk-focus"]),
        sel.param.run_id, sel.param.rank, sel.param.step)
    header = pn.Row(pn.pane.Markdown(f"# tracekit &middot; `{Path(store).name}`"), run_pick, rank_pick, step_pick,
                    sizing_mode="stretch_width")
    timeline = timeline_view(data, sel)  # built first: its watchers run first after a click
    left = pn.Column(overview_view(data, sel), heatmap_view(data, sel), cpwait_view(data, sel),
                     sizing_mode="stretch_width")
    right = pn.Column(drilldown_view(data, sel), timeline, memory_view(data, sel),
                      numerics_view(data, sel), sizing_mode="stretch_width")
    return pn.Column(header, focus, pn.Row(left, right, sizing_mode="stretch_width"),
                     sizing_mode="stretch_width", css_classes=["tk-app"])


def _coords(data: DashboardData, run_id: str, rank: int) -> str:
    c = data.layout(run_id).coords(rank)
    return f"dp {c.dp}, pp {c.pp}, cp {c.cp}, tp {c.tp}"


def serve(store: str | Path, port: int = 5006, address: str = "127.0.0.1", show: bool = False) -> None:
    """Serve the dashboard until interrupted (one shared data access for all sessions)."""
    data = DashboardData(store)
    pn.serve({"dashboard": lambda: build_app(store, data)}, port=port, address=address, show=show,
             title="tracekit", websocket_origin=[f"{address}:{port}", f"localhost:{port}"], print_url=False)


if __name__.startswith("bokeh"):  # `panel serve apps/dashboard.py --args <store>`
    if len(sys.argv) < 2:
        raise SystemExit("usage: panel serve apps/dashboard.py --args <store.duckdb>")
    build_app(sys.argv[1]).servable(title="tracekit")
