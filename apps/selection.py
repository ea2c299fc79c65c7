"""The dashboard's shared selection: run, rank and step. Every view reads it; the heatmap, the
widgets and the drill-down write it, so a click in one view filters the others."""

from __future__ import annotations

import param


class Selection(param.Parameterized):
    run_id = param.Selector(objects=[], doc="the run shown")
    rank = param.Integer(default=0, bounds=(0, None), doc="the rank in focus (timeline, memory)")
    step = param.Integer(default=0, doc="the step in focus (timeline, CP waits)")
    metric = param.Selector(objects=["step_ms", "lateness_ms", "wait_share"], default="lateness_ms",
                            doc="what the heatmap colours")
