"""A torch-native job (FSDP2 x DTensor TP/SP x pipelining, gloo, plain torch.profiler) ingested and
analysed: its unlabelled communication gets groups, seqs and peers; its compute comes from CPU ops.

One real 8-rank run (dp 2 x pp 2 x tp 2, 4 steps: compute_min_steps, rank 5 computing 1.5x slower) for the module.
"""

from __future__ import annotations

import json

import duckdb
import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from reference_trainer import native_job
from tracekit.cli import main
from tracekit.analysis.compute_speed import compute_outlier, compute_speed, own_compute_spans
from tracekit.analysis.data_needs import missing_data
from tracekit.analysis.tables import RunTables
from tracekit.ingest.pipeline import ingest

SLOW, FACTOR = 5, 1.5


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("native")
    args = native_job.parse_args(["--dp", "2", "--pp", "2", "--tp", "2", "--steps", "4", "--out", str(out / "run"),
                                  "--slow-rank", str(SLOW), "--slow-factor", str(FACTOR)])
    manifest = native_job.run(args)
    store = out / "store.duckdb"
    ingest([out / "run"], store)
    return {"dir": out / "run", "store": store, "manifest": manifest}


def _frames(run: dict) -> dict[str, pl.DataFrame]:
    """The store's tables without the flight recorder's."""
    con = duckdb.connect(str(run["store"]), read_only=True)
    try:
        return {t: pl.from_arrow(con.sql(f"SELECT * FROM {t}").to_arrow_table())
                for t in ("runs", "ranks", "groups", "events", "collectives", "p2p", "steps")}
    finally:
        con.close()


def _tables(run: dict, with_fr: bool = True) -> RunTables:
    if not with_fr:
        return RunTables.from_mapping(_frames(run))
    con = duckdb.connect(str(run["store"]), read_only=True)
    try:
        return RunTables.from_duckdb(con, "run")
    finally:
        con.close()


def test_run_directory_has_traces_fr_dumps_with_groups_and_ground_truth(run: dict) -> None:
    d, m = run["dir"], run["manifest"]
    assert sorted(p.name for p in (d / "traces").iterdir()) == [f"rank{r}.json.gz" for r in range(8)]
    assert m["layout"] == {"tp": 2, "cp": 1, "pp": 2, "dp": 2} and m["world_size"] == 8
    assert m["faults"][0]["ranks"] == [SLOW] and m["faults"][0]["magnitude"] == {"compute_factor": FACTOR}
    assert json.loads((d / "manifest.json").read_text()) == m
    import pickle
    dump = pickle.loads((d / "fr" / "rank5").read_bytes())
    descs = {v["desc"]: json.loads(v["ranks"]) for v in dump["pg_config"].values()}
    assert descs["mesh_dp"] == [1, 5] and descs["mesh_tp"] == [4, 5] and descs["mesh_pp"] == [5, 7]


@pytest.mark.parametrize("with_fr", [True, False], ids=["flight_recorder", "timing"])
def test_collectives_get_groups_and_seqs_that_match_across_ranks(run: dict, with_fr: bool) -> None:
    t = _tables(run, with_fr)
    assert t.labelling is not None and t.labelling.method == ("flight_recorder" if with_fr else "timing")
    coll = t.collectives.join(t.groups.select("pg_name", "dim", "ranks", "size"), on="pg_name", how="left")
    assert coll["pg_name"].null_count() == 0 and set(coll["dim"]) == {"dp", "tp"}
    assert all(r in ranks for r, ranks in coll.select("rank", "ranks").iter_rows())  # a group of its own
    inst = coll.group_by("pg_name", "seq").agg(pl.col("rank").n_unique().alias("n"), pl.col("size").first(),
                                               pl.col("op").n_unique().alias("ops"))
    # every instance: all members, once, the same op
    assert (inst["n"] == inst["size"]).all() and (inst["ops"] == 1).all()
    assert t.labelling.consistency == 1.0 and t.labelling.collectives_left == 0
    per_rank = coll.group_by("rank", "dim").agg(pl.col("seq").min().alias("lo"), pl.col("seq").max().alias("hi"),
                                                pl.len())
    assert (per_rank["lo"] == 0).all() and (per_rank["hi"] == per_rank["len"] - 1).all()


def test_both_ways_of_labelling_agree(run: dict) -> None:
    a, b = _tables(run, True).collectives, _tables(run, False).collectives
    j = a.join(b, on=["rank", "start_ns"])
    assert j.height == a.height == b.height
    assert (j["pg_name"] == j["pg_name_right"]).all() and (j["seq"] == j["seq_right"]).all()


@pytest.mark.parametrize("delay", ["shift", "random", "random_one_thread"])
def test_timing_labels_survive_a_descheduled_dp_thread(run: dict, delay: str) -> None:
    """Each rank in turn has its DP collectives complete late, as if their worker threads were
    descheduled: all 3 ms late, 0-5 ms late each, or 0-5 ms late each on one of its two DP threads.
    Without the recorder every collective still gets the recorder's group and seq (a frequent TP
    group has a completion within a few ms of any instant, so nearness alone labelled the DP
    threads of the late rank and of its DP partner TP)."""
    frames, fr = _frames(run), _tables(run)
    want = fr.collectives
    dp = want.join(fr.groups.filter(pl.col("dim") == "dp").select("pg_name"), on="pg_name")
    tids = dp.join(frames["events"].select("rank", pl.col("ts_ns").alias("start_ns"), "tid").unique(),
                   on=["rank", "start_ns"])
    wrong = {}
    for rank in range(8):
        late = tids.filter(pl.col("rank") == rank)
        if delay == "random_one_thread":
            late = late.filter(pl.col("tid") == late["tid"].min())
        ms = (np.full(late.height, 3.0) if delay == "shift"
              else np.random.default_rng(rank).uniform(0, 5, late.height))
        late = late.select("rank", "start_ns", pl.Series("late_ns", (ms * 1e6).astype(np.int64)))
        coll = frames["collectives"].join(late, on=["rank", "start_ns"], how="left").with_columns(
            pl.col("end_ns") + pl.col("late_ns").fill_null(0)).drop("late_ns")
        got = RunTables.from_mapping({**frames, "collectives": coll})
        assert got.labelling.method == "timing"
        j = want.join(got.collectives, on=["rank", "start_ns"])
        assert j.height == want.height == got.collectives.height
        bad = j.filter((pl.col("pg_name") != pl.col("pg_name_right")) | (pl.col("seq") != pl.col("seq_right")))
        if bad.height:
            wrong[rank] = sorted(bad["rank"].unique().to_list())
    assert not wrong, f"late rank -> ranks with a collective labelled otherwise: {wrong}"


def test_p2p_peers_are_the_neighbouring_stage(run: dict) -> None:
    t = _tables(run)
    co = t.coords()
    p = t.p2p.join(co.select("rank", "dp", "pp", "tp"), on="rank").join(
        co.select(pl.col("rank").alias("peer"), pl.col("dp").alias("dp2"), pl.col("pp").alias("pp2"),
                  pl.col("tp").alias("tp2")), on="peer", how="left")
    assert p.height and p["peer"].null_count() == 0
    assert ((p["dp"] == p["dp2"]) & (p["tp"] == p["tp2"]) & ((p["pp"] - p["pp2"]).abs() == 1)).all()
    # the k-th send r -> q is the k-th receive at q from r
    sends = p.filter(pl.col("direction") == "send").select(pl.col("rank").alias("src"), pl.col("peer").alias("dst"),
                                                          "seq", "step")
    recvs = p.filter(pl.col("direction") == "recv").select(pl.col("peer").alias("src"), pl.col("rank").alias("dst"),
                                                          "seq", "step")
    assert sends.sort(pl.all()).equals(recvs.sort(pl.all()))


def test_compute_from_cpu_ops_shows_the_slow_rank(run: dict) -> None:
    t = _tables(run)
    spans = own_compute_spans(t)
    assert sorted(spans["rank"].unique().to_list()) == list(range(8))
    speed = compute_speed(t)
    ratio = speed.group_by("rank").agg(pl.col("log_total").median().exp().alias("r"))
    slow = ratio.filter(pl.col("rank") == SLOW)["r"][0]
    others = ratio.filter(pl.col("rank") != SLOW)["r"]
    assert slow >= 1.2 * others.max(), ratio.sort("rank")
    finding = compute_outlier(speed)
    assert finding.verdict == "culprit" and finding.rank == SLOW, finding


def test_nothing_missing_and_a_stripped_run_says_what_to_turn_on(run: dict) -> None:
    t = _tables(run)
    assert missing_data(t) == []
    # without worker threads (e.g. a trace exported without them) or a recorder: groups unknown
    frames = _frames(run)
    frames["events"] = frames["events"].with_columns(pl.lit(None, pl.Utf8).alias("tid"))
    needs = missing_data(RunTables.from_mapping(frames))
    groups = [m for m in needs if m.what == "groups"]
    assert groups and "TORCH_FR_BUFFER_SIZE" in groups[0].turn_on
    assert "collectives have no process group" in groups[0].detail


def test_stragglers_cli_names_the_slow_rank_and_its_coordinates(run: dict) -> None:
    res = CliRunner().invoke(main, ["stragglers", str(run["store"]), "--json"])
    assert res.exit_code in (0, 1), res.output
    loc = json.loads(res.output)["stragglers"]["localization"]
    assert loc["verdict"] == "straggler" and loc["culprit_rank"] == SLOW, loc
    assert loc["coords"] == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
