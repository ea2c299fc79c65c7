"""The analyses on ByteDance's real what-if-analysis traces, checked against their published results."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tracekit.analysis.collectives import align_clocks
from tracekit.analysis.diagnosis import diagnose
from tracekit.analysis.tables import RunTables
from tracekit.ingest.optable import read_optable

WIA = Path(__file__).resolve().parent / "fixtures" / "real" / "wia"


def load(trial: str):
    tables = RunTables.from_mapping(read_optable(WIA / trial / f"trace-{trial}.parquet", run_id=trial))
    published = json.loads((WIA / trial / f"result-{trial}.json").read_text())
    return tables, diagnose(tables), published


def _op_ratio(trial: str, rank: int) -> float:
    """The rank's forward and backward compute over the mean of the same ops (step, op, micro-batch)
    on the other ranks of its stage, as a geometric mean over the ops: straight from the op table."""
    ops = pl.read_parquet(WIA / trial / f"trace-{trial}.parquet").filter(
        pl.col("optype").is_in(["forward-compute", "backward-compute"]))
    stage = ops.filter(pl.col("rank") == rank)["stage"][0]
    wide = (ops.filter(pl.col("stage") == stage).group_by("rank", "step", "optype", "mb_id").agg(pl.col("duration").sum())
            .pivot(on="rank", index=["step", "optype", "mb_id"], values="duration").drop_nulls())
    mine = wide[str(rank)].to_numpy().astype(float)
    peers = wide.select([c for c in wide.columns if c not in ("step", "optype", "mb_id", str(rank))]).to_numpy()
    return float(np.exp(np.mean(np.log(mine / peers.astype(float).mean(axis=1)))))


def _argmax(d: dict) -> str:
    return max(d, key=d.get)


def test_ar_names_the_slowed_worker_as_a_worker_issue():
    tables, d, pub = load("AR")
    loc = d.localization
    assert loc.verdict == "straggler"
    assert loc.coords == {"dp": 0, "pp": 0, "cp": 0, "tp": 0}
    assert tables.manifest["trace_rank"][str(loc.culprit_rank)] == 0  # the trace's own rank 0
    # the published what-if analysis blames the same dp rank and stage
    assert _argmax(pub["blocking_decompose_by_dp_rank"]) == "0"
    assert _argmax(pub["blocking_decompose_by_stage"]) == "0"
    # every step names it on its own, with a wide margin
    assert loc.per_step["culprit_rank"].to_list() == [0] * loc.per_step.height == [0] * 44
    assert loc.confidence > 0.9
    assert d.cause.kind == "slow_compute" and d.cause.category == "worker"
    # op by op against its 3 peers' same op, read from the parquet here: 2.39 (geometric mean)
    ratio = d.cause.evidence["compute_ratio"]
    assert ratio == pytest.approx(_op_ratio("AR", rank=0), abs=0.05)
    assert d.headline.startswith(f"rank 0 (dp 0, pp 0) is a straggler: rank 0 computes {ratio:.2f}x its 3 peers")
    assert "ms per step" in d.headline and "(cause slow_compute, confidence 0.99)" in d.headline


def test_st_names_the_last_stage_as_stage_imbalance():
    tables, d, pub = load("ST")
    loc = d.localization
    assert loc.verdict == "stage" and loc.culprit_rank is None
    assert loc.coords == {"pp": 3}  # the last stage, in every replica
    assert _argmax(pub["blocking_decompose_by_stage"]) == "3"
    assert next(lv for lv in loc.levels if lv.level == "dp").verdict == "none"
    assert d.cause.kind == "stage_imbalance" and d.cause.category == "pipeline"
    assert d.cause.evidence["stage_compute_ratio"] > 1.5


def test_se_reports_data_imbalance_without_a_single_culprit():
    tables, d, pub = load("SE")
    loc = d.localization
    assert loc.verdict == "moving" and loc.culprit_rank is None and loc.culprit_ranks == ()
    dp = next(lv for lv in loc.levels if lv.level == "dp")
    assert dp.verdict == "moving" and dp.steps_agree < dp.steps_total / 4
    # the slowest replica moves: many different ones over the steps
    assert loc.per_step["dp"].drop_nulls().n_unique() >= 10
    # published: removing any single worker's slowness barely helps (Mw ~ 0.03)
    assert json.loads((WIA / "SE" / "mw-SE.json").read_text())["Mw"] < 0.05
    assert d.cause.kind == "data_imbalance" and d.cause.ranks == ()
    assert d.cause.evidence["imbalance_degree"] > 1.1
    blob = json.loads(json.dumps(d.to_dict()))
    assert blob["cause"]["category"] == "data"


def test_op_table_clocks_are_already_shared():
    tables, _, _ = load("ST")
    a = align_clocks(tables)
    # the op tables share one clock per step: estimated offsets stay far below a step (2.2 s)
    assert a.clock_domains == 1
    assert a.offsets["offset_ns"].abs().max() < 1_000_000


def test_same_answer_from_a_duckdb_store(tmp_path):
    import duckdb

    from tracekit import schema
    from tracekit.analysis.tables import TablesError

    frames = read_optable(WIA / "ST" / "trace-ST.parquet", run_id="st")
    con = duckdb.connect(str(tmp_path / "store.duckdb"))
    for name, df in frames.items():
        con.execute(schema.create_sql(name))
        con.register("frame", df.to_arrow())
        con.execute(f"INSERT INTO {name} SELECT * FROM frame")
        con.unregister("frame")
    con.close()
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    tables = RunTables.from_duckdb(con, "st")
    assert tables.events.height == 6784 and tables.groups["ranks"][0].to_list() == [0, 4]
    d = diagnose(tables)
    assert (d.localization.verdict, d.localization.coords, d.cause.kind) == ("stage", {"pp": 3}, "stage_imbalance")
    with pytest.raises(TablesError, match="not found"):
        RunTables.from_duckdb(con, "other-run")
