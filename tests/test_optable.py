"""read_optable on the real what-if-analysis traces (and on broken inputs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from tracekit import schema
from tracekit.ingest.optable import OpTableError, read_optable

WIA = Path(__file__).resolve().parent / "fixtures" / "real" / "wia"

# trial: (rows, p2p rows, collective rows, steps, dp, pp, workers)
EXPECTED = {
    "AR": (117216, 67584, 2464, 44, 4, 4, 16),
    "SE": (107328, 44032, 11008, 43, 32, 2, 64),
    "ST": (6784, 3072, 896, 32, 2, 4, 8),
}


@pytest.fixture(scope="module")
def tables():
    return {t: read_optable(WIA / t / f"trace-{t}.parquet", run_id=f"wia-{t}") for t in EXPECTED}


@pytest.mark.parametrize("trial", sorted(EXPECTED))
def test_row_counts_and_schema(tables, trial):
    rows, n_p2p, n_coll, n_steps, dp, pp, workers = EXPECTED[trial]
    t = tables[trial]
    for name, df in t.items():
        assert df.columns == schema.columns(name), name
        assert (df["run_id"] == f"wia-{trial}").all()
    assert t["events"].height == rows
    assert t["p2p"].height == n_p2p
    assert t["collectives"].height == n_coll
    assert t["steps"].height == workers * n_steps
    assert t["ranks"].height == workers
    run = t["runs"].row(0, named=True)
    assert (run["dp"], run["pp"], run["tp"], run["cp"], run["world_size"]) == (dp, pp, 1, 1, workers)
    assert run["source"] == "wia" and run["layout_source"] == "wia-meta"
    # compute events carry a phase, comm events are flagged
    ev = t["events"]
    assert set(ev.filter(~pl.col("is_comm"))["phase"].drop_nulls().unique()) == {"fwd", "bwd", "opt"}
    assert ev.filter(pl.col("name") == "forward-compute")["phase"].unique().to_list() == ["fwd"]
    assert ev.filter(pl.col("is_comm"))["kind"].unique().to_list() == ["comm"]


def test_rank_numbering_and_exact_values(tables):
    t = tables["AR"]
    manifest = json.loads(t["runs"]["manifest"][0])
    assert manifest["folded"] == {"tp": 4, "cp": 1}
    # trace rank = tp + 4*dp + 16*stage (Megatron order); store rank = stage + 4*dp
    assert manifest["trace_rank"]["0"] == 0 and manifest["trace_rank"]["1"] == 16
    assert manifest["trace_rank"]["4"] == 4 and manifest["trace_rank"]["15"] == 60
    ranks = t["ranks"].filter(pl.col("rank") == 15).row(0, named=True)
    assert (ranks["dp"], ranks["pp"], ranks["cp"], ranks["tp"]) == (3, 3, 0, 0)
    # first op of trace rank 60 (dp 3, stage 3) in the first sampled step (16), whose base is 0
    first = t["events"].filter(pl.col("rank") == 15).sort("ts_ns").row(0, named=True)
    assert (first["name"], first["step"], first["ts_ns"], first["dur_ns"]) == (
        "params-all-gather", 16, 170946, 112269409)
    fwd = t["events"].filter((pl.col("rank") == 15) & (pl.col("name") == "forward-compute")).sort("ts_ns").row(0, named=True)
    assert (fwd["vstage"], fwd["microbatch"], fwd["phase"], fwd["is_comm"]) == (3, 0, "fwd", False)
    # steps are laid end to end: the second sampled step starts after the first one ended
    st = t["steps"].filter(pl.col("rank") == 0).sort("step")
    assert st["step"].to_list()[:2] == [16, 21]
    assert st["start_ns"][1] > st["end_ns"][0]


@pytest.mark.parametrize("trial", sorted(EXPECTED))
def test_p2p_pairs_neighbouring_stages(tables, trial):
    t = tables[trial]
    pp = t["runs"]["pp"][0]
    p2p = t["p2p"]
    assert ((p2p["peer"] - p2p["rank"]).abs() == 1).all()  # neighbouring stage, same replica
    assert ((p2p["peer"] // pp) == (p2p["rank"] // pp)).all()
    send = p2p.filter(pl.col("direction") == "send").select(
        pl.col("rank").alias("src"), pl.col("peer").alias("dst"), "seq", "step", "microbatch", "pg_name")
    recv = p2p.filter(pl.col("direction") == "recv").select(
        pl.col("peer").alias("src"), pl.col("rank").alias("dst"), "seq", "step", "microbatch", "pg_name")
    joined = send.join(recv, on=["src", "dst", "seq", "pg_name"], how="full", coalesce=True)
    # every send has exactly one receive with the same seq, in the same step and micro-batch
    assert joined.height == send.height == recv.height
    assert (joined["step"] == joined["step_right"]).all()
    assert (joined["microbatch"] == joined["microbatch_right"]).all()


@pytest.mark.parametrize("trial", sorted(EXPECTED))
def test_collective_instances_match_across_members(tables, trial):
    t = tables[trial]
    sizes = dict(t["groups"].select("pg_name", "size").iter_rows())
    inst = t["collectives"].group_by("pg_name", "seq").agg(pl.len(), pl.col("step").n_unique().alias("steps"),
                                                          pl.col("op").n_unique().alias("ops"))
    assert (inst["steps"] == 1).all() and (inst["ops"] == 1).all()
    assert all(n == sizes[g] for g, n in inst.select("pg_name", "len").iter_rows())
    ops = dict(t["collectives"].group_by("pg_name").agg(pl.col("op").unique().sort()).filter(
        pl.col("pg_name") == "wia:dp:stage0").iter_rows())
    assert ops["wia:dp:stage0"] == ["all_gather", "reduce_scatter"]
    g = t["groups"].filter(pl.col("pg_name") == "wia:dp:stage1").row(0, named=True)
    pp, dp = t["runs"]["pp"][0], t["runs"]["dp"][0]
    assert g["ranks"] == [1 + pp * d for d in range(dp)] and g["dim"] == "dp"


def _copy_trial(tmp_path: Path, trial: str = "ST") -> Path:
    dst = tmp_path / trial
    dst.mkdir()
    for f in (WIA / trial).iterdir():
        shutil.copy(f, dst / f.name)
        (dst / f.name).chmod(0o644)
    return dst / f"trace-{trial}.parquet"


def test_bad_inputs_raise_naming_the_file(tmp_path):
    with pytest.raises(OpTableError, match="no such file"):
        read_optable(tmp_path / "nope.parquet")
    with pytest.raises(OpTableError, match=r"expected one \*\.parquet op table in the folder, found 0"):
        read_optable(tmp_path)
    trace = _copy_trial(tmp_path)
    assert read_optable(trace.parent)["events"].height == 6784  # a trial folder works too
    (trace.parent / "meta-ST.yaml").unlink()
    with pytest.raises(OpTableError, match=r"trace-ST\.parquet.*meta"):
        read_optable(trace)
    (trace.parent / "meta-ST.yaml").write_text("trial_name: ST\ndp_size: 2\npp_size: 2\n")
    with pytest.raises(OpTableError, match="outside dp=2, pp=2"):
        read_optable(trace)
    (trace.parent / "meta-ST.yaml").write_text("dp_size: [\n")
    with pytest.raises(OpTableError, match="not valid yaml"):
        read_optable(trace)
    (trace.parent / "meta-ST.yaml").write_text("dp_size: 2\npp_size: 4\n")
    good = pl.read_parquet(trace)
    first_recv = (pl.col("optype").cast(pl.Utf8) == "forward-recv") & (pl.int_range(pl.len()) == good.with_row_index()
                  .filter(pl.col("optype").cast(pl.Utf8) == "forward-recv")["index"][0])
    good.with_columns(pl.when(first_recv).then(0).otherwise(pl.col("stage")).cast(pl.Int8).alias("stage"),
                      pl.when(first_recv).then(0).otherwise(pl.col("rank")).cast(pl.Int16).alias("rank")
                      ).write_parquet(trace)
    with pytest.raises(OpTableError, match="1 p2p ops point past the first or last stage"):
        read_optable(trace)
    good.with_columns(pl.when(pl.col("rank") == 7).then(99).otherwise(pl.col("rank")).alias("rank")).head(
        good.height // 2).vstack(good.tail(good.height - good.height // 2)).write_parquet(trace)
    with pytest.raises(OpTableError, match="several trace ranks"):
        read_optable(trace)
    good.drop("optype").write_parquet(trace)
    with pytest.raises(OpTableError, match=r"missing columns \['optype'\]"):
        read_optable(trace)
    trace.write_bytes(b"not parquet")
    with pytest.raises(OpTableError, match="not a readable parquet"):
        read_optable(trace)
