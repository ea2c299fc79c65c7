"""The tracekit dashboard: post-mortems and straggler hunts over a tracekit store.

Serve it with ``tracekit dashboard <store or run dir>`` or ``panel serve apps/dashboard.py --args
<store>``. It opens on the newest run; the run selector switches runs. Every view follows one
shared selection (run, rank, step), and several set it: a heatmap cell (rank and step), a step on
the step-time plot, a member of the CP group, a point of the whole-job raster, the step timeline's
peer lanes, a time on the memory curve, the rank and step inputs.

Each session builds its views once: the first screen's (overview, hang, heatmap, drill-down, step
timeline) when the page is requested, the rest (CP wait, memory, numerics, whole job) once the
browser has drawn those, so the first render waits for half the models. A new run reloads every
view's data; a new rank or step updates only what depends on it, inside one held document change,
so the browser gets one message with new data-source contents and texts rather than new plots
(apps/views/plots.py says why).
"""

from __future__ import annotations

import sys
from pathlib import Path

import panel as pn

from apps.data import DashboardData
from apps.data.overview import initial_focus
from apps.selection import Selection
from apps.views.cpwait import CPWaitView
from apps.views.drilldown import DrilldownView
from apps.views.hang import HangView
from apps.views.heatmap import HeatmapView
from apps.views.jobtimeline import JobTimelineView
from apps.views.memory import MemoryView
from apps.views.numerics import NumericsView
from apps.views.overview import OverviewView
from apps.views.timeline import TimelineView


class Dashboard:
    """One session's page: the selection, the views, and the wiring between them."""

    def __init__(self, data: DashboardData, title: str) -> None:
        self.data = data
        self.sel = sel = Selection()
        sel.param.run_id.objects = data.runs()
        sel.run_id = data.newest_run()
        self.overview, self.heatmap = OverviewView(data, sel), HeatmapView(data, sel)
        self.drilldown, self.timeline = DrilldownView(data, sel), TimelineView(data, sel)
        self.hang = HangView(data, sel)
        self.views = [self.overview, self.hang, self.heatmap, self.drilldown, self.timeline]
        self.straggler_views = [self.heatmap, self.drilldown]  # a hung run has no such verdict (+ CP wait)
        # below the first screen: CP wait, memory, numerics and the whole job join the page after its
        # first render (attach_rest), so neither the server's first message nor the browser's first
        # layout waits for them (their models are half the page's)
        self.later = {name: pn.Column(pn.pane.Markdown(f"*loading the {what} ...*"), sizing_mode="stretch_width")
                      for name, what in (("cpwait", "CP-wait view"), ("memory", "memory view"),
                                         ("numerics", "numerics view"), ("job", "whole-job view"))}
        self.cpwait = self.memory = self.numerics = self.job = None
        self.focus = pn.pane.Markdown("", css_classes=["tk-focus"], sizing_mode="stretch_width")
        self.errors = pn.pane.Alert("", alert_type="warning", visible=False, css_classes=["tk-errors"],
                                    sizing_mode="stretch_width")
        self.scope = pn.widgets.Select(options=["all ranks, all steps", "selected rank's group, selected step"],
                                       name="Perfetto trace of", width=230)
        self.download = pn.widgets.FileDownload(callback=self._perfetto, filename="trace.json.gz", embed=False,
                                                label="Open in Perfetto (download trace)", button_type="primary",
                                                css_classes=["tk-perfetto"], width=260)
        header = pn.Row(pn.pane.Markdown(f"# tracekit &middot; `{title}`"),
                        pn.widgets.Select.from_param(sel.param.run_id, label="run"),
                        pn.widgets.IntInput.from_param(sel.param.rank, label="rank"),
                        pn.widgets.IntInput.from_param(sel.param.step, label="step"), self.scope,
                        pn.Column(pn.Spacer(height=18), self.download), sizing_mode="stretch_width")
        left = pn.Column(self.overview.panel, self.heatmap.panel, self.later["cpwait"], sizing_mode="stretch_width")
        right = pn.Column(self.drilldown.panel, self.timeline.panel, self.later["memory"], self.later["numerics"],
                          sizing_mode="stretch_width")
        self.panel = pn.Column(header, self.focus, self.errors, self.hang.panel,
                               pn.Row(left, right, sizing_mode="stretch_width"),
                               self.later["job"], sizing_mode="stretch_width", css_classes=["tk-app"])
        self._loading, self._run_errors = False, []
        self._load_run(sel.run_id)
        if pn.state.curdoc is not None and pn.state.curdoc.session_context is not None:
            pn.state.onload(lambda: self._held(self.attach_rest))  # in a browser session: after the first render
        else:
            self.attach_rest()
        sel.param.watch(lambda e: self._held(self._load_run, e.new), "run_id")
        sel.param.watch(lambda *e: self._loading or self._held(self._follow, sel.rank, sel.step), ["rank", "step"])

    def attach_rest(self) -> None:
        """Build the views below the first screen, show the current run and selection in them and
        put them in their places (the whole job's raster last: it joins once its plot is up)."""
        sel = self.sel
        self.cpwait, self.memory = CPWaitView(self.data, sel), MemoryView(self.data, sel)
        self.numerics, self.job = NumericsView(self.data, sel), JobTimelineView(self.data, sel)
        rest = [self.cpwait, self.memory, self.numerics, self.job]
        self.views += rest
        self.straggler_views.append(self.cpwait)
        self._each("show_run", sel.run_id, views=rest)
        self.cpwait.panel.visible = not self.hang.hung
        self._each("show_focus", sel.rank, sel.step, views=rest)
        for name, view in zip(("cpwait", "memory", "numerics", "job"), rest):
            self.later[name].objects = [view.panel]
        doc = pn.state.curdoc
        if doc is not None and doc.session_context is not None:  # the raster in a message of its own
            doc.add_next_tick_callback(lambda: self._held(self.job.attach))
        else:
            self.job.attach()

    def _perfetto(self):
        """The trace `tracekit export perfetto` writes, of the whole run or of the selected rank's
        group in the selected step (open it in ui.perfetto.dev)."""
        import io

        run, ranks, steps = self.sel.run_id, None, None
        if self.scope.value.startswith("selected"):
            lay = self.data.layout(run)
            dims = [d for d in ("dp", "pp", "cp", "tp") if getattr(lay, d) > 1][-1:] or ["dp"]
            ranks, steps = sorted(lay.group(self.sel.rank, dims[0])), [self.sel.step]
        self.download.filename = f"{run}-" + ("all" if ranks is None else f"rank{self.sel.rank}-step{self.sel.step}") \
            + ".json.gz"
        return io.BytesIO(self.data.perfetto_trace(run, ranks, steps))

    def _held(self, update, *args) -> None:
        """Run an update with the session's document held: one message to the browser at the end."""
        with pn.io.hold(freeze=True):
            update(*args)

    def _each(self, method: str, *args, views: list | None = None) -> None:
        """Call ``method`` on every view (or on ``views``); a view whose data cannot be read (a
        malformed table, an analysis that rejects the run) says so in the error box while the others
        carry on."""
        failed = []
        for v in self.views if views is None else views:
            try:
                getattr(v, method)(*args)
            except ValueError as e:  # StoreError, TablesError, MemoryDataError, ...
                failed.append(f"**{type(v).__name__.removesuffix('View').lower()}**: {e}")
        if method == "show_run":
            self._run_errors = failed if views is None else self._run_errors + failed
        shown = list(dict.fromkeys(self._run_errors + failed))
        self.errors.object = "<br>".join(shown)
        self.errors.visible = bool(shown)

    def _load_run(self, run_id: str) -> None:
        try:
            rank, step = initial_focus(self.data, run_id)
        except ValueError:  # no verdict to open on: the overview says why
            rank, step = 0, 0
        try:
            self.sel.param.rank.bounds = (0, self.data.layout(run_id).world_size - 1)
        except ValueError:
            pass
        self._each("show_run", run_id)
        for v in self.straggler_views:  # a hung run shows where ranks stopped instead
            v.panel.visible = not self.hang.hung
        self._loading = True  # the views follow once below, not once per changed parameter
        try:
            self.sel.param.update(rank=rank, step=step)
        finally:
            self._loading = False
        self._follow(rank, step)

    def _follow(self, rank: int, step: int) -> None:
        try:
            c = self.data.layout(self.sel.run_id).coords(rank)
            where = f" (dp {c.dp}, pp {c.pp}, cp {c.cp}, tp {c.tp})"
        except ValueError:
            where = ""
        self.focus.object = f"**Selected:** run `{self.sel.run_id}`, rank {rank}{where}, step {step}"
        self._each("show_focus", rank, step)


def build_app(store: str | Path, data: DashboardData | None = None) -> pn.viewable.Viewable:
    """One session's page over the store (the data access may be shared between sessions)."""
    store = Path(store)
    return Dashboard(data or DashboardData(store), store.name).panel  # a run dir's: <dir>.tracekit.duckdb


def _rehearse(store: str | Path, data: DashboardData) -> None:
    """Build one page before the server listens, so the first visitor does not pay for what runs once
    per process (Datashader's JIT compilation of its aggregation, 2-5 s; HoloViews' plot classes)."""
    from bokeh.document import Document

    try:
        build_app(store, data).server_doc(Document())
    except ValueError:  # a run the views cannot show: the page says so to its visitors
        pass


def serve(store: str | Path, port: int = 5006, address: str = "127.0.0.1", show: bool = False,
          data: DashboardData | None = None) -> None:
    """Serve the dashboard until interrupted, with one data access shared by all sessions (the
    newest run's analysis is computed before the server listens, unless ``data`` has it)."""
    if data is None:
        data = DashboardData(store)
        data.warm(data.newest_run())
    _rehearse(store, data)
    pn.serve({"dashboard": lambda: build_app(store, data)}, port=port, address=address, show=show,
             title="tracekit", websocket_origin=[f"{address}:{port}", f"localhost:{port}"], print_url=False)


if __name__.startswith("bokeh"):  # `panel serve apps/dashboard.py --args <store>`
    if len(sys.argv) < 2:
        raise SystemExit("usage: panel serve apps/dashboard.py --args <store.duckdb>")
    build_app(sys.argv[1]).servable(title="tracekit")
