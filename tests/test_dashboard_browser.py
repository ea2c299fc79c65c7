"""The dashboard in a real browser (Debian's headless Chromium driven by Playwright) on a real store:
ByteDance's what-if-analysis traces AR (rank 0, dp 0 stage 0, slowed: the known culprit) and ST
(the last pipeline stage is slow), ingested by tracekit. Screenshots land in the test's tmp dir."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

WIA = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "real" / "wia"
pytestmark = [
    pytest.mark.skipif(not (WIA / "AR").is_dir(), reason=f"real WIA traces not found at {WIA}"),
    pytest.mark.skipif(D.browser_missing() is not None, reason=str(D.browser_missing())),
]


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


def _colours(png: bytes) -> int:
    from PIL import Image

    return len(set(Image.open(io.BytesIO(png)).convert("RGB").get_flattened_data()))


def test_opens_on_the_newest_run_and_the_verdict_names_the_injected_culprit(page, shots):
    page.screenshot(path=str(shots / "01-open.png"), full_page=True)
    verdict = D.text(page, ".tk-verdict")
    assert "rank 0 (dp 0, pp 0, cp 0, tp 0) is the straggler" in verdict
    assert "slow_compute" in verdict
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
    assert "Cause: slow_compute" in drill and "compute_ratio 2.3" in drill
    timeline = D.text(page, ".tk-timeline")
    assert "rank 0: compute" in timeline and "wait" in timeline
    # the plots are drawn, not blank: many distinct colours in the heatmap and the timeline
    heat = page.locator(".tk-heatmap canvas").first
    assert _colours(heat.screenshot(path=str(shots / "02-heatmap.png"))) > 20
    tl = page.locator(".tk-timeline canvas").first
    assert _colours(tl.screenshot(path=str(shots / "03-timeline.png"))) > 5
    # views whose data these traces do not have say so rather than draw nothing
    assert "no context-parallel collectives in this run (cp = 1)" in D.text(page, ".tk-cpwait")
    assert "no memory snapshots in this run" in D.text(page, ".tk-memory")
    assert "no numerics report" in D.text(page, ".tk-numerics")


def test_a_click_on_a_heatmap_cell_updates_the_timeline(page, shots):
    before = D.timeline_title(page)
    low = D.click_heatmap(page, 0.7, 0.65)  # ranks run top to bottom in [dp, pp, cp, tp] order
    page.screenshot(path=str(shots / "04-after-click-low.png"), full_page=True)
    assert low != before and D.focus(page) == low
    high = D.click_heatmap(page, 0.35, 0.3)
    page.screenshot(path=str(shots / "05-after-click-high.png"), full_page=True)
    assert D.focus(page) == high
    assert high[0] < low[0]  # the upper cell is a lower rank
    assert high[1] < low[1]  # the left column is an earlier step
    assert f"rank {high[0]}" in D.text(page, ".tk-focus")


def test_switching_runs(page, shots):
    page.locator("select").first.select_option("ST")
    page.wait_for_function("() => true")
    for _ in range(600):
        if "pipeline stage 3" in D.text(page, ".tk-verdict"):
            break
        page.wait_for_timeout(100)
    page.screenshot(path=str(shots / "06-run-ST.png"), full_page=True)
    assert "pipeline stage 3 holds every replica back" in D.text(page, ".tk-verdict")
    assert "world size 8" in D.text(page, ".tk-overview")


SAMPLE = Path(__file__).resolve().parents[1] / "sample_traces" / "slow_rank_8"


@pytest.mark.skipif(not (SAMPLE / "manifest.json").is_file(), reason=f"bundled sample run not found at {SAMPLE}")
def test_trainer_sample_run_dir_ingested_on_the_fly(tmp_path_factory, browser, shots):
    """`tracekit dashboard <run dir>` on the bundled trainer run with an injected slow rank: its
    verdict names the injected rank, and memory and CP-wait views draw the run's own data."""
    import json
    import shutil

    run = tmp_path_factory.mktemp("sample") / "slow_rank_8"
    shutil.copytree(SAMPLE, run)  # the store is written next to the run; keep the repo clean
    injected = json.loads((run / "manifest.json").read_text())["faults"][0]["ranks"]
    with D.served(run) as url:
        pg = browser
        pg.goto(url)
        D.wait_rendered(pg)
        for _ in range(300):  # the memory and CP views render after the verdict
            if "measured peak" in D.text(pg, ".tk-memory"):
                break
            pg.wait_for_timeout(100)
        pg.screenshot(path=str(shots / "07-sample-slow_rank_8.png"), full_page=True)
        assert (run / "tracekit.duckdb").is_file()
        verdict = D.text(pg, ".tk-verdict")
        assert f"rank {injected[0]} (dp 0, pp 1, cp 0, tp 1) is the straggler" in verdict
        assert "world size 8" in D.text(pg, ".tk-overview") and "slow:rank=5" in D.text(pg, ".tk-overview")
        memory = D.text(pg, ".tk-memory")
        assert f"rank {injected[0]}: measured peak" in memory and "estimate" in memory
        assert "was the last arrival behind" in D.text(pg, ".tk-cpwait")
        assert _colours(pg.locator(".tk-memory canvas").first.screenshot()) > 5
