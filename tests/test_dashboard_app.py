"""The dashboard's wiring, in process (no browser): one session over a real store of the job model,
its Bokeh document, and what a click changes. The browser test (test_dashboard_browser.py) drives
the same through Chromium; here each linked selection is checked view by view, cheaply."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

pytest.importorskip("panel", reason="the dashboard extra is not installed (pip install 'tracekit[dashboard]')")

from bokeh.document import Document  # noqa: E402
from bokeh.events import Tap  # noqa: E402

from apps.dashboard import Dashboard  # noqa: E402
from apps.data import DashboardData  # noqa: E402
from apps.data.overview import step_times  # noqa: E402
from tracekit.topology import Layout  # noqa: E402

LAYOUT = Layout(tp=2, cp=2, pp=2, dp=2)
SLOW = D.SLOW


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = DashboardData(D.job_store(tmp_path_factory.mktemp("app"), 400))
    yield d
    d.close()


@pytest.fixture()
def session(data):
    """A fresh session with its document, as the server builds one per browser tab."""
    dash = Dashboard(data, "store.duckdb")
    doc = Document()
    dash.panel.server_doc(doc)
    return dash, doc


def _timeline(dash) -> tuple[int, int]:
    """(rank, step) the timeline's title names."""
    m = D.TITLE.search(dash.timeline.title.object.replace("**", ""))
    assert m, dash.timeline.title.object
    return int(m.group(2)), int(m.group(1))


def _tap(fig, x: float, y: float) -> Tap:
    return Tap(fig, sx=0, sy=0, x=x, y=y)


def test_opens_on_the_culprit_in_the_slowest_step_and_every_view_shows_it(session, data):
    dash, _ = session
    st = step_times(data, "slow")
    step = int(st.sort("max_ms")["step"][-1])
    assert (dash.sel.run_id, dash.sel.rank, dash.sel.step) == ("slow", SLOW, step)
    assert "rank 5 (dp 0, pp 1, cp 0, tp 1) is a straggler" in dash.overview.verdict.object
    assert dash.focus.object.endswith(f"rank {SLOW} (dp 0, pp 1, cp 0, tp 1), step {step}")
    assert _timeline(dash) == (SLOW, step) and "vs healthy peer rank" in dash.timeline.title.object
    assert dash.overview.marker.location == step
    assert dash.heatmap.marker.data == {"x": [dash.heatmap.steps.index(step)], "rank": [SLOW]}
    assert "tp 1 (selected rank's)" in dash.drilldown.body.object
    assert f"rank {SLOW}'s CP group [5, 7]" in dash.cpwait.group_note.object
    assert f"rank {SLOW}: measured peak" in dash.memory.text.object
    assert dash.memory.fig.xaxis.axis_label == f"ms from rank {SLOW}'s step {step} start (the timeline's origin)"
    assert dash.numerics.body.visible and not dash.errors.visible


def test_a_heatmap_click_moves_every_view_and_builds_no_new_model(session):
    dash, doc = session
    before = {m.id for m in doc.models}
    dash.heatmap._tap(_tap(dash.heatmap.fig, 2.2, 2.8))  # the cell of step index 2, rank 3
    assert (dash.sel.rank, dash.sel.step) == (3, dash.heatmap.steps[2])
    step = dash.sel.step
    assert _timeline(dash) == (3, step)
    assert set(dash.timeline.source.data["rank"]) == {3, healthy := LAYOUT.rank_of(dp=1, pp=0, cp=1, tp=1)}
    assert healthy == 11
    lanes = [b + 0.4 for b in dash.timeline.source.data["bottom"]]  # every span inside its own lane
    assert all(abs(y - round(y)) < 1e-9 for y in lanes)
    assert all(abs(t - b - 0.8) < 1e-9 for b, t in zip(dash.timeline.source.data["bottom"],
                                                         dash.timeline.source.data["top"]))
    assert dash.heatmap.marker.data == {"x": [2], "rank": [3]}
    assert dash.overview.marker.location == step
    assert "selected rank 3: dp 0 (chosen), pp 0, cp 1, tp 1 (chosen)" in dash.drilldown.body.object
    assert "rank 3's CP group [1, 3]" in dash.cpwait.group_note.object
    assert "rank 3 has no snapshot" in dash.memory.text.object  # it shows a rank that has one
    # a click changes data sources, texts and numbers: the document holds the same models
    assert {m.id for m in doc.models} == before


def test_a_step_plot_click_changes_the_step_only(session):
    dash, _ = session
    rank = dash.sel.rank
    dash.overview._tap(_tap(dash.overview.fig, 1.2, 0))
    assert (dash.sel.rank, dash.sel.step) == (rank, 1)
    assert _timeline(dash) == (rank, 1)


def test_a_click_on_a_cp_group_member_selects_it(session):
    dash, _ = session
    whos = dash.cpwait.group_src.data["who"]
    other = whos.index("rank 7 (cp 1)")
    dash.cpwait.group_src.selected.indices = [other]
    assert dash.sel.rank == 7
    assert _timeline(dash)[0] == 7
    dash.cpwait.only_step.value = True  # the group's bars for the selected step alone
    assert f"step {dash.sel.step}: rank" in dash.cpwait.group_note.object


def test_switching_runs_reloads_every_view_and_a_view_that_cannot_read_its_data_says_so(session):
    dash, _ = session
    dash.sel.run_id = "clean"
    assert "no straggler" in dash.overview.verdict.object and dash.overview.verdict.alert_type == "success"
    assert not dash.errors.visible and dash.memory.text.object.endswith("no memory snapshots in this run")
    assert not dash.numerics.body.visible
    dash.sel.run_id = "broken"
    assert dash.errors.visible
    assert "**memory**:" in dash.errors.object and "negative size" in dash.errors.object
    assert "numerics report unreadable" in dash.numerics.note.object
    assert _timeline(dash) == (dash.sel.rank, dash.sel.step)  # the other views carry on
    dash.sel.run_id = "slow"
    assert not dash.errors.visible


def test_a_wide_drilldown_level_shows_its_top_members_the_chosen_and_the_selected():
    from apps.views.drilldown import MAX_MEMBERS, _level_html
    from tracekit.analysis.localize import LevelFinding

    scores = {m: float((m * 7919) % 64) * 1e6 for m in range(64)}  # 64 replicas, scores shuffled
    top = sorted(scores, key=scores.get, reverse=True)[:MAX_MEMBERS]
    low = min(scores, key=scores.get)
    lv = LevelFinding(level="dp", candidates=tuple(scores), scores_ns=scores, chosen=top[0], effect_ns=1e6,
                      noise_ns=1e5, margin=10.0, steps_total=3, steps_standout=3, steps_agree=3, verdict="culprit")
    page = _level_html(lv, selected=low)
    assert all(f"<span>dp {m}</span>" in page or f"<span>dp {m} (selected rank's)</span>" in page for m in top)
    assert f"dp {low} (selected rank's)" in page
    assert f"({64 - MAX_MEMBERS - 1} more, lower)" in page


def test_the_perfetto_button_serves_the_export_of_the_selected_scope(session, tmp_path):
    import gzip
    import json

    dash, _ = session
    whole = json.loads(gzip.decompress(dash._perfetto().read()))
    assert {e["pid"] for e in whole["traceEvents"] if e["ph"] == "X"} == set(range(LAYOUT.world_size))
    assert whole["otherData"]["headline"] == dash.data.diagnosis(dash.sel.run_id).headline
    dash.scope.value = "selected rank's group, selected step"
    some = json.loads(gzip.decompress(dash._perfetto().read()))
    spans = [e for e in some["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(LAYOUT.group(dash.sel.rank, "tp"))
    assert {e["args"]["step"] for e in spans} == {dash.sel.step}


def test_the_whole_job_timeline_marks_the_culprit_and_follows_and_sets_the_selection(session, data):
    from apps.data.jobtimeline import step_window

    dash, _ = session
    job = dash.job
    first = data.diagnosis("slow").findings[0]
    assert first.ranks == (SLOW,) and job.culprit_rows.data == [(SLOW - 0.5, SLOW + 0.5)]
    assert f"culprit rank {SLOW} in red" in job.title.object
    assert job.job.ranks == LAYOUT.world_size and job.job.spans == len(job.job.rects)
    steps = sorted(job.job.steps["step"].unique().to_list())
    lo, hi = step_window(job.job, 2, steps[3])
    job._tapped(x=(lo + hi) / 2, y=2.2)  # what the Tap stream hands over: data coordinates
    assert (dash.sel.rank, dash.sel.step) == (2, steps[3])
    assert (job.box.left, job.box.right, job.box.bottom, job.box.top) == (lo, hi, 1.5, 2.5) and job.box.visible
    dash.heatmap._tap(_tap(dash.heatmap.fig, 1, 6))  # another view's click moves the outline
    lo, hi = step_window(job.job, 6, steps[1])
    assert (job.box.left, job.box.bottom) == (lo, 5.5)


def test_clicks_on_the_memory_curve_and_the_peer_lanes_set_the_selection(session):
    dash, _ = session
    assert dash.sel.rank == SLOW and dash.memory.step_windows  # rank SLOW's memory is on the steps' clock
    other = next(w for w in dash.memory.step_windows if w[0] != dash.sel.step)
    dash.memory._tap(_tap(dash.memory.fig, (other[1] + other[2]) / 2, 0))
    assert (dash.sel.rank, dash.sel.step) == (SLOW, other[0]) and _timeline(dash) == (SLOW, other[0])
    dash.timeline._tap(_tap(dash.timeline.fig, 0, 5.0))  # the selected rank's own lanes: nothing
    assert dash.sel.rank == SLOW
    peer = dash.timeline.focus[1]
    dash.timeline._tap(_tap(dash.timeline.fig, 0, 2.0))  # the peer's collective lane
    assert (dash.sel.rank, dash.sel.step) == (peer, other[0]) and _timeline(dash) == (peer, other[0])
    assert f"rank {peer} has no snapshot" in dash.memory.text.object
