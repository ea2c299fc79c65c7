"""The dashboard's data access (apps/data.py) on real DuckDB stores: what each view is given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_job import Faults, make_job  # noqa: E402

pytest.importorskip("panel", reason="the dashboard extra is not installed (pip install 'tracekit[dashboard]')")

from apps.data import TIMELINE_SPANS_PER_LANE, DashboardData, decimate  # noqa: E402
from tracekit.cli import main  # noqa: E402
from tracekit.store import StoreError, connect  # noqa: E402
from tracekit.topology import Layout  # noqa: E402

LAYOUT = Layout(tp=2, cp=2, pp=2, dp=2)
SLOW = 5  # dp 0, pp 1, cp 0, tp 1


def _write(path: Path, tables: dict[str, pl.DataFrame], when: str) -> None:
    con = connect(path)
    for name, df in tables.items():
        con.register("frame", df.to_arrow())
        con.execute(f"INSERT INTO {name} SELECT * FROM frame")
        con.unregister("frame")
    con.execute("UPDATE runs SET ingested_at = ?::TIMESTAMP WHERE ingested_at IS NULL", [when])
    con.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dash")
    path = root / "store.duckdb"
    _write(path, make_job(LAYOUT, steps=6, run_id="clean"), "2026-01-01 00:00:00")
    slow = make_job(LAYOUT, steps=6, faults=Faults(slow_rank=SLOW, slow_factor=1.5), run_id="slow")
    run_dir = root / "slow-run"
    run_dir.mkdir()
    (run_dir / "numerics.json").write_text(json.dumps([{"check": "bitwise", "ok": True, "max_ulp": 0}]))
    slow["runs"] = slow["runs"].with_columns(pl.lit(str(run_dir)).alias("root"))
    _write(path, slow, "2026-01-02 00:00:00")
    return path


@pytest.fixture(scope="module")
def data(store):
    d = DashboardData(store)
    yield d
    d.close()


def test_newest_run_first_and_the_verdict(data):
    assert data.runs()["run_id"].to_list() == ["slow", "clean"]
    assert data.newest_run() == "slow"
    assert data.diagnosis("slow").localization.culprit_rank == SLOW
    with pytest.raises(StoreError, match="no run 'nope'"):
        data.run_info("nope")


def test_rank_step_grid_and_the_slow_rank_stands_out(data):
    rs = data.rank_step("slow")
    assert rs.height == LAYOUT.world_size * 6
    assert rs.filter(pl.col("rank") == SLOW).select("dp", "pp", "cp", "tp").row(0) == (0, 1, 0, 1)
    per_rank = rs.group_by("rank").agg(pl.col("lateness_ms").mean(), pl.col("wait_share").mean())
    assert per_rank.sort("lateness_ms")["rank"][-1] == SLOW  # peers waited on it most
    assert per_rank.sort("wait_share")["rank"][0] == SLOW  # and it waited least
    assert rs["wait_share"].is_between(0, 1).all()


def test_timeline_splits_collectives_into_wait_and_transfer(data):
    peer = data.healthy_peer("slow", SLOW)
    assert peer == LAYOUT.rank_of(dp=1, pp=1, cp=0, tp=1)  # same position, the other replica
    tl = data.timeline("slow", [SLOW, peer], 2)
    assert set(tl["rank"].unique()) == {SLOW, peer}
    assert {"compute", "wait", "transfer"} <= set(tl["kind"].unique())
    assert (tl["end_ms"] >= tl["start_ms"]).all() and tl["start_ms"].min() == 0
    waits = tl.filter(pl.col("kind") == "wait").group_by("rank").agg(
        (pl.col("end_ms") - pl.col("start_ms")).sum().alias("w"))
    w = dict(waits.iter_rows())
    assert w[peer] > w[SLOW]  # the healthy peer waits for the slow rank, not the other way round


def test_cp_wait_names_the_last_arrival(data):
    cp = data.cp_wait("slow")
    assert cp.height == LAYOUT.world_size
    assert cp.sort("others_waited_ms")["rank"][-1] == SLOW
    one = data.cp_wait("slow", step=3)
    assert one["collectives"].sum() < cp["collectives"].sum()


def test_decimate_merges_dense_spans_only_when_a_lane_is_crowded():
    n = TIMELINE_SPANS_PER_LANE * 3
    spans = pl.DataFrame({"rank": [0] * n, "lane": ["compute"] * n, "kind": ["compute"] * n,
                          "name": ["op"] * n, "s": [i * 10 for i in range(n)], "e": [i * 10 + 9 for i in range(n)]})
    merged = decimate(spans, min_gap=5)
    assert merged.height == 1 and merged["s"][0] == 0 and merged["e"][0] == (n - 1) * 10 + 9
    assert "merged" in merged["name"][0]
    assert decimate(spans.head(10), min_gap=5).height == 10


def test_numerics_report_from_the_run_directory(data):
    rep = data.numerics("slow")
    assert rep is not None and rep.to_dicts() == [{"check": "bitwise", "ok": True, "max_ulp": 0}]
    assert data.numerics("clean") is None
    assert data.memory_ranks("slow") == []  # no memory snapshots: the view says so


def test_cli_rejects_what_is_not_a_store(tmp_path):
    bad = tmp_path / "notes.duckdb"
    bad.write_text("not a database")
    r = CliRunner().invoke(main, ["dashboard", str(bad), "--port", "1"])
    assert r.exit_code == 2
    assert str(bad) in r.output or "cannot open store" in r.output
