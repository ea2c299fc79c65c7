"""Real traces nobody here wrote: the two HTA samples (NCCL) and the three what-if-analysis traces."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

import tracekit
from tracekit.ingest.pipeline import ingest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real"
HTA, WIA = FIXTURES / "hta", FIXTURES / "wia"


@pytest.fixture(scope="module")
def hta_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("hta") / "hta.duckdb"
    report = ingest([HTA], db, workers=2)  # exercise the worker threads once
    assert not report.failed, [f.error for f in report.failed]
    return db


def test_hta_samples_row_counts(hta_store: Path) -> None:
    with tracekit.open(hta_store) as s:
        counts = s.sql("SELECT run_id, rank, count(*) AS n FROM events GROUP BY ALL ORDER BY ALL")
        # X events minus the profiler's 'Trace' span (counted independently with json in the skeleton)
        assert counts.rows() == [("single_rank_nccl", 0, 26932), ("two_rank_train", 0, 4810),
                                 ("two_rank_train", 1, 4675)]
        steps = s.sql("SELECT run_id, rank, list(step ORDER BY step) AS steps FROM steps GROUP BY ALL ORDER BY ALL")
        assert steps["steps"].to_list() == [[4, 5, 6], [551, 552], [551, 552]]
        runs = s.table("runs").sort("run_id")
        assert runs["world_size"].to_list() == [2, 128]
        assert runs["backend"].to_list() == ["nccl", "nccl"]


def test_hta_known_kernel_and_collective_values(hta_store: Path) -> None:
    with tracekit.open(hta_store) as s:
        # An AllReduce kernel of the single-rank sample: ts 4458677009853.422 us, dur 2636.669 us,
        # 6637568 floats, group '0' = ranks [0, 1]; epoch = baseTimeNanoseconds + 1000 * ts.
        c = s.sql("SELECT * FROM collectives WHERE run_id = 'single_rank_nccl' AND start_ns = ?",
                  [1711964646000000000 + 4458677009853422]).row(0, named=True)
        assert c["end_ns"] - c["start_ns"] == 2636669
        assert c["op"] == "all_reduce" and c["nbytes"] == 6637568 * 4 and c["step"] == 6
        assert c["pg_name"] == "0" and c["dtype"] == "Float" and c["source"] == "kernel"
        ops = s.sql("SELECT op, count(*) AS n FROM collectives WHERE run_id = 'single_rank_nccl' GROUP BY op")
        assert dict(ops.rows()) == {"all_reduce": 15, "broadcast": 6}
        seqs = s.sql("SELECT list(seq ORDER BY start_ns) AS s FROM collectives WHERE run_id = 'single_rank_nccl'")
        assert seqs["s"][0].to_list() == list(range(21))
        g = s.sql("SELECT ranks, dim, pg_desc FROM groups WHERE run_id = 'single_rank_nccl'").row(0)
        assert g == ([0, 1], "world", "default_pg")
        # two_rank_train: ncclKernel_SendRecv without args -> p2p rows, direction unknown
        p = s.sql("SELECT rank, count(*) AS n, min(end_ns - start_ns) AS d FROM p2p "
                  "WHERE run_id = 'two_rank_train' GROUP BY rank ORDER BY rank")
        assert p["n"].to_list() == [10, 10]
        k = s.sql("SELECT dur_ns, step, is_comm FROM events WHERE run_id = 'two_rank_train' AND rank = 1 "
                  "AND kind = 'kernel' AND name LIKE 'ncclKernel_SendRecv%' ORDER BY ts_ns LIMIT 1").row(0)
        assert k == (57924000, 551, True)


def test_hta_missing_ranks_reported(hta_store: Path) -> None:
    with tracekit.open(hta_store) as s:
        w = s.sql("SELECT run_id, error FROM ingest_log WHERE status = 'warning' ORDER BY run_id").rows()
    assert w[0] == ("single_rank_nccl", "ranks missing from kineto data: 1 (1 of 2)")
    assert w[1] == ("two_rank_train", "ranks missing from kineto data: 2-127 (126 of 128)")


def wia_test_reader(path: Path) -> dict[str, pl.DataFrame]:
    """Stand-in for tracekit.ingest.optable.read_optable (owned by the analysis engineer): the same
    signature, a deliberately small mapping, enough to prove the pipeline's dispatch and writes."""
    ops = pl.read_parquet(path)
    meta = yaml.safe_load(next(path.parent.glob("meta-*.yaml")).read_text())
    events = ops.select(
        pl.col("rank").cast(pl.Int32), (pl.col("start_ts") * 1000).cast(pl.Int64).alias("ts_ns"),
        (pl.col("duration") * 1000).cast(pl.Int64).alias("dur_ns"), pl.lit("compute").alias("kind"),
        pl.col("optype").alias("name"), pl.col("step").cast(pl.Int32), pl.col("mb_id").cast(pl.Int32)
        .alias("microbatch"))
    ranks = ops.select("rank", pl.col("dp_rank").alias("dp"), pl.col("stage").alias("pp")).unique().with_columns(
        pl.lit(0).alias("cp"), pl.lit(None).alias("tp"))
    runs = pl.DataFrame({"run_id": ["x"], "source": ["wia"], "world_size": [meta["world_size"]],
                         "tp": [meta["tp_size"]], "cp": [meta["dsp_size"]], "pp": [meta["pp_size"]],
                         "dp": [meta["dp_size"]], "layout_source": ["wia-meta"]})
    return {"runs": runs, "ranks": ranks, "events": events}


@pytest.mark.parametrize("name,rows", [("AR", 117216), ("SE", 107328), ("ST", 6784)])
def test_wia_traces_dispatch_to_optable_reader(tmp_path: Path, name: str, rows: int) -> None:
    db = tmp_path / "wia.duckdb"
    report = ingest([WIA / name], db, optable_reader=wia_test_reader)
    assert [f.status for f in report.files] == ["ok"]  # yaml and result/ms/mw json are passed over
    # the meta yaml belongs to the op table; the result files are reported as passed over
    assert sorted(p.name for p in report.ignored) == [f"ms-{name}.json", f"mw-{name}.json", f"result-{name}.json"]
    with tracekit.open(db) as s:
        assert s.sql("SELECT count(*) FROM events WHERE run_id = ?", [name]).item() == rows
        run = s.table("runs").row(0, named=True)
        assert (run["run_id"], run["layout_source"], run["source"]) == (name, "wia-meta", "wia")
        assert run["world_size"] == 64 if name == "AR" else run["world_size"] > 0
    again = ingest([WIA / name], db, optable_reader=wia_test_reader)
    assert [f.status for f in again.files] == ["skipped"]
    with tracekit.open(db) as s:
        assert s.sql("SELECT count(*) FROM events").item() == rows


def test_wia_with_the_real_optable_reader(tmp_path: Path) -> None:
    report = ingest([WIA / "AR", WIA / "SE", WIA / "ST"], tmp_path / "wia.duckdb", workers=1)
    assert [f.status for f in report.files] == ["ok"] * 3, [f.error for f in report.files]
    with tracekit.open(tmp_path / "wia.duckdb") as s:
        assert sorted(s.run_ids) == ["AR", "SE", "ST"]
        assert s.sql("SELECT count(*) FROM events WHERE run_id = 'ST'").item() > 0


def test_wia_without_reader_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An install without the op-table reader: importing it fails (None in sys.modules); parse in
    # this process (processes=False) so that the patch applies.
    monkeypatch.setitem(sys.modules, "tracekit.ingest.optable", None)
    report = ingest([WIA / "ST" / "trace-ST.parquet"], tmp_path / "x.duckdb", workers=1, processes=False)
    assert len(report.failed) == 1 and not report.ok
    error = report.failed[0].error
    assert "trace-ST.parquet" in error and "op-table" in error and "not installed" in error
    assert "\n" not in error.strip()
