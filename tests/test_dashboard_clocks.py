"""The dashboard's views on one clock: a simulated job whose hosts' clocks are skewed by up to
0.5 s (ingest stores no offsets) is drawn with the clocks aligned as `tracekit export perfetto`
aligns them. The oracle is the simulator's ground truth (each host's skew, in the manifest) and
the exported trace file, never the dashboard's code."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import duckdb
import polars as pl
import pytest
from click.testing import CliRunner

pytest.importorskip("panel", reason="the dashboard extra is not installed (pip install 'tracekit[dashboard]')")

from apps.data import DashboardData  # noqa: E402
from apps.data.jobtimeline import job_timeline  # noqa: E402
from apps.data.timeline import step_spans  # noqa: E402
from tracekit.cli import main  # noqa: E402

RANKS_PER_HOST = 2


@pytest.fixture(scope="module")
def skewed(tmp_path_factory) -> tuple[Path, dict]:
    from tracekit.ingest import ingest
    from tracekit.simulate import SimConfig, simulate

    root = tmp_path_factory.mktemp("skew")
    run = simulate(SimConfig(tp=2, pp=2, dp=2, steps=3, seed=3, skew_ms=500.0, ranks_per_host=RANKS_PER_HOST,
                             faults=("slow:rank=5,factor=1.6",)), root / "sim")
    ingest([run], root / "sim.duckdb", workers=1)
    return root / "sim.duckdb", json.loads((run / "manifest.json").read_text())


def _raw_step_starts(store: Path, step: int) -> dict[int, int]:
    with duckdb.connect(str(store), read_only=True) as con:
        return dict(con.execute("SELECT rank, start_ns FROM steps WHERE step = ?", [step]).fetchall())


def test_the_views_remove_each_host_s_skew_as_the_perfetto_export_does(skewed, tmp_path):
    store, manifest = skewed
    skew = manifest["simulated"]["skew_ms_by_host"]
    with duckdb.connect(str(store), read_only=True) as con:  # ingest leaves the offsets empty
        assert con.execute("SELECT count(clock_offset_ns) FROM ranks").fetchone()[0] == 0
    data = DashboardData(store)
    try:
        run = data.newest_run()
        job = job_timeline(data, run)
        step = int(job.steps["step"].min())
        raw = _raw_step_starts(store, step)
        assert max(raw.values()) - min(raw.values()) > 100e6  # as recorded: 0.1 s+ apart
        shown = dict(job.steps.filter(job.steps["step"] == step).select("rank", "start_ms").iter_rows())
        for rank, start in raw.items():  # what the view removed is the host's skew (vs rank 0's host)
            removed_ms = (start - job.origin_ns) / 1e6 - shown[rank]
            truth_ms = skew[rank // RANKS_PER_HOST] - skew[0]
            assert removed_ms == pytest.approx(truth_ms, abs=1.0), rank
        aligned = list(shown.values())
        assert max(aligned) - min(aligned) < 5.0  # a step starts within ms on every rank once aligned

        # the same offsets as the Perfetto export's: each rank's first span lands at the same place
        out = tmp_path / "trace.json.gz"
        res = CliRunner().invoke(main, ["export", "perfetto", str(store), "--out", str(out), "--steps", str(step)])
        assert res.exit_code == 0, res.output
        with gzip.open(out, "rt") as fh:
            trace = json.load(fh)
        with duckdb.connect(str(store), read_only=True) as con:
            first = dict(con.execute("SELECT rank, min(ts_ns) FROM events WHERE step = ? GROUP BY rank",
                                     [step]).fetchall())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        origin = trace["otherData"]["origin_ns"]
        for rank, ts in first.items():
            exported_ns = min(e["ts"] for e in spans if e["pid"] == rank) * 1e3 + origin
            perfetto_offset = ts - exported_ns
            dash_offset = (raw[rank] - job.origin_ns) - shown[rank] * 1e6
            assert dash_offset == pytest.approx(perfetto_offset, abs=2e3), rank

        # the step timeline too: the slow rank and a peer on another host begin the step together
        spans_df, origin_ns = step_spans(data, run, [5, 1], step)
        t = dict(spans_df.group_by("rank").agg(pl.col("start_ms").min()).iter_rows())
        assert abs(t[5] - t[1]) < 5.0 and (raw[5] - raw[1]) / 1e6 != pytest.approx(0.0, abs=50.0)
    finally:
        data.close()
