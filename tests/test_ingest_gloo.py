"""A real 4-rank gloo run (tp=2, dp=2) profiled with torch.profiler, its flight-recorder dumps and
CPU-derived memory snapshots, ingested as a trainer run directory."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import tracekit
from tracekit.cli import main as cli_main
from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
import _gloo_run  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gloo") / "run"
    _gloo_run.make_run(out)
    # JSON dumps of the same recorder go to their own "run": within one run they would duplicate ranks
    shutil.move(str(out / "fr_json"), str(out.parent / "fr_json"))
    return out


@pytest.fixture(scope="module")
def store(run_dir: Path) -> Path:
    db = run_dir.parent / "gloo.duckdb"
    report = ingest([run_dir], db, workers=2)
    assert not report.failed, [f.error for f in report.failed]
    assert len(report.ok) == 12 and not report.missing
    return db


def test_run_topology_from_manifest(store: Path) -> None:
    with tracekit.open(store) as s:
        run = s.table("runs").row(0, named=True)
        assert (run["run_id"], run["source"], run["layout_source"], run["backend"]) == \
            ("gloo-fixture", "trainer", "manifest", "gloo")
        assert (run["world_size"], run["tp"], run["dp"], run["pp"], run["cp"]) == (4, 2, 2, 1, 1)
        assert json.loads(run["manifest"])["config"]["tp"] == 2
        ranks = s.sql("SELECT rank, dp, tp, pid IS NOT NULL AS has_pid FROM ranks ORDER BY rank").rows()
        assert ranks == [(0, 0, 0, True), (1, 0, 1, True), (2, 1, 0, True), (3, 1, 1, True)]
        groups = {tuple(r): d for r, d in s.sql("SELECT ranks, dim FROM groups").rows()}
        assert groups[(0, 1)] == "tp" and groups[(2, 3)] == "tp"
        assert groups[(0, 2)] == "dp" and groups[(1, 3)] == "dp"


def test_annotated_collectives_and_p2p(store: Path) -> None:
    with tracekit.open(store) as s:
        c = s.sql("SELECT rank, op, list(seq ORDER BY seq) AS seqs, min(nbytes) AS b, min(dtype) AS dt, "
                  "list(DISTINCT step ORDER BY step) AS steps FROM collectives WHERE source = 'annotation' "
                  "GROUP BY rank, op ORDER BY rank, op")
        assert len(c) == 8
        for row in c.iter_rows(named=True):
            assert row["seqs"] == [0, 1, 2] and row["steps"] == [0, 1, 2] and row["dt"] == "float32"
            assert row["b"] == (16 * 64 * 4 if row["op"] == "all_gather" else 64 * 64 * 4)
        # group names are torch's: each collective's group contains its rank, and TP peers agree
        bad = s.sql("SELECT count(*) FROM collectives c LEFT JOIN groups g ON c.run_id = g.run_id "
                    "AND c.pg_name = g.pg_name WHERE g.ranks IS NULL OR NOT list_contains(g.ranks, c.rank)")
        assert bad.item() == 0
        tp = s.sql("SELECT rank, min(pg_name) AS pg FROM collectives WHERE op = 'all_gather' GROUP BY rank "
                   "ORDER BY rank")["pg"].to_list()
        assert tp[0] == tp[1] and tp[2] == tp[3] and tp[0] != tp[2]
        p = s.sql("SELECT rank, direction, peer, count(*) AS n FROM p2p GROUP BY ALL ORDER BY rank").rows()
        assert p == [(0, "send", 2, 3), (1, "send", 3, 3), (2, "recv", 0, 3), (3, "recv", 1, 3)]
        dur = s.sql("SELECT min(end_ns - start_ns) FROM collectives").item()
        assert dur > 0


def test_events_steps_and_compute_annotations(store: Path) -> None:
    with tracekit.open(store) as s:
        steps = s.sql("SELECT rank, count(*) AS n, bool_and(end_ns > start_ns) AS ok FROM steps GROUP BY rank")
        assert steps["n"].to_list() == [3] * 4 and all(steps["ok"])
        comp = s.sql("SELECT phase, count(*) AS n, min(vstage) AS v, min(microbatch) AS mb FROM events "
                     "WHERE kind = 'compute' GROUP BY phase ORDER BY phase").rows()
        assert comp == [("bwd", 12, 0, 0), ("fwd", 12, 0, 0)]
        gloo = s.sql("SELECT count(*) FROM events WHERE starts_with(name, 'gloo:') AND is_comm").item()
        assert gloo >= 4 * 3 * 2  # all_gather + all_reduce worker spans per step per rank
        assert s.sql("SELECT count(*) FROM events WHERE step IS NULL AND kind = 'compute'").item() == 0


def test_flight_recorder_and_memory(store: Path) -> None:
    with tracekit.open(store) as s:
        fr = s.sql("SELECT rank, count(*) AS n, list(DISTINCT profiling_name ORDER BY profiling_name) AS names, "
                   "bool_and(state = 'scheduled') AS sched FROM fr_entries GROUP BY rank ORDER BY rank")
        assert fr["n"].to_list() == [6] * 4 and all(fr["sched"])
        assert fr["names"][0].to_list() == ["gloo:all_gather", "gloo:all_reduce"]
        # gloo records carry no start/complete times, so none become timed collectives
        assert s.sql("SELECT count(*) FROM collectives WHERE source = 'fr'").item() == 0
        mem = s.sql("SELECT rank, count(*) AS n, count(DISTINCT action) AS actions, "
                    "count(category) AS cat, count(frame) AS fr FROM memory_events GROUP BY rank")
        assert all(n > 10 for n in mem["n"]) and all(c > 0 for c in mem["cat"])
        allocs = s.sql("SELECT count(*) FROM memory_events WHERE action = 'alloc' AND category IS NULL").item()
        assert allocs == 0  # the CPU-derived snapshot keeps a category on every allocation
        frames = s.sql("SELECT DISTINCT frame FROM memory_events WHERE frame IS NOT NULL")["frame"].to_list()
        assert any("_gloo_run.py" in f and "_rank_main" in f for f in frames)
        assert s.sql("SELECT count(*) FROM memory_segments").item() >= 4


def test_fr_json_dumps_ingest(run_dir: Path, tmp_path: Path) -> None:
    report = ingest([run_dir.parent / "fr_json"], tmp_path / "fr.duckdb")
    assert [f.format for f in report.ok] == ["fr"] * 4
    with tracekit.open(tmp_path / "fr.duckdb") as s:
        assert s.sql("SELECT count(*) FROM fr_entries WHERE time_started_ns IS NULL").item() == 24


def test_reingest_is_idempotent(store: Path, run_dir: Path) -> None:
    def counts() -> dict:
        with tracekit.open(store) as s:
            return {t: s.sql(f"SELECT count(*) FROM {t}").item()
                    for t in ("events", "collectives", "p2p", "steps", "fr_entries", "memory_events", "groups",
                              "ranks", "runs")}

    before = counts()
    report = ingest([run_dir], store)
    assert len(report.skipped) == 12 and not report.ok and not report.failed
    assert counts() == before


def test_cli_ingest_exit_codes(run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    db = tmp_path / "cli.duckdb"
    res = runner.invoke(cli_main, ["ingest", str(run_dir / "traces"), "--store", str(db), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [f["status"] for f in out["files"]] == ["ok"] * 4
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "a"')
    res = runner.invoke(cli_main, ["ingest", str(bad), str(run_dir / "memory"), "--store", str(db), "--json"])
    assert res.exit_code == 2
    out = json.loads(res.output)
    assert sorted(f["status"] for f in out["files"]) == ["failed"] + ["ok"] * 4
    assert any(f["error"] and "bad.json" in f["error"] for f in out["files"])


def test_gloo_spans_without_annotations(run_dir: Path, tmp_path: Path) -> None:
    """A gloo trace from code that does not annotate: collectives come from the gloo:* worker spans."""
    import gzip

    trace = json.loads(gzip.decompress((run_dir / "traces" / "rank0.json.gz").read_bytes()))
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not e.get("name", "").startswith("tk.")]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "rank0.json").write_text(json.dumps(trace))
    rep = ingest([tmp_path / "plain"], tmp_path / "p.duckdb")
    assert len(rep.ok) == 1
    with tracekit.open(tmp_path / "p.duckdb") as s:
        c = s.sql("SELECT op, list(seq ORDER BY seq) AS seqs, count(pg_name) AS named FROM collectives "
                  "WHERE source = 'gloo' GROUP BY op ORDER BY op").rows()
        assert c == [("all_gather", [0, 1, 2], 0), ("all_reduce", [0, 1, 2], 0)]
        p = s.sql("SELECT direction, count(*) FROM p2p WHERE source = 'gloo' GROUP BY ALL").rows()
        assert p == [("send", 3)]
        run = s.table("runs").row(0, named=True)
        assert (run["world_size"], run["layout_source"], run["tp"], run["dp"]) == (4, "group-names", 2, 2)
