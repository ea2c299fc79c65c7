"""The dashboard's whole-job, hang, numerics and memory views in a real browser (Debian's headless
Chromium via Playwright) on stores of simulated jobs (`tracekit simulate`: a slow rank, a hang)
and of the job model with a real `numerics check` report. What the page says is checked against
`tracekit report --json` and `tracekit memory --json` on the same store: one source."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

pytestmark = pytest.mark.skipif(D.browser_missing() is not None, reason=str(D.browser_missing()))
SLOW, HUNG = 5, 3  # the simulated slow rank, the simulated rank that never joins


def _cli(*args: str) -> dict:
    from tracekit.cli import main

    res = CliRunner().invoke(main, list(args))
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.output)


@pytest.fixture(scope="module")
def sim_store(tmp_path_factory) -> Path:
    """Two simulated runs of tp 2 x pp 2 x dp 2: "slow" (rank 5 1.5x) and "hang" (rank 3 stops in
    step 3), ingested in that order (the page opens on the hang)."""
    from tracekit.ingest import ingest
    from tracekit.simulate import SimConfig, simulate

    root = tmp_path_factory.mktemp("sim")
    for name, fault in (("slow", f"slow:rank={SLOW},factor=1.5"), ("hang", f"hang:rank={HUNG},step=3,dim=dp")):
        run = simulate(SimConfig(tp=2, pp=2, dp=2, steps=6, seed=2, faults=(fault,)), root / name)
        ingest([run], root / "sim.duckdb", workers=1)
    return root / "sim.duckdb"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with D.chromium(tmp_path_factory.mktemp("chromium-profile")) as pg:
        yield pg


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def visible(page, css: str) -> bool:
    return page.locator(css).first.is_visible()


def test_hang_view_then_straggler_run_whole_job_timeline_and_linked_clicks(sim_store, browser, shots):
    hang = _cli("report", str(sim_store), "--run-id", "hang", "--json")
    slow = _cli("report", str(sim_store), "--run-id", "slow", "--json")
    with D.served(sim_store) as url:
        page = browser
        page.goto(url)
        page.locator(".tk-hang-headline").first.wait_for(timeout=120_000)
        page.locator(".tk-job-plot canvas").first.wait_for(timeout=120_000)
        page.wait_for_timeout(500)
        page.screenshot(path=str(shots / "hang.png"), full_page=True)
        # the hang view, from the same HangReport as `tracekit report` / `tracekit hangs`
        assert hang["hangs"]["hung"] and hang["hangs"]["culprits"] == [HUNG]
        assert hang["hangs"]["headline"] in D.text(page, ".tk-hang")
        assert hang["stragglers"]["headline"].replace("`", "") in D.text(page, ".tk-verdict")  # markdown code
        rows = D.text(page, ".tk-hang-ranks")
        assert f"{HUNG} dp 0, pp 1, tp 1 never joined (culprit)" in rows
        assert rows.count("blocked") == len(hang["hangs"]["blocked"])
        # instead of the straggler plots, not beside them
        assert not visible(page, ".tk-heatmap") and not visible(page, ".tk-drilldown")
        assert f"culprit rank {HUNG}" in D.text(page, ".tk-job-title")

        page.locator("select").first.select_option("slow")
        D.wait_for(lambda: visible(page, ".tk-heatmap") and not visible(page, ".tk-hang"),
                   "the straggler views never came back on the straggler run")
        page.locator(".tk-heatmap canvas").first.wait_for(timeout=60_000)
        finding = slow["stragglers"]["findings"][0]
        assert finding["ranks"] == [SLOW]
        assert finding["summary"] in D.text(page, ".tk-verdict")
        table = D.text(page, ".tk-findings")
        assert all(f["where"] in table and f["cause"] in table for f in slow["stragglers"]["findings"][:6])
        assert f"culprit rank {SLOW} in red" in D.text(page, ".tk-job-title")
        assert D.focus(page)[0] == SLOW  # it opens on the culprit
        page.screenshot(path=str(shots / "slow.png"), full_page=True)

        # a click on the whole-job raster selects the rank under it and the step it was in
        import duckdb

        with duckdb.connect(str(sim_store), read_only=True) as con:
            first, s2, e2 = con.execute(
                "SELECT (SELECT min(start_ns) FROM steps WHERE run_id = 'slow'), start_ns, end_ns FROM steps "
                "WHERE run_id = 'slow' AND rank = 6 AND step = 2").fetchone()
        x = ((s2 + e2) / 2 - first) / 1e6
        D.click_and_wait(page, "tk-job-fig", x, 6, lambda: D.focus(page) == (6, 2))
        D.wait_for(lambda: D.timeline_title(page) == (6, 2), "the step timeline never followed the job click")
        assert "selected rank 6" in D.text(page, ".tk-drilldown")
        # and a heatmap click moves the job timeline's outline with the rest (same selection)
        (rank, step), _ = D.click_heatmap(page, 4, 1)
        assert (rank, step) == (1, 4) and D.focus(page) == (1, 4)
        page.locator(".tk-job-timeline").first.screenshot(path=str(shots / "job-timeline.png"))


def test_numerics_and_memory_views_say_what_the_clis_say(tmp_path_factory, browser, shots):
    store = D.job_store(tmp_path_factory.mktemp("job"), 600)
    memory = _cli("memory", str(store), "--run-id", "slow", "--json")
    verdict = json.loads((D.NUMERICS / "numerics_verdict.json").read_text())
    with D.served(store) as url:
        page = browser
        page.goto(url)
        D.wait_rendered(page)
        page.locator(".tk-numerics-table").first.wait_for(timeout=60_000)
        num = D.text(page, ".tk-numerics")
        assert "the first wrong gradient in backward order is layers.3.mlp_norm.weight" in num
        assert verdict["diagnosis"] in num and "266 of 297 buffers differ" in num
        # compact and paged: a page of rows, not 297 (nor 266) of them
        shown = page.locator(".tk-numerics-table .tabulator-row").count()
        assert 0 < shown <= 12
        page.locator(".tk-numerics").first.screenshot(path=str(shots / "numerics.png"))
        mem = D.text(page, ".tk-memory")
        peak = {p["rank"]: p["peak_allocated"] for p in memory["peaks"]}[D.SLOW]
        assert f"rank {D.SLOW}: measured peak {peak / 2**20:.4g} MiB" in mem
        assert "allocated by <unknown>" in mem and "recorded no stacks" in mem
        assert "allocation site" in D.text(page, ".tk-memory-sites")
        page.locator(".tk-memory").first.screenshot(path=str(shots / "memory.png"))
