"""Per-rank peak, live-at-peak and reserve analysis over memory_events rows.

Real input: a CPU training loop profiled with profile_memory=True and turned into the CUDA snapshot
format by torch's own ``_profile_to_snapshot``; its trace entries become memory_events rows here
(the ingest module is written separately). Each rank's numbers are checked against an independent
plain-Python replay of the same trace, and against what the training loop really allocated.
"""

import json
import re
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
import torch
from torch.cuda._memory_viz import _profile_to_snapshot
from torch.profiler import ProfilerActivity, profile

from tracekit.analysis.memory import (
    MemoryDataError,
    block_lifetimes,
    imbalance,
    live_at_peak,
    peaks,
    reserved_timeline,
    timeline,
)
from tracekit.schema import columns
from tracekit.topology import Layout

HIDDEN = {0: 64, 1: 96}  # two "ranks" of different size, so their peaks differ


def _build(hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.ReLU(),
                                torch.nn.Linear(2 * hidden, hidden))
    return model, torch.optim.Adam(model.parameters())


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _train_and_snapshot(hidden: int) -> tuple[dict, dict]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(16, hidden)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        model, opt = _build(hidden)  # inside the recording: parameters are in the trace
        for _ in range(3):
            _train_step(model, opt, x)
    truth = {"param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
             "param_tensors": len(list(model.parameters()))}
    return _profile_to_snapshot(prof), truth


CPU_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")  # 'train.py(83): step'


def _top_frame(frames: list[dict]) -> str | None:
    """'file:line:function' of the innermost frame outside torch (the store's convention)."""
    for f in frames:
        m = CPU_FRAME.match(f["name"])
        if m and "torch/" not in m["file"]:
            return f"{Path(m['file']).name}:{m['line']}:{m['func']}"
    return None


def snapshot_rows(snapshot: dict, rank: int, run_id: str = "run") -> list[dict]:
    rows = []
    for seq, e in enumerate(snapshot["device_traces"][0]):
        rows.append({"run_id": run_id, "rank": rank, "seq": seq,
                     "ts_ns": e["time_us"] * 1000 if "time_us" in e else None,
                     "action": e["action"], "addr": e["addr"], "size": e["size"],
                     "stream": e.get("stream"), "category": e.get("category"),
                     "frame": _top_frame(e.get("frames", []))})
    return rows


def replay(entries: list[dict]) -> tuple[int, int, Counter]:
    """Independent reference: walk the trace, return (peak bytes, peak index, live bytes by category)."""
    live: dict[int, dict] = {}
    cur = peak = 0
    at = -1
    by_cat: Counter = Counter()
    for i, e in enumerate(entries):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if cur > peak:
            peak, at = cur, i
            by_cat = Counter()
            for b in live.values():
                by_cat[b.get("category") or "unknown"] += b["size"]
    return peak, at, by_cat


@pytest.fixture(scope="module")
def run():
    snaps, truths, rows = {}, {}, []
    for rank, hidden in HIDDEN.items():
        snaps[rank], truths[rank] = _train_and_snapshot(hidden)
        rows += snapshot_rows(snaps[rank], rank)
    schema = dict(zip(columns("memory_events"),
                      [pl.Utf8, pl.Int32, pl.Int64, pl.Int64, pl.Utf8, pl.Int64, pl.Int64, pl.Int64,
                       pl.Utf8, pl.Utf8]))
    return snaps, truths, pl.DataFrame(rows, schema=schema)


def test_peak_matches_an_independent_replay(run):
    snaps, _, events = run
    pk = peaks(events)
    assert pk["rank"].to_list() == [0, 1]
    for rank in HIDDEN:
        peak, at, _ = replay(snaps[rank]["device_traces"][0])
        row = pk.filter(pl.col("rank") == rank).row(0, named=True)
        assert (row["peak_allocated"], row["peak_seq"]) == (peak, at)
        assert row["baseline_allocated"] == 0  # the model was built inside the recording
        assert row["peak_ts_ns"] is None  # profile-derived snapshots carry no times
        assert row["reserved_at_peak"] is None and row["fragmentation_at_peak"] is None
    assert pk["peak_allocated"][1] > pk["peak_allocated"][0]


def test_live_at_peak_is_what_the_training_loop_held(run):
    snaps, truths, events = run
    live = live_at_peak(events, by="category")
    pk = peaks(events)
    for rank in HIDDEN:
        mine = live.filter(pl.col("rank") == rank)
        got = dict(zip(mine["category"], mine["bytes"]))
        assert got == dict(replay(snaps[rank]["device_traces"][0])[2])
        assert sum(got.values()) == pk.filter(pl.col("rank") == rank)["peak_allocated"][0]
        assert mine["share"].sum() == pytest.approx(1.0)
        t = truths[rank]
        # the peak is inside Adam's step: every gradient, both moments and the step counters live
        # (with_stack frames carry the line where a function was entered, so compare functions)
        site = pk.filter(pl.col("rank") == rank)["peak_frame"][0]
        assert site.startswith("test_memory_analysis.py:") and site.endswith(":_train_step")
        assert got["gradient"] == t["param_bytes"]
        assert got["optimizer_state"] == 2 * t["param_bytes"] + 4 * t["param_tensors"]
        assert got["parameter"] >= t["param_bytes"]
    by_site = live_at_peak(events, by="frame").filter(pl.col("rank") == 0)
    assert by_site["bytes"].sum() == pk["peak_allocated"][0]
    assert by_site["bytes"].to_list() == sorted(by_site["bytes"].to_list(), reverse=True)
    sites = {f.split(":")[-1]: b for f, b in zip(by_site["frame"], by_site["bytes"])}
    # the parameters were allocated by _build (the model was built inside the recording); all
    # else live at the peak (gradients, Adam state, the last activations) by _train_step
    assert sites["_build"] == truths[0]["param_bytes"]
    assert sites["_train_step"] == pk["peak_allocated"][0] - truths[0]["param_bytes"]
    assert len(sites) == 2


def test_imbalance_places_ranks_in_the_layout(run):
    _, _, events = run
    imb = imbalance(peaks(events), Layout(pp=2))
    assert imb["pp"].to_list() == [0, 1]
    p0, p1 = imb["peak_allocated"].to_list()
    assert imb["vs_run_mean"].to_list() == pytest.approx([p0 / ((p0 + p1) / 2), p1 / ((p0 + p1) / 2)])
    assert imb["stage_vs_run_mean"].to_list() == imb["vs_run_mean"].to_list()
    with pytest.raises(MemoryDataError, match="rank 1 outside layout"):
        imbalance(peaks(events), Layout())


# -- semantics on hand-written traces ------------------------------------------------------------


def frame(rows: list[tuple], ranks: int | None = None) -> pl.DataFrame:
    """rows: (seq, action, addr, size, category, frame, ts_ns) for rank 0."""
    return pl.DataFrame(
        [{"rank": 0, "seq": s, "action": a, "addr": ad, "size": sz, "category": c, "frame": f, "ts_ns": t}
         for s, a, ad, sz, c, f, t in rows],
        schema={"rank": pl.Int64, "seq": pl.Int64, "action": pl.Utf8, "addr": pl.Int64, "size": pl.Int64,
                "category": pl.Utf8, "frame": pl.Utf8, "ts_ns": pl.Int64})


HAND = [
    (0, "segment_alloc", 0, 1000, None, None, 100),
    (1, "alloc", 0, 100, "parameter", "model.py:1:init", 110),
    (2, "alloc", 100, 300, "activation", "model.py:9:forward", 120),
    (3, "free_completed", 900, 40, None, "x.py:3:f", 130),  # allocated before the trace began
    (4, "free_requested", 100, 300, None, "model.py:9:forward", 140),  # pending, still allocated
    (5, "alloc", 400, 200, "gradient", "model.py:20:backward", 150),  # peak: 40 + 100 + 300 + 200
    (6, "free_completed", 100, 300, None, None, 160),
    (7, "alloc", 100, 50, None, "opt.py:5:step", 170),  # address reuse
    (8, "segment_free", 0, 1000, None, None, 175),
    (9, "segment_alloc", 0, 500, None, None, 180),
]


def test_hand_trace_peak_baseline_pending_free_and_reuse():
    ev = frame(HAND)
    life = block_lifetimes(ev)
    assert life.select("addr", "size", "alloc_seq", "free_seq").rows() == [
        (900, 40, None, 3), (0, 100, 1, None), (100, 300, 2, 6), (400, 200, 5, None), (100, 50, 7, None)]
    tl = timeline(ev)
    assert tl.select("seq", "allocated", "ts_ns").rows() == [
        (1, 140, 110), (2, 440, 120), (3, 400, 130), (5, 600, 150), (6, 300, 160), (7, 350, 170)]
    row = peaks(ev).row(0, named=True)
    assert row["peak_allocated"] == 600 and row["peak_seq"] == 5 and row["peak_ts_ns"] == 150
    assert row["peak_frame"] == "model.py:20:backward" and row["peak_category"] == "gradient"
    assert row["baseline_allocated"] == 40 and row["final_allocated"] == 350
    assert row["reserved_at_peak"] == 1000 and row["peak_reserved"] == 1000
    assert row["fragmentation_at_peak"] == pytest.approx(0.4)
    live = live_at_peak(ev)
    assert live.select("category", "bytes", "blocks").rows() == [
        ("activation", 300, 1), ("gradient", 200, 1), ("parameter", 100, 1)]  # the 40 left at seq 3


def test_reserve_from_segments_and_steps():
    ev = frame(HAND)
    res = reserved_timeline(ev)
    assert res.select("seq", "reserved").rows() == [(-1, 0), (0, 1000), (8, 0), (9, 500)]
    # the snapshot's end state says 2000 bytes were reserved: 1500 were there before the trace
    seg = pl.DataFrame({"rank": [0, 0], "total_size": [1500, 500]})
    res = reserved_timeline(ev, seg)
    assert res.select("seq", "reserved").rows() == [(-1, 1500), (0, 2500), (8, 1500), (9, 2000)]
    row = peaks(ev, segments=seg).row(0, named=True)
    assert row["reserved_at_peak"] == 2500 and row["fragmentation_at_peak"] == pytest.approx(1 - 600 / 2500)
    steps = pl.DataFrame({"rank": [0, 0], "step": [0, 1], "start_ns": [100, 145], "end_ns": [145, 200]})
    assert peaks(ev, steps=steps)["peak_step"].to_list() == [1]
    # the peak (ts 150) lies in a step span, a bwd span of micro-batch 1, and a nested bwd span of
    # micro-batch 2 (innermost wins); a fwd span that ended at 150 does not contain it
    spans = pl.DataFrame({"rank": [0] * 4, "ts_ns": [100, 140, 148, 120], "dur_ns": [100, 20, 5, 30],
                          "phase": [None, "bwd", "bwd", "fwd"], "microbatch": [None, 1, 2, 0],
                          "name": ["step", "tk.compute phase=bwd mb=1", "tk.compute phase=bwd mb=2",
                                   "tk.compute phase=fwd mb=0"]})
    row = peaks(ev, spans=spans).row(0, named=True)
    assert (row["peak_phase"], row["peak_microbatch"], row["peak_vstage"]) == ("bwd", 2, None)
    assert row["peak_span"] == "tk.compute phase=bwd mb=2"
    # only segments, no segment events: the reserve is the end state throughout
    no_seg_events = ev.filter(~pl.col("action").str.starts_with("segment"))
    assert peaks(no_seg_events, segments=seg)["reserved_at_peak"].to_list() == [2000]


def test_row_order_and_several_runs_do_not_matter(run):
    _, _, events = run
    expected = peaks(events)
    shuffled = events.sample(fraction=1.0, shuffle=True, seed=7)
    assert peaks(shuffled).equals(expected)
    assert live_at_peak(shuffled).equals(live_at_peak(events))
    # the same trace under a second run id, with a null run id on the hand trace: all separate
    both = pl.concat([events, events.with_columns(pl.lit("again").alias("run_id")),
                      frame(HAND).with_columns(pl.lit(None, pl.Utf8).alias("run_id"), pl.lit(None, pl.Int64).alias("stream"))
                      .cast({"rank": pl.Int32}).select(events.columns)])
    pk = peaks(both)
    assert pk.select("run_id", "rank").rows() == [("", 0), ("again", 0), ("again", 1), ("run", 0), ("run", 1)]
    assert pk["peak_allocated"].to_list() == [600] + expected["peak_allocated"].to_list() * 2


def test_bad_rows_raise_clear_errors():
    with pytest.raises(MemoryDataError, match=r"lack columns \['addr'\]"):
        peaks(frame(HAND).drop("addr"))
    with pytest.raises(MemoryDataError, match="negative size"):
        peaks(frame([(0, "alloc", 0, -5, None, None, None)]))
    with pytest.raises(MemoryDataError, match="seq is not unique"):
        peaks(frame([(0, "alloc", 0, 5, None, None, None), (0, "alloc", 8, 5, None, None, None)]))
    with pytest.raises(MemoryDataError, match="no alloc or free_completed"):
        peaks(frame([(0, "segment_alloc", 0, 5, None, None, None)]))
    with pytest.raises(MemoryDataError, match="'category' or 'frame'"):
        live_at_peak(frame(HAND), by="stream")


# -- measured vs estimated, and the `tracekit memory` command over a DuckDB store ----------------


def test_compare_with_estimate_by_component(run):
    from tracekit.memory.compare import compare_with_estimate
    from tracekit.memory.estimate import MemoryEstimate

    _, truths, events = run
    live = live_at_peak(events)
    # What this fp32 Adam loop should hold at its peak inside opt.step(): 4-byte weights and
    # gradients, Adam's two 4-byte moments plus one 4-byte step counter per tensor, no activations
    est = {}
    for rank, t in truths.items():
        n = t["param_bytes"]
        est[rank] = MemoryEstimate(model="mlp", formula="exact", tp=1, cp=1, pp=1, dp=1, seq=16, mbs=1,
                                   stage=0, params=n // 4, weights=n, gradients=n,
                                   optimizer=2 * n + 4 * t["param_tensors"], activations=0)
    cmp = compare_with_estimate(live, est)
    assert cmp["component"].to_list()[:5] == ["weights", "gradients", "optimizer", "activations", "other"]
    r0 = {r["component"]: r for r in cmp.filter(pl.col("rank") == 0).iter_rows(named=True)}
    assert r0["gradients"]["difference"] == 0 and r0["optimizer"]["difference"] == 0
    assert r0["weights"]["difference"] >= 0  # plus the optimizer's in-place update scratch
    assert sum(r["measured"] for r in r0.values()) == peaks(events)["peak_allocated"][0]
    with pytest.raises(MemoryDataError, match=r"no estimate for ranks \[1\]"):
        compare_with_estimate(live, {0: est[0]})


@pytest.fixture(scope="module")
def store(run, tmp_path_factory):
    import duckdb

    from tracekit.schema import create_sql

    _, _, events = run
    path = tmp_path_factory.mktemp("store") / "run.duckdb"
    con = duckdb.connect(str(path))
    for t in ("runs", "memory_events", "memory_segments", "steps", "events"):
        con.execute(create_sql(t))
    con.execute("INSERT INTO runs (run_id, tp, cp, pp, dp) VALUES ('run', 1, 1, 2, 1)")
    con.register("ev", events.to_arrow())
    con.execute("INSERT INTO memory_events BY NAME SELECT * FROM ev")  # the stacks column stays NULL
    other = frame(HAND).with_columns(pl.lit("other").alias("run_id"))
    con.register("ev2", other.to_arrow())
    con.execute("INSERT INTO memory_events (run_id, rank, seq, ts_ns, action, addr, size, category, frame)"
                " SELECT run_id, rank, seq, ts_ns, action, addr, size, category, frame FROM ev2")
    # the hand trace's run also has steps and a phase span around its peak (ts 150)
    con.execute("INSERT INTO steps VALUES ('other', 0, 4, 100, 200)")
    con.execute("INSERT INTO events (run_id, rank, ts_ns, dur_ns, kind, name, phase, microbatch) VALUES"
                " ('other', 0, 140, 20, 'compute', 'tk.compute phase=bwd mb=3', 'bwd', 3),"
                " ('other', 0, 100, 30, 'compute', 'tk.compute phase=fwd mb=0', 'fwd', 0)")
    con.close()
    return path


def cli(*args):
    from click.testing import CliRunner

    from tracekit.cli import main

    return CliRunner().invoke(main, ["memory", *map(str, args)])


def test_memory_command_tables_and_json(run, store):
    _, _, events = run
    r = cli(store, "--run-id", "run")
    assert r.exit_code == 0, r.output
    assert "peak allocated per rank, run run" in r.output and "live at the peak, by category" in r.output
    assert "_train_step (optimizer_state)" in r.output or "_train_step (" in r.output
    j = json.loads(cli(store, "--run-id", "run", "--json").output)
    pk = peaks(events)
    assert [p["peak_allocated"] for p in j["peaks"]] == pk["peak_allocated"].to_list()
    assert [p["pp"] for p in j["peaks"]] == [0, 1] and j["layout"]["pp"] == 2
    by_cat = {(x["rank"], x["category"]): x["bytes"] for x in j["live_by_category"]}
    live = live_at_peak(events)
    assert by_cat == {(r, c): b for r, c, b in live.select("rank", "category", "bytes").iter_rows()}
    sites = json.loads(cli(store, "--run-id", "run", "--by", "frame", "--top", "1", "--json").output)
    assert [s["rank"] for s in sites["live_by_frame"]] == [0, 1]
    assert all(s["frame"].endswith(":_train_step") for s in sites["live_by_frame"])
    other = json.loads(cli(store, "--run-id", "other", "--json").output)
    assert other["peaks"][0]["peak_allocated"] == 600 and other["layout"] is None
    assert (other["peaks"][0]["peak_step"], other["peaks"][0]["peak_phase"]) == (4, "bwd")
    assert "step 4 bwd mb 3 (entry 5)" in cli(store, "--run-id", "other").output


def test_memory_command_bad_input(store, tmp_path):
    import duckdb

    assert "2 runs ['other', 'run']; pick one with --run-id" in cli(store).output
    assert cli(store).exit_code == 2
    r = cli(store, "--run-id", "nope")
    assert r.exit_code == 2 and "no memory events for run 'nope'" in r.output
    r = cli(tmp_path / "missing.duckdb")
    assert r.exit_code == 2 and "missing.duckdb: no such file or directory" in r.output
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"not a database at all" * 100)
    r = cli(junk)
    assert r.exit_code == 2 and "not a DuckDB store" in r.output
    empty = tmp_path / "empty.duckdb"
    duckdb.connect(str(empty)).close()
    r = cli(empty)
    assert r.exit_code == 2 and "has no memory_events table" in r.output


def test_memory_command_keeps_the_measured_tables_when_the_estimator_rejects_the_manifest(tmp_path):
    import duckdb

    from tracekit.schema import create_sql

    path = tmp_path / "m.duckdb"
    con = duckdb.connect(str(path))
    for t in ("runs", "memory_events"):
        con.execute(create_sql(t))
    manifest = {"config": {"dim": 64, "tp": 1}}  # a trainer manifest without layout or stage_layers
    con.execute("INSERT INTO runs (run_id, tp, cp, pp, dp, manifest) VALUES ('m', 1, 1, 1, 1, ?)",
                [json.dumps(manifest)])
    con.register("ev", frame(HAND).with_columns(pl.lit("m").alias("run_id")).to_arrow())
    con.execute("INSERT INTO memory_events (run_id, rank, seq, ts_ns, action, addr, size, category, frame)"
                " SELECT run_id, rank, seq, ts_ns, action, addr, size, category, frame FROM ev")
    con.close()
    r = cli(path, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["peaks"][0]["peak_allocated"] == 600 and out["estimate_vs_measured"] is None
    assert out["estimate_missing_because"].startswith("the estimator rejects the run's manifest")
    assert "no estimate: the estimator rejects" in cli(path).output
    r = cli(path, "--plot", tmp_path / "p.png")
    assert r.exit_code == 2 and "--plot needs the estimate" in r.output and not (tmp_path / "p.png").exists()
