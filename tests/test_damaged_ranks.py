"""A damaged set: rank 3's trace cut short (it fails to ingest) and rank 2's flight-recorder dump
missing. The store names both ranks with their reason (tracekit.analysis.damaged), and `hangs`
says rank 2 has no data instead of leaving it out or blaming it."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
import os
from pathlib import Path

import polars as pl
import pytest

import tracekit
from tracekit.analysis.damaged import damaged_ranks
from tracekit.analysis.hangs import diagnose_hang
from tracekit.ingest import ingest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_traces" / "slow_rank_8"


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    run = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(SAMPLE, run)
    (run / "fr" / "rank2").unlink()
    raw = gzip.decompress((run / "traces" / "rank3.json.gz").read_bytes())
    (run / "traces" / "rank3.json.gz").write_bytes(gzip.compress(raw[:len(raw) // 2]))
    db = run.parent / "s.duckdb"
    report = ingest([run], db)
    assert [f.path.name for f in report.failed] == ["rank3.json.gz"]
    return run, db


def test_the_store_names_the_damaged_ranks(damaged: tuple[Path, Path]) -> None:
    _, db = damaged
    with tracekit.open(db) as s:
        traces = s.damaged_ranks(formats=("kineto",))
        fr = s.damaged_ranks(formats=("fr",))
        every = s.damaged_ranks()
    assert list(traces) == [3] and traces[3].startswith("a file failed to ingest: ") and "rank3.json.gz" in traces[3]
    assert fr == {2: "no flight-recorder dump"}
    assert every == {2: "no flight-recorder dump", 3: traces[3]}


def test_hangs_says_which_rank_has_no_data(damaged: tuple[Path, Path]) -> None:
    run, db = damaged
    with tracekit.open(db) as s:
        report = s.hangs()
    assert report.damaged == {2: "no flight-recorder dump"}
    assert "rank 2: no flight-recorder dump" in report.headline and 2 not in report.culprits
    done = subprocess.run([sys.executable, "-c", "import sys; from tracekit.cli import main; main()", "hangs",
                           str(db), "--json"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert '"damaged": {\n    "2": "no flight-recorder dump"' in done.stdout or '"2": "no flight-recorder dump"' in done.stdout, \
        done.stdout + done.stderr


def test_a_rank_without_data_is_never_the_culprit() -> None:
    """Ranks 0-2 wait in all-reduce #4; rank 3 recorded nothing: it is named, not blamed."""
    fr = pl.DataFrame({"rank": [0, 1, 2] * 2, "pg_name": ["0"] * 6, "pg_desc": ["world"] * 6,
                       "collective_seq_id": [3, 3, 3, 4, 4, 4], "p2p_seq_id": [0] * 6, "is_p2p": [False] * 6,
                       "state": ["completed"] * 3 + ["started"] * 3,
                       "profiling_name": ["gloo:all_reduce"] * 6})
    groups = pl.DataFrame({"pg_name": ["0"], "pg_desc": ["world"], "ranks": [[0, 1, 2, 3]]})
    plain = diagnose_hang(fr, groups)
    assert plain.culprits == (3,)  # without knowing better, the absent rank is blamed
    named = diagnose_hang(fr, groups, damaged={3: "a file failed to ingest: rank3: truncated"})
    assert named.culprits == () and named.stuck[0].no_record == (3,)
    assert named.headline.endswith("the culprit is among the ranks without data; without data: "
                                   "rank 3: a file failed to ingest: rank3: truncated"), named.headline


def test_damaged_ranks_from_a_log() -> None:
    log = pl.DataFrame({"path": ["t/rank0.json", "t/rank1.json", "fr/rank1", "t/rank1.json.old", "README"],
                        "format": ["kineto", None, "fr", "kineto", None], "rank": [0, None, 1, None, None],
                        "status": ["ok", "failed", "ok", "failed", "failed"],
                        "error": [None, "t/rank1.json: truncated", None, "old", "not a trace"]})
    # rank 1's trace failed (its rank from the name); rank 2 of 3 has nothing; the README has no rank
    assert damaged_ranks(log, 3, ("kineto",)) == {1: "a file failed to ingest: t/rank1.json: truncated",
                                                  2: "no profiler trace"}
    assert damaged_ranks(log, 3, ("fr",)) == {0: "no flight-recorder dump", 2: "no flight-recorder dump"}
