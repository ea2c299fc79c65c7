"""The dashboard over a Parquet dataset store (tracekit.dataset: a directory `tracekit.open` reads
like a DuckDB file), in a real browser (Debian's headless Chromium via Playwright): a simulated
job's store exported to a dataset, served with `tracekit dashboard DIR`, shows what `tracekit
report DIR --json` says (the same as on the DuckDB file), and its views follow a click."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

pytestmark = pytest.mark.skipif(D.browser_missing() is not None, reason=str(D.browser_missing()))
SLOW = 5


def _report(store: Path) -> dict:
    from tracekit.cli import main

    res = CliRunner().invoke(main, ["report", str(store), "--json"])
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.output)


def test_a_dataset_directory_is_served_like_a_store_file(tmp_path):
    from tracekit.dataset import export_store, is_dataset
    from tracekit.ingest import ingest
    from tracekit.simulate import SimConfig, simulate

    run = simulate(SimConfig(tp=2, pp=2, dp=2, steps=6, seed=2, faults=(f"slow:rank={SLOW},factor=1.5",)),
                   tmp_path / "slow")
    ingest([run], tmp_path / "sim.duckdb", workers=1)
    export_store(tmp_path / "sim.duckdb", tmp_path / "dataset")
    assert is_dataset(tmp_path / "dataset") and not list((tmp_path / "dataset").glob("*.duckdb"))
    from_file, from_dataset = _report(tmp_path / "sim.duckdb"), _report(tmp_path / "dataset")
    assert from_dataset["stragglers"]["findings"] == from_file["stragglers"]["findings"]
    finding = from_dataset["stragglers"]["findings"][0]
    assert finding["ranks"] == [SLOW]
    with D.served(tmp_path / "dataset") as url, D.chromium(tmp_path / "profile") as page:
        page.goto(url)
        D.wait_rendered(page)
        assert finding["summary"] in D.text(page, ".tk-verdict")
        assert D.focus(page)[0] == SLOW  # it opens on the culprit
        table = D.text(page, ".tk-findings")
        assert all(f["where"] in table for f in from_dataset["stragglers"]["findings"][:4])
        (rank, step), _ = D.click_heatmap(page, 2, 1)
        assert (rank, D.focus(page)) == (1, (1, step))
        D.wait_every_view(page)
        assert D.wait_job_raster(page, 60_000)
        assert f"culprit rank {SLOW} in red" in D.text(page, ".tk-job-title")
        page.screenshot(path=str(tmp_path / "dataset.png"), full_page=True)
    assert not list(tmp_path.glob("*.tracekit.duckdb"))  # read in place, not ingested into a store file
