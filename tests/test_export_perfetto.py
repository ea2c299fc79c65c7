"""`tracekit export perfetto`: one Chrome-JSON trace of a simulated job (hosts with skewed clocks),
read back as Perfetto's JSON importer reads it: every stored span once per rank, on the common
clock, with the diagnosis' findings annotated; bad input exits 2 with one line."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from tracekit.cli import main


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from tracekit.ingest import ingest
    from tracekit.simulate import SimConfig, simulate

    root = tmp_path_factory.mktemp("export")
    run = simulate(SimConfig(tp=2, pp=2, dp=2, steps=3, seed=3, skew_ms=500.0, ranks_per_host=2,
                             faults=("slow:rank=5,factor=1.6",)), root / "sim")
    ingest([run], root / "sim.duckdb", workers=1)
    return root / "sim.duckdb"


def _export(store: Path, out: Path, *args: str) -> dict:
    res = CliRunner().invoke(main, ["export", "perfetto", str(store), "--out", str(out), *args])
    assert res.exit_code == 0, res.output
    opener = gzip.open if out.suffix == ".gz" else open
    with opener(out, "rt") as fh:
        return json.load(fh)


def _stored(store: Path, where: str = "") -> dict:
    with duckdb.connect(str(store), read_only=True) as con:
        return dict(con.execute(f"SELECT rank, count(*) FROM events WHERE true {where} GROUP BY rank").fetchall())


def test_all_ranks_every_span_once_on_the_common_clock_with_the_findings(store, tmp_path):
    trace = _export(store, tmp_path / "all.json")
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert Counter(e["pid"] for e in spans) == _stored(store)  # the same span count per rank
    from tracekit.perfetto import clock_offsets
    from tracekit.store import Store

    with Store(store) as st:  # ingest stores none: estimated from the collectives
        offsets = dict(clock_offsets(st, st.newest_run()).iter_rows())
    with duckdb.connect(str(store), read_only=True) as con:
        first = dict(con.execute("SELECT rank, min(ts_ns) FROM events GROUP BY rank").fetchall())
    assert len({o for o in offsets.values()}) > 1  # the hosts' clocks were skewed and are aligned
    origin = trace["otherData"]["origin_ns"]
    for rank, ts in first.items():  # each rank's first span where its offset puts it
        mine = min(e["ts"] for e in spans if e["pid"] == rank)
        assert mine == pytest.approx((ts - (offsets[rank] or 0) - origin) / 1e3, abs=1e-3)
    assert max(first.values()) - min(first.values()) > 100e6  # raw: 0.1 s+ apart; aligned: not
    assert max(min(e["ts"] for e in spans if e["pid"] == r) for r in first) < 100e3
    report = json.loads(CliRunner().invoke(main, ["report", str(store), "--json"]).output)
    findings = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert [e["args"]["ranks"] for e in findings] == [f["ranks"] for f in report["stragglers"]["findings"]]
    assert trace["otherData"]["headline"] == report["stragglers"]["headline"] and 5 in findings[0]["args"]["ranks"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names[5].endswith("CULPRIT") and "CULPRIT" not in names[0]


def test_chosen_ranks_and_steps_gzipped(store, tmp_path):
    trace = _export(store, tmp_path / "some.json.gz", "--ranks", "0,4-5", "--steps", "1-2")
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert Counter(e["pid"] for e in spans) == _stored(store, "AND rank IN (0, 4, 5) AND step IN (1, 2)")
    assert {e["args"]["step"] for e in spans} == {1, 2}


@pytest.mark.parametrize("args, message", [(["--ranks", "99"], "has no rank 99"), (["--steps", "40"], "has no step 40"),
                                           (["--ranks", "x"], "must look like 0,3,8-11")])
def test_bad_input_exits_2_with_one_line(store, tmp_path, args, message):
    res = CliRunner().invoke(main, ["export", "perfetto", str(store), "--out", str(tmp_path / "x.json"), *args])
    assert res.exit_code == 2 and message in res.output
    assert not (tmp_path / "x.json").exists()
