"""The job simulator (tracekit/simulate): its schedule keeps the dependencies of a real job, faults
land on the ranks the manifest names, clock skew moves only absolute times, and the real ingest
reads its output. Oracles re-derive what they check from the rules (schedule tags, the trainer's
sample manifest, raw trace JSON and pickles), never from the simulator's own helpers."""

from __future__ import annotations

import gzip
import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

from tracekit.ingest.pipeline import ingest
from tracekit.simulate import SimConfig, SimError, run_model, simulate
from tracekit.simulate.schedule import schedule_names

ROOT = Path(__file__).resolve().parent.parent
LANE_AXIS = {"dp": 0, "cp": 1, "tp": 2}


def _ops(trace, kind: str):
    return [(p, o) for p, ops in enumerate(trace.ops) for o in ops if o.kind == kind]


# -- schedule and event model ----------------------------------------------------------------------
def test_plain_1f1b_is_the_trainers_schedule() -> None:
    sample = json.loads((ROOT / "sample_traces/slow_rank_8/manifest.json").read_text())
    cfg = SimConfig(tp=2, cp=2, pp=2, dp=1, microbatches=2)
    assert schedule_names(cfg) == sample["pipeline_schedule"]


@pytest.mark.parametrize("pp,v,m", [(2, 1, 4), (4, 1, 3), (4, 2, 8), (3, 3, 5), (4, 2, 2), (4, 3, 5), (5, 2, 7)])
def test_every_chunk_runs_each_microbatch_forward_then_backward(pp: int, v: int, m: int) -> None:
    for stage, names in enumerate(schedule_names(SimConfig(pp=pp, vstages=v, microbatches=m))):
        chunks = [c * pp + stage for c in range(v)]
        assert sorted(names) == sorted(f"{ph}{c}.{mb}" for ph in "FB" for c in chunks for mb in range(m))
        for c in chunks:
            for mb in range(m):
                assert names.index(f"F{c}.{mb}") < names.index(f"B{c}.{mb}")


@pytest.mark.parametrize("v,m", [(1, 4), (2, 8), (3, 5)])
def test_a_recv_completes_with_its_send_never_before_it_was_posted(v: int, m: int) -> None:
    cfg = SimConfig(tp=2, pp=4, dp=2, steps=2, vstages=v, microbatches=m, noise=0.1, seed=3)
    trace, _ = run_model(cfg)
    n_chunks = cfg.pp * v
    sends = {(o.step, o.unit): (p, o) for p, o in _ops(trace, "send")}
    recvs = _ops(trace, "recv")
    assert len(recvs) == len(sends) == cfg.steps * cfg.n_microbatches * (n_chunks - 1) * 2
    for p, r in recvs:
        phase, chunk, mb = re.fullmatch(r"([FB])(\d+)\.(\d+)", r.unit).groups()
        src_chunk = int(chunk) - 1 if phase == "F" else int(chunk) + 1  # forwards come from the previous chunk
        sp, s = sends[(r.step, f"{phase}{src_chunk}.{mb}")]
        assert sp == src_chunk % cfg.pp and r.peer_stage == sp and s.peer_stage == p
        assert np.all(r.end > np.maximum(s.start, r.start))
        assert np.array_equal(r.end, s.end)


def test_collective_members_complete_together_after_the_last_arrival() -> None:
    trace, _ = run_model(SimConfig(tp=2, cp=2, pp=2, dp=2, steps=2, noise=0.1))
    seen = set()
    for _, o in _ops(trace, "collective"):
        ax = LANE_AXIS[o.dim]
        seen.add(o.dim)
        assert np.array_equal(o.end.max(axis=ax), o.end.min(axis=ax))
        assert np.all(o.end.min(axis=ax) > o.start.max(axis=ax))
        assert not np.all(o.start.max(axis=ax) == o.start.min(axis=ax))  # members arrive at different times
    assert seen == {"tp", "cp", "dp"}


# -- faults, compared with the same seed's clean run (the same noise draws) ---------------------------
BASE = dict(tp=2, cp=2, pp=2, dp=2, steps=3, seed=5, noise=0.05)


def _compute(trace) -> dict[tuple[int, int, str], np.ndarray]:
    """(stage, op index, kernel) -> per-lane duration of every compute op."""
    return {(p, i, o.name): o.end - o.start for p, ops in enumerate(trace.ops) for i, o in enumerate(ops)
            if o.kind == "compute"}


def _ratio_by_rank_step(fault: str) -> tuple[np.ndarray, dict]:
    """compute-time ratio faulted / clean per (rank, step, attention?) on the rank grid."""
    clean, _ = run_model(SimConfig(**BASE))
    hit, faults = run_model(SimConfig(**BASE, faults=(fault,)))
    c, h = _compute(clean), _compute(hit)
    assert c.keys() == h.keys()
    shape = (BASE["steps"], 2, BASE["dp"], BASE["pp"], BASE["cp"], BASE["tp"])  # step, attention?, grid
    out = np.full(shape, np.nan)
    for (p, i, name), d in c.items():
        step = clean.ops[p][i].step
        r = h[(p, i, name)] / d
        out[step, int(name.startswith("attn")), :, p] = r  # every op of a kind has the same ratio per rank
    return out, faults


def _grid(r: int) -> tuple[int, int, int, int]:
    tp, cp, pp, dp = r % 2, r // 2 % 2, r // 4 % 2, r // 8
    return dp, pp, cp, tp


def test_slow_rank_slows_only_that_rank_in_its_steps() -> None:
    ratio, _ = _ratio_by_rank_step("slow:rank=13,factor=1.5,steps=1+2")
    want = np.ones_like(ratio)
    want[1:, :, *_grid(13)] = 1.5
    np.testing.assert_allclose(ratio, want)


def test_moving_and_stage_faults() -> None:
    ratio, _ = _ratio_by_rank_step("moving:ranks=1+6+9,factor=2")
    want = np.ones_like(ratio)
    for step, r in enumerate([1, 6, 9]):
        want[step, :, *_grid(r)] = 2.0
    np.testing.assert_allclose(ratio, want)
    ratio, _ = _ratio_by_rank_step("stage:pp=1,factor=1.3")
    want = np.ones_like(ratio)
    want[:, :, :, 1] = 1.3
    np.testing.assert_allclose(ratio, want)


def test_healthy_chips_that_differ_keep_their_own_speed_in_every_kernel_and_step(tmp_path: Path) -> None:
    clean, _ = run_model(SimConfig(**BASE))
    chips, _ = run_model(SimConfig(**BASE, chip_spread=0.01))
    c, h = _compute(clean), _compute(chips)
    ratios = np.stack([h[k] / c[k] for k in c])  # (compute op, dp, cp, tp) per stage, every op
    by_stage = {p: np.stack([h[k] / c[k] for k in c if k[0] == p]) for p in range(BASE["pp"])}
    for p, r in by_stage.items():  # one factor per rank, the same in every op of every step
        np.testing.assert_allclose(r, np.broadcast_to(r[0], r.shape), rtol=1e-12)
    factors = np.stack([by_stage[p][0] for p in range(BASE["pp"])], axis=1)  # (dp, pp, cp, tp)
    assert 0.002 < np.log(factors).std() < 0.03 and ratios.size
    # the factors the manifest records, rank by rank, are the ones applied
    simulate(SimConfig(**BASE, chip_spread=0.01), tmp_path / "run")
    m = json.loads((tmp_path / "run/manifest.json").read_text())["simulated"]["chips"]
    assert m["spread"] == 0.01
    np.testing.assert_allclose(m["factors"], factors.reshape(-1), rtol=1e-4)
    # identical chips change nothing else the run draws
    again, _ = run_model(SimConfig(**BASE, chip_spread=0.0))
    assert all(np.array_equal(a.end, b.end) for pa, pb in zip(clean.ops, again.ops) for a, b in zip(pa, pb))


def test_cp_imbalance_stretches_attention_of_the_loaded_cp_rank_only() -> None:
    ratio, faults = _ratio_by_rank_step("cp_imbalance:ranks=1,weight=0.5")
    np.testing.assert_allclose(ratio[:, 0], 1.0)  # no other kernel changes
    assert np.all(ratio[:, 1, :, :, 0] == 1.0) and np.all(ratio[:, 1, :, :, 1] > 1.1)
    cfg = SimConfig(**BASE, faults=("cp_imbalance:ranks=1,weight=0.5",))
    sim_dir = simulate(cfg, Path(pytest.importorskip("tempfile").mkdtemp()) / "run")
    truth = json.loads((sim_dir / "manifest.json").read_text())["faults"][0]
    assert truth["ranks"] == [r for r in range(16) if r // 2 % 2 == 1]  # every rank at CP coordinate 1
    for s, factors in truth["magnitude"]["attention_factor_by_step"].items():
        np.testing.assert_allclose(ratio[int(s), 1, :, :, 1], factors[1], rtol=1e-3)
    shutil.rmtree(sim_dir.parent)


def test_slow_links_lengthen_only_their_transfers() -> None:
    clean, _ = run_model(SimConfig(**BASE))
    # ranks 8 and 10 share a CP group (dp 1, pp 0, tp 0); 2 and 6 are stages 0 and 1 of one pipeline
    hit, _ = run_model(SimConfig(**BASE, faults=("link:a=8,b=10,delay_ms=7", "link:a=2,b=6,delay_ms=4,steps=1")))
    extra_cp = []
    for p in range(BASE["pp"]):
        for a, b in zip(clean.ops[p], hit.ops[p]):
            if a.kind == "collective":
                ax = LANE_AXIS[a.dim]
                xa = a.end.max(axis=ax) - a.start.max(axis=ax)
                xb = b.end.max(axis=ax) - b.start.max(axis=ax)
                extra_cp.append((p, a.dim, np.round(xb - xa, 9)))
    def transfers(trace):  # per recv: its end - max(send posted, recv posted)
        sends = {(o.step, o.unit): o for _, o in _ops(trace, "send")}
        out = []
        for p, r in _ops(trace, "recv"):
            phase, chunk, mb = re.fullmatch(r"([FB])(\d+)\.(\d+)", r.unit).groups()
            s = sends[(r.step, f"{phase}{int(chunk) - 1 if phase == 'F' else int(chunk) + 1}.{mb}")]
            out.append((p, r.step, r.end - np.maximum(r.start, s.start)))
        return out

    for (p, step, xa), (_, _, xb) in zip(transfers(clean), transfers(hit)):
        want = np.zeros_like(xa)
        if step == 1:
            want[0, 1, 0] = 4.0  # the (dp 0, cp 1, tp 0) pipeline, both directions
        np.testing.assert_allclose(xb - xa, want, atol=1e-6)
    for p, dim, d in extra_cp:
        want = np.zeros_like(d)
        if p == 0 and dim == "cp":
            want[1, 0] = 7.0  # the (dp 1, tp 0) CP group
        np.testing.assert_allclose(d, want, atol=1e-6)


def _truth(tmp: Path, **kw) -> list[dict]:
    d = simulate(SimConfig(**kw), tmp / "run")
    return json.loads((d / "manifest.json").read_text())


def test_manifest_ground_truth_in_the_trainers_schema(tmp_path: Path) -> None:
    m = _truth(tmp_path, **{**BASE, "skew_ms": 500, "faults": (
        "slow:rank=5,factor=1.5,steps=2", "moving:ranks=1+3,factor=2", "link:a=2,b=6,delay_ms=40",
        "link:a=0,b=1,delay_ms=3", "stage:pp=1,factor=1.3")})
    assert m["layout"] == {"tp": 2, "cp": 2, "pp": 2, "dp": 2} and m["world_size"] == 16
    assert m["backend"] == "nccl" and len(m["hosts"]) == 16 and m["hosts"][8] != m["hosts"][7]
    f = {x["spec"]: x for x in m["faults"]}
    assert f["slow:rank=5,factor=1.5,steps=2"] == {"kind": "slow", "spec": "slow:rank=5,factor=1.5,steps=2",
                                                   "steps": [2], "ranks": [5], "magnitude": {"compute_factor": 1.5}}
    assert f["moving:ranks=1+3,factor=2"]["rank_by_step"] == {"0": 1, "1": 3, "2": 1}
    assert (f["link:a=2,b=6,delay_ms=40"]["link"], f["link:a=2,b=6,delay_ms=40"]["dim"]) == ("p2p", "pp")
    assert (f["link:a=0,b=1,delay_ms=3"]["link"], f["link:a=0,b=1,delay_ms=3"]["dim"]) == ("collective", "tp")
    assert f["stage:pp=1,factor=1.3"]["ranks"] == [4, 5, 6, 7, 12, 13, 14, 15]
    sim = m["simulated"]
    assert len(sim["skew_ms_by_host"]) == 2 and all(abs(v) <= 500 for v in sim["skew_ms_by_host"])


def test_a_job_numbered_pp_outermost_says_so_in_its_manifest_and_its_groups(tmp_path: Path) -> None:
    """--mesh-order pp,dp,cp,tp: rank = tp + 2 * (cp + 2 * (dp + 2 * pp)); the stage fault's ranks,
    the manifest's order (innermost first) and the pipeline groups the traces record follow it."""
    m = _truth(tmp_path, **{**BASE, "order": ("tp", "cp", "dp", "pp"), "faults": ("stage:pp=1,factor=1.3",)})
    assert m["layout"] == {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "order": ["tp", "cp", "dp", "pp"]}
    assert m["faults"][0]["ranks"] == list(range(8, 16))
    doc = json.load(gzip.open(tmp_path / "run" / "traces" / "rank0.json.gz"))
    pgs = {g["pg_desc"]: g["ranks"] for g in doc["distributedInfo"]["pg_config"] if 0 in g["ranks"]}
    assert pgs["mesh_pp"] == [0, 8] and pgs["mesh_dp"] == [0, 4]


# -- what the traces show --------------------------------------------------------------------------
def _kernels(path: Path) -> list[dict]:
    doc = json.load(gzip.open(path))
    return [e for e in doc["traceEvents"] if e.get("cat") == "kernel"], doc["baseTimeNanoseconds"]


def test_clock_skew_moves_absolute_times_only(tmp_path: Path) -> None:
    cfg = dict(tp=2, pp=2, dp=4, steps=2, seed=7, ranks_per_host=4)
    a = simulate(SimConfig(**cfg), tmp_path / "a")
    b = simulate(SimConfig(**cfg, skew_ms=2000), tmp_path / "b")
    offsets = []
    for r in (0, 3, 4, 12):
        (ka, ba), (kb, bb) = _kernels(a / f"traces/rank{r}.json.gz"), _kernels(b / f"traces/rank{r}.json.gz")
        assert [k["name"] for k in ka] == [k["name"] for k in kb]
        np.testing.assert_allclose([k["dur"] for k in ka], [k["dur"] for k in kb], atol=0.0011)  # to the ns
        shift = np.array([(bb - ba) + (kb_["ts"] - ka_["ts"]) * 1e3 for ka_, kb_ in zip(ka, kb)])
        assert np.ptp(shift) <= 2  # one offset per rank, to the ns
        offsets.append(round(float(shift.mean()), -3))
    assert offsets[0] == offsets[1] != offsets[2]  # ranks 0 and 3 share host 0, rank 4 is on host 1
    assert max(abs(o) for o in offsets) > 1e8  # hundreds of ms


def test_hang_leaves_the_stuck_collective_open_and_the_hung_rank_absent(tmp_path: Path) -> None:
    d = simulate(SimConfig(tp=2, pp=2, dp=2, steps=3, faults=("hang:rank=5,step=1,dim=dp",)), tmp_path / "run")
    m = json.loads((d / "manifest.json").read_text())
    hang = m["faults"][0]
    assert hang["ranks"] == [5] and 1 in hang["blocked_ranks"] and 5 not in hang["blocked_ranks"]
    dumps = {r: pickle.loads((d / f"fr/rank{r}").read_bytes()) for r in range(8)}
    dp_group = "[1, 5]"  # rank 5 = (dp 1, pp 0, tp 1)
    stuck = [e for e in dumps[1]["entries"] if e["state"] != "completed"]
    assert stuck[0]["state"] == "started" and stuck[0]["time_discovered_completed_ns"] is None
    assert dumps[1]["pg_config"][stuck[0]["process_group"][0]]["ranks"] == dp_group
    seq = stuck[0]["collective_seq_id"]
    mine = [e for e in dumps[5]["entries"] if e["process_group"][0] == stuck[0]["process_group"][0]]
    assert max(e["collective_seq_id"] for e in mine) == seq - 1
    assert all(e["state"] == "completed" for e in dumps[5]["entries"])
    # Kineto: the peer's record_param_comms of the stuck op is there, its kernel is not
    doc = json.load(gzip.open(d / "traces/rank1.json.gz"))
    in_group = [e for e in doc["traceEvents"] if e.get("args", {}).get("Process Group Ranks") == dp_group]
    rpc = [e for e in in_group if e["name"] == "record_param_comms"]
    kern = [e for e in in_group if e.get("cat") == "kernel"]
    assert len(rpc) == len(kern) + 1


def test_detail_adds_the_profilers_own_events_and_changes_no_comm_row(tmp_path: Path) -> None:
    rows = {}
    for detail in (False, True):
        d = simulate(SimConfig(tp=2, pp=2, dp=2, steps=2, seed=4, detail=detail), tmp_path / str(detail))
        store = tmp_path / f"{detail}.duckdb"
        assert not ingest([d], store).failed
        con = duckdb.connect(str(store), read_only=True)
        rows[detail] = [con.execute(f"SELECT * EXCLUDE (run_id) FROM {t} WHERE source = 'kernel' "
                                    "ORDER BY ALL").fetchall() for t in ("collectives", "p2p")]
        rows[detail].append(con.execute("SELECT rank, name, ts_ns, step FROM events WHERE kind = 'kernel' "
                                        "ORDER BY ALL").fetchall())
        con.close()
    assert rows[True] == rows[False] and len(rows[True][0]) > 100
    raw = json.load(gzip.open(tmp_path / "True/traces/rank3.json.gz"))["traceEvents"]
    flows = [e for e in raw if e.get("cat") == "ac2g"]
    kernels = [e for e in raw if e.get("cat") == "kernel"]
    assert len(flows) == 2 * len(kernels) and {e["ph"] for e in flows} == {"s", "f"}
    assert any(e["name"] == "aten::_flash_attention_forward" for e in raw)


# -- the CLI ---------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from tracekit.cli import main; main()", "simulate", *args],
                          capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("args,message", [
    (["--tp", "2", "--fault", "slow:rank=5,factor=1.5"], "rank 5 outside the world of 2 ranks"),
    (["--tp", "2", "--fault", "slow:rank=1,factr=2"], "unknown field 'factr'"),
    (["--tp", "2", "--pp", "4", "--fault", "link:a=0,b=4,delay_ms=3"], "not adjacent pipeline stages"),
    (["--tp", "2", "--fault", "hang:rank=1,step=9"], "step 9 outside 0..3"),
    (["--cp", "1", "--tp", "2", "--fault", "cp_imbalance:ranks=1"], "needs cp >= 2"),
    (["--tp", "0"], "tp must be a positive integer"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    out = _cli("--out", str(tmp_path / "run"), *args)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_writes_a_run(tmp_path: Path) -> None:
    out = _cli("--tp", "2", "--pp", "2", "--steps", "2", "--out", str(tmp_path / "run"),
               "--fault", "slow:rank=3,factor=1.2", "--names", "plain", "--skew-ms", "100")
    assert out.returncode == 0, out.stderr
    m = json.loads((tmp_path / "run/manifest.json").read_text())
    assert m["faults"][0]["ranks"] == [3] and m["config"]["names"] == "plain"
    assert sorted(p.name for p in (tmp_path / "run/traces").iterdir()) == [f"rank{r}.json.gz" for r in range(4)]


def test_bad_config_raises_sim_error() -> None:
    with pytest.raises(SimError, match="vstages > 1 needs pp >= 2"):
        run_model(SimConfig(vstages=2))


# -- the real ingest -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ingested(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, duckdb.DuckDBPyConnection]:
    tmp = tmp_path_factory.mktemp("sim")
    run = simulate(SimConfig(tp=2, cp=2, pp=4, dp=2, steps=2, seed=2, skew_ms=1500, vstages=2,
                             microbatches=4), tmp / "run")
    bare = tmp / "bare"  # no manifest: the layout must come from the recorded groups
    for sub in ("traces", "fr"):
        shutil.copytree(run / sub, bare / sub)
    rep = ingest([bare], tmp / "s.duckdb")
    assert len(rep.ok) == 64 and not rep.failed, [f.error for f in rep.failed]
    return run, duckdb.connect(str(tmp / "s.duckdb"), read_only=True)


def test_ingest_infers_the_layout_from_devicemesh_groups(ingested) -> None:
    _, con = ingested
    assert con.execute("SELECT tp, cp, pp, dp, world_size FROM runs").fetchall() == [(2, 2, 4, 2, 32)]
    dims = dict(con.execute("SELECT pg_desc, list_distinct(list(dim)) FROM groups GROUP BY 1").fetchall())
    assert dims == {"default_pg": ["world"], "mesh_tp": ["tp"], "mesh_cp": ["cp"], "mesh_pp": ["pp"], "mesh_dp": ["dp"]}


def test_ingest_reads_collectives_p2p_steps_and_fr(ingested) -> None:
    run, con = ingested
    raw = json.load(gzip.open(run / "traces/rank5.json.gz"))
    kern = [e for e in raw["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    coll = con.execute("SELECT count(*), count(pg_name), count(step), count(DISTINCT seq) FROM collectives "
                       "WHERE source = 'kernel' AND rank = 5").fetchone()
    n_p2p = sum(e["args"]["Collective name"] in ("send", "recv") for e in kern)
    assert coll[:3] == (len(kern) - n_p2p,) * 3 and coll[3] > 10
    # every (group, seq) instance has all its members, one op, one size
    bad = con.execute("""SELECT c.pg_name, c.seq FROM collectives c JOIN groups g USING (run_id, pg_name)
                         WHERE c.source = 'kernel' GROUP BY c.pg_name, c.seq, g.size
                         HAVING count(DISTINCT c.rank) <> g.size OR count(DISTINCT c.op) <> 1
                             OR count(DISTINCT c.nbytes) <> 1""").fetchall()
    assert bad == []
    dims = {d for (d,) in con.execute("SELECT DISTINCT g.dim FROM collectives c JOIN groups g "
                                      "USING (run_id, pg_name) WHERE c.source = 'kernel'").fetchall()}
    assert dims == {"tp", "cp", "dp"}
    # p2p: over the 4-stage pipeline group, no peer recorded (NCCL names none)
    p2p = con.execute("SELECT count(*), count(peer), list_distinct(list(direction)) FROM p2p "
                      "WHERE source = 'kernel'").fetchone()
    lanes, steps, mbs, hops = 8, 2, 4, 4 * 2 - 1  # 8 pipelines; 8 chunks: 7 hops forward and 7 back
    assert p2p[0] == lanes * steps * mbs * hops * 2 * 2 and p2p[1] == 0 and sorted(p2p[2]) == ["recv", "send"]
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 32 * 2
    fr_ops = {op for (op,) in con.execute("SELECT DISTINCT op FROM collectives WHERE source = 'fr'").fetchall()}
    assert fr_ops == {"all_reduce", "all_gather", "reduce_scatter"}  # nccl:_all_gather_base read as all_gather
    fr = con.execute("SELECT count(*), count(DISTINCT rank), list_distinct(list(state)) FROM fr_entries").fetchone()
    assert fr[1] == 32 and fr[2] == ["completed"]
    assert fr[0] == sum(len(pickle.loads((run / f"fr/rank{r}").read_bytes())["entries"]) for r in range(32))
