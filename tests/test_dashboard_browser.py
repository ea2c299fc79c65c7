"""The dashboard in a real browser (Debian's headless Chromium driven by Playwright) on real stores:
ByteDance's what-if-analysis traces AR (rank 0, dp 0 stage 0, slowed: the known culprit) and ST
(the last pipeline stage is slow), ingested by tracekit; and the bundled trainer run slow_rank_8
(rank 5 computes 2x slower), served from its run directory. Screenshots land in the test's tmp dir."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

WIA = Path(__file__).resolve().parent / "fixtures" / "real" / "wia"
SAMPLE = Path(__file__).resolve().parents[1] / "sample_traces" / "slow_rank_8"
pytestmark = pytest.mark.skipif(D.browser_missing() is not None, reason=str(D.browser_missing()))


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from tracekit.ingest import ingest

    path = tmp_path_factory.mktemp("store") / "wia.duckdb"
    ingest([WIA / "ST"], path, workers=1)
    ingest([WIA / "AR"], path, workers=1)  # ingested last: the run the dashboard opens on
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium for the module (Playwright's sync API allows one at a time)."""
    with D.chromium(tmp_path_factory.mktemp("chromium-profile")) as pg:
        yield pg


@pytest.fixture(scope="module")
def page(store, browser):
    with D.served(store) as url:
        browser.goto(url)
        D.wait_rendered(browser)
        yield browser


def _report(store: Path, run: str | None = None) -> dict:
    """`tracekit report --json` on the store: what the page must say."""
    from click.testing import CliRunner

    from tracekit.cli import main

    res = CliRunner().invoke(main, ["report", str(store), "--json"] + (["--run-id", run] if run else []))
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.output)


def _colours(png: bytes) -> int:
    from PIL import Image

    return len(set(Image.open(io.BytesIO(png)).convert("RGB").get_flattened_data()))


def test_opens_on_the_newest_run_and_the_verdict_names_the_injected_culprit(page, store, shots):
    page.screenshot(path=str(shots / "01-open.png"), full_page=True)
    verdict = D.text(page, ".tk-verdict")
    assert "rank 0 (dp 0, pp 0) is a straggler" in verdict
    first = _report(store, "AR")["stragglers"]["findings"][0]
    assert first["ranks"] == [0] and first["cause"] == "slow_compute"
    assert first["summary"] in verdict  # what `tracekit report` says
    assert "slow_compute" in D.text(page, ".tk-findings")
    rank, step = D.focus(page)
    assert rank == 0  # it opens focused on the culprit...
    assert D.timeline_title(page) == (0, step)  # ...and the timeline shows it against a healthy peer
    peer = int(D.text(page, ".tk-timeline-title").split("healthy peer rank ")[1].split()[0])
    assert peer in (4, 8, 12)  # the same pipeline stage in another data-parallel replica


def test_each_view_renders_real_data(page, shots):
    overview = D.text(page, ".tk-overview")
    assert "world size 16" in overview and "dp 4 x pp 4 x cp 1 x tp 1" in overview
    drill = D.text(page, ".tk-drilldown")
    assert "chosen dp 0" in drill and "chosen pp 0" in drill  # the descent, level by level
    assert "dp 0 (selected rank's)" in drill  # the selected rank's coordinate is marked
    said = re.search(r"computes (\d+\.\d+)x", drill)
    # op by op from the parquet: 2.39 (test_analysis_wia._op_ratio)
    assert "Cause: slow_compute" in drill and said and abs(float(said.group(1)) - 2.39) <= 0.05, drill
    timeline = D.text(page, ".tk-timeline")
    assert "rank 0: compute" in timeline and "wait" in timeline
    # the plots are drawn, not blank: many distinct colours in the heatmap and the timeline
    heat = page.locator(".tk-heatmap canvas").first
    assert _colours(heat.screenshot(path=str(shots / "02-heatmap.png"))) > 20
    tl = page.locator(".tk-timeline canvas").first
    assert _colours(tl.screenshot(path=str(shots / "03-timeline.png"))) > 5
    assert _colours(page.locator(".tk-overview canvas").first.screenshot()) > 5
    # views whose data these traces do not have say so rather than draw nothing
    assert "no context-parallel collectives in this run (cp = 1)" in D.text(page, ".tk-cpwait")
    assert "no memory snapshots in this run" in D.text(page, ".tk-memory")
    assert "no numerics report" in D.text(page, ".tk-numerics")


def test_a_click_on_a_heatmap_cell_updates_the_timeline(page, shots):
    before = D.timeline_title(page)
    (rank, step), _ = D.click_heatmap(page, 30, 13)  # ranks run top to bottom in [dp, pp, cp, tp] order
    page.screenshot(path=str(shots / "04-after-click.png"), full_page=True)
    assert (rank, step) != before and rank == 13 and D.focus(page) == (rank, step)
    assert "rank 13: compute" in D.text(page, ".tk-timeline")
    assert "selected rank 13: dp 3, pp 1" in D.text(page, ".tk-drilldown")  # the other views follow
    (rank2, step2), _ = D.click_heatmap(page, 2, 6)
    assert rank2 == 6 and step2 < step  # the left column is an earlier step


def test_a_click_on_the_step_time_plot_selects_that_step_everywhere(page, store, shots):
    import duckdb

    with duckdb.connect(str(store), read_only=True) as con:
        steps = [s for (s,) in con.execute("SELECT DISTINCT step FROM steps WHERE run_id = 'AR' ORDER BY step").fetchall()]
    rank, step = D.focus(page)
    target = steps[3] if step != steps[3] else steps[4]
    D.click_and_wait(page, "tk-steps-fig", target, None, lambda: D.focus(page) == (rank, target))
    D.wait_for(lambda: D.timeline_title(page) == (rank, target), "the timeline never showed the clicked step")
    page.screenshot(path=str(shots / "05-after-step-click.png"), full_page=True)


def test_switching_runs(page, store, shots):
    page.locator("select").first.select_option("ST")
    D.wait_for(lambda: "pipeline stage 3" in D.text(page, ".tk-verdict"), "the verdict never switched to ST")
    page.screenshot(path=str(shots / "06-run-ST.png"), full_page=True)
    assert _report(store, "ST")["stragglers"]["findings"][0]["summary"] in D.text(page, ".tk-verdict")
    assert "world size 8" in D.text(page, ".tk-overview")
    rank, step = D.focus(page)
    assert D.timeline_title(page) == (rank, step)


def test_a_crowded_timeline_ships_a_raster_and_zooming_in_shows_the_spans(tmp_path_factory, browser, shots):
    """GPU-kernel-sized compute spans (thousands per step) reach the browser as busy shares per
    pixel-wide bin; zoomed in, the server sends the spans themselves."""
    from synthetic_job import make_job

    from tracekit.topology import Layout

    path = D.write_store(tmp_path_factory.mktemp("crowded") / "crowded.duckdb",
                         D.with_kernels(make_job(Layout(pp=2, dp=2), steps=2, run_id="crowded")))
    with D.served(path) as url:
        browser.goto(url)
        D.wait_rendered(browser)
        names = D.plot_column(browser, "tk-timeline-fig", "name")
        assert any(n.endswith("% busy") for n in names) and not any(n.startswith("sm90") for n in names)
        assert len(names) < 3000  # not the ~10,000 kernels of the two ranks
        lanes = D.plot_column(browser, "tk-timeline-fig", "lane")
        assert {lane for lane, n in zip(lanes, names) if n.endswith("% busy")} == {"compute"}
        left = D.plot_column(browser, "tk-timeline-fig", "left")
        busy = [x for x, n in zip(left, names) if n.endswith("% busy")]
        D.wheel_zoom(browser, "tk-timeline-fig", busy[len(busy) // 2], 6, notches=10)
        D.wait_for(lambda: any(n.startswith("sm90") for n in D.plot_column(browser, "tk-timeline-fig", "name")),
                   "zooming in never brought the kernels themselves")
        browser.locator(".tk-timeline").first.screenshot(path=str(shots / "09-crowded-zoomed.png"))


@pytest.mark.skipif(not (SAMPLE / "manifest.json").is_file(), reason=f"bundled sample run not found at {SAMPLE}")
def test_trainer_sample_run_dir_ingested_on_the_fly(tmp_path_factory, browser, shots):
    """`tracekit dashboard <run dir>` on the bundled trainer run with an injected slow rank: its
    verdict names the injected rank, memory and CP-wait views draw the run's own data, and a
    click on a CP-group member selects that rank everywhere."""
    run = tmp_path_factory.mktemp("sample") / "slow_rank_8"
    shutil.copytree(SAMPLE, run)  # the store is written next to the run; keep the repo clean
    injected = json.loads((run / "manifest.json").read_text())["faults"][0]["ranks"][0]
    with D.served(run) as url:
        pg = browser
        pg.goto(url)
        D.wait_rendered(pg)
        pg.screenshot(path=str(shots / "07-sample-slow_rank_8.png"), full_page=True)
        assert (run.parent / "slow_rank_8.tracekit.duckdb").is_file()  # tracekit.ingest.cached
        assert f"rank {injected} (" in D.text(pg, ".tk-verdict") and "is a straggler" in D.text(pg, ".tk-verdict")
        assert _report(run.parent / "slow_rank_8.tracekit.duckdb")["stragglers"]["findings"][0]["summary"] \
            in D.text(pg, ".tk-verdict")
        assert "world size 8" in D.text(pg, ".tk-overview") and "slow:rank=5" in D.text(pg, ".tk-overview")
        memory = D.text(pg, ".tk-memory")
        assert f"rank {injected}: measured peak" in memory and "estimate" in memory
        assert _colours(pg.locator(".tk-memory canvas").first.screenshot()) > 5
        cp = D.text(pg, ".tk-cpwait")
        assert "exposed CP communication is" in cp and f"rank {injected}'s CP group [5, 7]" in cp
        D.click_and_wait(pg, "tk-cp-group-fig", ["rank 7 (cp 1)", "waited"], None, lambda: D.focus(pg)[0] == 7)
        D.wait_for(lambda: D.timeline_title(pg)[0] == 7, "the timeline never followed the CP-group click")
        assert "rank 7: measured peak" in D.text(pg, ".tk-memory")
        pg.screenshot(path=str(shots / "08-sample-after-cp-click.png"), full_page=True)
