"""The dashboard's data access (apps/data/) on real DuckDB stores: what each view is given.

Stores: the discrete-event job model (tests/synthetic_job.py) with a slowed rank, written into a
real store, and the bundled trainer run sample_traces/cp_imbalance_8 (long documents on CP rank 1)
ingested by tracekit."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dashboard as D  # noqa: E402

pytest.importorskip("panel", reason="the dashboard extra is not installed (pip install 'tracekit[dashboard]')")

from apps.data import DashboardData  # noqa: E402
from apps.data.cpwait import by_position, group_members  # noqa: E402
from apps.data.heatmap import rank_step  # noqa: E402
from apps.data.memory import MEMORY_POINTS, rank_curve  # noqa: E402
from apps.data.numerics import numerics_report  # noqa: E402
from apps.data.overview import initial_focus, step_times  # noqa: E402
from apps.data.timeline import TIMELINE_BINS, healthy_peer, lane_glyphs, step_spans  # noqa: E402
from tracekit.cli import main  # noqa: E402
from tracekit.store import StoreError  # noqa: E402
from tracekit.topology import Layout  # noqa: E402

LAYOUT = Layout(tp=2, cp=2, pp=2, dp=2)
SLOW = D.SLOW  # dp 0, pp 1, cp 0, tp 1
SAMPLE = Path(__file__).resolve().parents[1] / "sample_traces" / "cp_imbalance_8"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return D.job_store(tmp_path_factory.mktemp("dash"), 5 * MEMORY_POINTS)


@pytest.fixture(scope="module")
def data(store):
    d = DashboardData(store)
    yield d
    d.close()


@pytest.fixture(scope="module")
def cp_sample(tmp_path_factory):
    if not (SAMPLE / "manifest.json").is_file():
        pytest.skip(f"bundled sample run not found at {SAMPLE}")
    from tracekit.ingest import ingest

    root = tmp_path_factory.mktemp("cp")
    shutil.copytree(SAMPLE, root / SAMPLE.name)
    ingest([root / SAMPLE.name], root / "cp.duckdb", workers=1)
    d = DashboardData(root / "cp.duckdb")
    yield d, json.loads((SAMPLE / "manifest.json").read_text())
    d.close()


def test_newest_run_first_the_verdict_and_where_it_opens(data):
    assert data.runs() == ["slow", "clean", "broken"]
    assert data.newest_run() == "slow"
    assert data.diagnosis("slow").localization.culprit_rank == SLOW
    rank, step = initial_focus(data, "slow")
    st = step_times(data, "slow")
    assert rank == SLOW and st.filter(pl.col("step") == step)["max_ms"][0] == st["max_ms"].max()
    assert st["ranks"].to_list() == [LAYOUT.world_size] * 6
    with pytest.raises(StoreError, match="no run 'nope'"):
        data.run_info("nope")


def test_rank_step_grid_with_coordinates_and_the_slow_rank_stands_out(data):
    rs = rank_step(data, "slow")
    assert rs.height == LAYOUT.world_size * 6
    for r in (0, SLOW, LAYOUT.world_size - 1):  # every row of a rank carries that rank's coordinates
        c = LAYOUT.coords(r)
        assert rs.filter(pl.col("rank") == r).select("dp", "pp", "cp", "tp").unique().rows() == [
            (c.dp, c.pp, c.cp, c.tp)]
    per_rank = rs.group_by("rank").agg(pl.col("lateness_ms").mean(), pl.col("wait_share").mean())
    assert per_rank.sort("lateness_ms")["rank"][-1] == SLOW  # peers waited on it most
    assert per_rank.sort("wait_share")["rank"][0] == SLOW  # and it waited least
    assert rs["wait_share"].is_between(0, 1).all()


def test_timeline_splits_collectives_into_wait_and_transfer(data):
    peer = healthy_peer(data, "slow", SLOW)
    assert peer == LAYOUT.rank_of(dp=1, pp=1, cp=0, tp=1)  # same position, the other replica
    tl, origin = step_spans(data, "slow", [SLOW, peer], 2)
    step = data.sql("SELECT start_ns FROM steps WHERE run_id = 'slow' AND rank = $k AND step = 2", {"k": SLOW})
    # ms from when the selected rank began the step, on the common clock: the job model's hosts share
    # one clock, so the offset estimated from the collectives is within a transfer's skew (< 1 us)
    assert origin == pytest.approx(step["start_ns"][0], abs=1_000)
    assert set(tl["rank"].unique()) == {SLOW, peer}
    assert {"compute", "wait", "transfer", "send", "recv"} <= set(tl["kind"].unique())
    assert (tl["end_ms"] >= tl["start_ms"]).all()
    w = dict(tl.filter(pl.col("kind") == "wait").group_by("rank").agg(
        (pl.col("end_ms") - pl.col("start_ms")).sum()).iter_rows())
    assert w[peer] > w[SLOW]  # the healthy peer waits for the slow rank, not the other way round
    glyphs, rastered = lane_glyphs(tl)
    assert not rastered and glyphs.height == tl.height and (glyphs["share"] == 1).all()


def test_a_crowded_lane_ships_as_an_occupancy_raster_and_resolves_when_zoomed():
    n = 40_000  # 10 us kernels every 25 us on one rank, and a quiet second lane
    start = np.arange(n) * 0.025
    spans = pl.DataFrame({"rank": [0] * n + [1], "lane": ["compute"] * n + ["p2p"], "kind": ["compute"] * n + ["recv"],
                          "name": ["k"] * (n + 1), "start_ms": np.append(start, 3.0),
                          "end_ms": np.append(start + 0.010, 4.0)}).cast({"rank": pl.Int32})
    glyphs, rastered = lane_glyphs(spans)
    assert rastered
    crowded = glyphs.filter(pl.col("rank") == 0)
    assert crowded.height <= TIMELINE_BINS  # one rectangle per bin, not per span
    busy = ((crowded["end_ms"] - crowded["start_ms"]) * crowded["share"]).sum()
    assert busy == pytest.approx(n * 0.010, rel=1e-6)  # the raster keeps every span's busy time
    assert crowded["share"].mean() == pytest.approx(0.4, abs=0.01)
    assert crowded["spans"].sum() >= n and "spans" in crowded["name"][0]
    assert glyphs.filter(pl.col("rank") == 1).rows() == [(1, "p2p", "recv", "k", 3.0, 4.0, 1.0, 1, False)]
    assert crowded["binned"].all()
    zoomed, rastered = lane_glyphs(spans, window=(100.0, 101.0))  # 40 kernels in view: themselves
    assert not rastered
    assert zoomed.filter(pl.col("rank") == 0).height == 41 and (zoomed["share"] == 1).all()


def test_cp_wait_names_the_last_arrival(data):
    pos = by_position(data, "slow")
    assert pos["cp"].to_list() == [0, 1]
    assert pos.sort("others_waited_ms")["cp"][-1] == LAYOUT.coords(SLOW).cp
    members = group_members(data, "slow", SLOW)
    assert members["rank"].to_list() == list(LAYOUT.group(SLOW, "cp"))
    assert members.sort("others_waited_ms")["rank"][-1] == SLOW
    one = group_members(data, "slow", SLOW, step=3)
    assert 0 < one["instances"].sum() < members["instances"].sum()


def test_cp_wait_on_the_cp_imbalance_sample_blames_the_loaded_cp_rank(cp_sample):
    """The fault put the long documents on CP rank 1: it arrives last at the CP collectives. The
    run also has flight-recorder rows for the same collectives; counting those as well (as an
    earlier version of the dashboard did) turned the answer round to CP rank 0."""
    data, manifest = cp_sample
    (loaded,) = manifest["faults"][0]["cp_ranks"]
    run = data.newest_run()
    pos = by_position(data, run)
    assert pos.sort("others_waited_ms")["cp"][-1] == loaded
    assert pos.sort("last")["cp"][-1] == loaded
    lib = data.cp_wait(run).per_rank  # the library's split agrees: the other CP rank does the waiting
    by_cp = lib.with_columns(pl.col("rank").map_elements(lambda r: data.coords(run, r).cp, return_dtype=pl.Int64)
                             .alias("cp")).group_by("cp").agg(pl.col("wait_ns").sum())
    assert by_cp.sort("wait_ns")["cp"][-1] != loaded


def test_memory_curve_on_the_steps_clock_and_off_it(data):
    on = rank_curve(data, "slow", SLOW)
    assert on.on_step_clock and on.points.height <= 2 * MEMORY_POINTS
    assert on.points["t_ns"].is_sorted()
    assert on.peak_mib == pytest.approx(on.points["allocated_mib"].max())  # thinning kept the spike
    assert on.peak_mib > 64
    lo, hi = on.steps["start_ns"].min(), on.steps["end_ns"].max()
    assert lo <= on.peak_t_ns <= hi
    off = rank_curve(data, "slow", 0)
    assert not off.on_step_clock and off.points.height == 300


def test_numerics_report_from_the_run_directory(data):
    rep = numerics_report(data, "slow")
    assert rep is not None and rep.rows.height == 297 and not rep.bit_exact
    # the check's own verdict, as `numerics check` prints it
    assert rep.headline.startswith("backward: the loss matches; the first wrong gradient in backward order is "
                                   "layers.3.mlp_norm.weight")
    assert rep.detail.startswith("BUG: first diverging buffer 'grad/layers.3.mlp_norm.weight'")
    assert numerics_report(data, "clean") is None


def test_numerics_headline_from_the_rows_when_the_verdict_file_is_missing(data, tmp_path):
    from apps.data.numerics import _first_divergent

    rows = pl.read_json(D.NUMERICS / "numerics.json")
    head, detail, exact = _first_divergent(rows)
    assert head == "first diverging buffer grad/layers.3.mlp_norm.weight at step 0" and not exact
    assert detail.startswith("266 of 297 buffers differ; 64/64 elements of the first")
    assert _first_divergent(rows.with_columns(pl.lit(0).alias("mismatches")))[2]


def test_what_cannot_be_read_fails_with_an_error_that_says_what(data, store):
    from tracekit.analysis.memory import MemoryDataError

    with pytest.raises(MemoryDataError, match="negative size"):
        rank_curve(data, "broken", 0)
    with pytest.raises(StoreError, match=r"broken-run/numerics.json: not valid JSON"):
        numerics_report(data, "broken")


def test_cli_rejects_what_is_not_a_store(tmp_path):
    bad = tmp_path / "notes.duckdb"
    bad.write_text("not a database")
    r = CliRunner().invoke(main, ["dashboard", str(bad), "--port", "1"])
    assert r.exit_code == 2
    assert str(bad) in r.output


def test_memory_peaks_are_the_cli_s_on_the_trainer_sample(cp_sample, tmp_path):
    """The page's peak per rank is `tracekit memory`'s (the blocks live in the snapshot that the
    trace never saw allocated count too; the trace alone read 0.24 MiB against the CLI's 0.44)."""
    data, _ = cp_sample
    out = CliRunner().invoke(main, ["memory", str(data.path), "--json"])
    assert out.exit_code == 0, out.output
    cli = {p["rank"]: p for p in json.loads(out.output)["peaks"]}
    run = data.newest_run()
    for rank in (0, 3, 6):
        curve = rank_curve(data, run, rank)
        assert curve.peak_mib * 2**20 == pytest.approx(cli[rank]["peak_allocated"])
        assert curve.peak_frame == (cli[rank]["peak_frame"] or "<unknown>")
        assert curve.sites["bytes"].sum() == cli[rank]["peak_allocated"]
