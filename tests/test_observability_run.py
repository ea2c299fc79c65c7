"""Run directories of real 4-rank gloo runs (tp 2 x pp 2), read back: Chrome traces, flight-recorder
dumps checked by torch's own ``torchfrtrace``, memory snapshots read by ``torch.cuda._memory_viz``,
the manifest's ground truth, and the measured effect of the injected faults.

One world runs two jobs: a slow rank (profiled) and a slow link. A second world (conftest's, shared
with test_analysis_hangs) runs a hang, which must end in a LaunchError and leave dumps naming the
stalled collective.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("reference_trainer.train", reason="needs reference_trainer")

from reference_trainer.config import TrainConfig  # noqa: E402
from reference_trainer.flight_recorder import fr_path, load_dump  # noqa: E402
from reference_trainer.launch import launch_many  # noqa: E402
from reference_trainer.profiling import memory_path, read_trace, trace_path  # noqa: E402
from tracekit.conventions import parse_comm  # noqa: E402

BASE = TrainConfig(tp=2, pp=2, n_layers=2, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, seq_len=64,
                   micro_batches=2, steps=3, timeout_s=120)
SLOW_RANK, SLOW_FACTOR = 3, 3.0
WORLD = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("obs")
    jobs = [(BASE.replace(profile_steps="1-2", faults=f"slow:rank={SLOW_RANK},factor={SLOW_FACTOR}"),
             root / "slow"),
            (BASE.replace(steps=2, faults="link:a=0,b=1,delay_ms=150,steps=1"), root / "link"),
            # profiled with Python stacks (with_stack): its snapshots' frames gain source lines
            (BASE.replace(profile_steps="1-2", profile_stack=True, faults="moving:ranks=1+2+3,factor=4"),
             root / "moving"),
            (BASE.replace(tp=1, pp=4, n_layers=4, steps=2), root / "pp4")]
    results = launch_many(jobs)
    return dict(zip(("slow", "link", "moving", "pp4"), results))


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _torchfrtrace(fr_dir: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("torchfrtrace")
    cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
    return subprocess.run(cmd + [str(fr_dir)], capture_output=True, text=True, timeout=300, env=_env())


def test_run_directory_is_complete(runs):
    out = runs["slow"].out
    m = json.loads((out / "manifest.json").read_text())
    assert m["artifacts"]["memory_source"] == "profiler_events"
    assert m["artifacts"]["profiled_steps"] == [1, 2]
    for r in range(WORLD):
        assert trace_path(out, r).stat().st_size > 0
        assert fr_path(out, r).stat().st_size > 0
        assert memory_path(out, r).stat().st_size > 0


def test_traces_are_chrome_json_with_profiler_steps(runs):
    for r in range(WORLD):
        t = read_trace(trace_path(runs["slow"].out, r))
        assert isinstance(t["traceEvents"], list) and t["distributedInfo"]["rank"] == r
        for e in t["traceEvents"]:
            assert {"ph", "name"} <= set(e) or e.get("ph") == "M"
            if e["ph"] == "X":
                assert e["dur"] >= 0 and "ts" in e
        steps = {e["name"] for e in t["traceEvents"] if e["name"].startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#1", "ProfilerStep#2"}
        assert any(e["name"] == "[memory]" for e in t["traceEvents"])


def _fr_ops(out: Path) -> dict[int, list[dict]]:
    return {r: load_dump(fr_path(out, r))["entries"] for r in range(WORLD)}


def test_every_comm_op_recorded_once_per_participant_with_matching_group_and_seq(runs):
    dumps = {r: load_dump(fr_path(runs["slow"].out, r)) for r in range(WORLD)}
    coll = collections.defaultdict(list)
    p2p = collections.defaultdict(list)
    for r, d in dumps.items():
        assert d["dump_reason"] == "end"
        for e in d["entries"]:
            assert e["state"] == "completed" and e["duration_ms"] >= 0
            assert e["time_created_ns"] <= e["time_discovered_completed_ns"]
            name = e["process_group"][0]
            members = json.loads(d["pg_config"][name]["ranks"])
            assert r in members
            if e["is_p2p"]:
                p2p[(name, e["collective_seq_id"])].append((r, e["profiling_name"].split()[0]))
            else:
                coll[(name, e["collective_seq_id"])].append((r, e["profiling_name"]))
    for (name, seq), seen in coll.items():
        members = json.loads(dumps[seen[0][0]]["pg_config"][name]["ranks"])
        assert sorted(r for r, _ in seen) == sorted(members), (name, seq, seen)  # once per member
        assert len({op for _, op in seen}) == 1
    for key, seen in p2p.items():
        assert sorted(op for _, op in seen) == ["gloo:recv", "gloo:send"], (key, seen)
    # 3 steps x 2 micro-batches x (activation forward + gradient backward) on each of 2 PP pairs
    assert len(p2p) == 3 * 2 * 2 * 2
    # the trace's tk.comm spans of the profiled steps are the same ops (group, seq) as in the dumps
    for r in range(WORLD):
        anns = [a for e in read_trace(trace_path(runs["slow"].out, r))["traceEvents"]
                if (a := parse_comm(e.get("name", ""))) is not None and e["ph"] == "X"]
        fr = {(e["process_group"][0].split(":")[0], e["seq"], e["profiling_name"].split(":")[1].split()[0])
              for e in dumps[r]["entries"] if e["step"] in (1, 2)}
        assert anns and {(a.pg, a.seq, a.op) for a in anns} == fr


def test_torchfrtrace_accepts_clean_run(runs):
    res = _torchfrtrace(runs["slow"].out / "fr")
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "Not all ranks joining" not in text and "mismatch" not in text.lower(), text


def test_torchfrtrace_accepts_p2p_in_groups_of_four(runs):
    """pp = 4: p2p ops are recorded on two-rank pseudo groups, which the analyzer matches."""
    out = runs["pp4"].out
    d = load_dump(fr_path(out, 1))
    pairs = {e["process_group"][0] for e in d["entries"] if e["is_p2p"]}
    assert pairs and all(":" in p and d["pg_config"][p]["desc"] == "pp_p2p" for p in pairs)
    assert {json.loads(d["pg_config"][p]["ranks"])[0] for p in pairs} == {0, 1}  # pairs (0,1) and (1,2)
    res = _torchfrtrace(out / "fr")
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "Not all ranks joining" not in text and "mismatch" not in text.lower(), text


def test_memory_snapshots_load_in_torch_memory_viz(runs):
    for r in (0, SLOW_RANK):
        path = memory_path(runs["slow"].out, r)
        for cmd in ("stats", "trace"):
            res = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", cmd, str(path)],
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr
        assert "TOTAL MEM" in res.stdout
        snap = pickle.loads(path.read_bytes())
        cats = collections.Counter(e.get("category") for e in snap["device_traces"][0] if e["action"] == "alloc")
        block_cats = {b["category"] for s in snap["segments"] for b in s["blocks"]}
        assert {"parameter", "gradient", "optimizer_state"} <= block_cats
        assert cats["activation"] > 0 and cats["temporary"] > 0, cats


def test_memory_snapshots_say_what_made_almost_every_byte(runs, tmp_path):
    """The CPU snapshots carry frames (the profiler spans around each allocation, the trainer's name
    for each state buffer): torch's own memory_viz finds a stack for the blocks, and tracekit names an
    allocation site for what is live at every rank's peak and for the peak's allocation."""
    from torch.cuda import _memory_viz

    from tracekit.cli import main as cli_main

    for r in range(WORLD):
        snap = pickle.loads(memory_path(runs["slow"].out, r).read_bytes())
        flame = io.StringIO()  # memory_viz's flame-graph lines: 'stream;state;frame;frame... bytes'
        for seg in snap["segments"]:
            _memory_viz._write_blocks(flame, f"stream_{seg['stream']}", seg["blocks"])
        sizes = collections.Counter()
        for line in flame.getvalue().splitlines():
            stack, size = line.rsplit(" ", 1)
            sizes["<non-python>" in stack] += int(size)
        assert sizes[False] >= 0.95 * sum(sizes.values()), (r, sizes)
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        framed = sum(e["size"] for e in allocs if e["frames"])
        assert framed >= 0.95 * sum(e["size"] for e in allocs), r
    res = CliRunner().invoke(cli_main, ["memory", str(runs["slow"].out), "--store", str(tmp_path / "s.duckdb"),
                                        "--by", "frame", "--top", "100000", "--json", "--no-estimate"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    live = collections.Counter()
    for row in out["live_by_frame"]:
        live[row["frame"] == "<unknown>"] += row["bytes"]
    assert live[False] >= 0.95 * sum(live.values()), live
    assert all(p["peak_frame"] and p["peak_frame"].startswith("<profiler op>:0:") for p in out["peaks"])


def test_a_run_profiled_with_stacks_names_source_lines(runs):
    """--profile-stack: the trace's python_function spans become source frames among the spans'."""
    snap = pickle.loads(memory_path(runs["moving"].out, 0).read_bytes())
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    with_source = [e for e in allocs if any(f["filename"].endswith("reference_trainer/model.py") and f["line"] > 0
                                            for f in e["frames"])]
    assert len(with_source) >= 0.2 * len(allocs)
    assert any(f["name"] == "_layer" for e in with_source for f in e["frames"])
    plain = pickle.loads(memory_path(runs["slow"].out, 0).read_bytes())
    assert not any(f["line"] for e in plain["device_traces"][0] for f in e["frames"])  # spans only



# The faults' measured effects (the slow rank's compute ratio, the link's op durations vs the others',
# the moving straggler's slowest rank per step) are wall-clock figures on 4 ranks sharing the cores:
# benchmarks/fault_effects.py prints them; the tests below check what no load can change.

def test_slow_rank_fault_is_recorded_with_its_truth(runs):
    truth = runs["slow"].manifest["faults"]
    assert truth == [{"kind": "slow", "spec": f"slow:rank={SLOW_RANK},factor={SLOW_FACTOR}", "steps": [0, 1, 2],
                      "ranks": [SLOW_RANK], "magnitude": {"compute_factor": SLOW_FACTOR}}]


def test_slow_link_delays_every_op_between_its_ranks_in_its_step(runs):
    out = runs["link"].out
    ents = _fr_ops(out)
    dur = collections.defaultdict(list)  # (rank, step, in-link-group) -> durations
    for r, es in ents.items():
        for e in es:
            members = set(json.loads(load_dump(fr_path(out, r))["pg_config"][e["process_group"][0]]["ranks"]))
            dur[(r, e["step"], {0, 1} <= members)].append(e["duration_ms"])
    assert dur[(0, 1, True)] and dur[(1, 1, True)] and dur[(2, 1, False)]
    # A lower bound the injected 150 ms sleep inside each op guarantees (no load can break it); the
    # contrast with unfaulted ops is a wall-clock figure: benchmarks/fault_effects.py.
    assert min(dur[(0, 1, True)]) >= 150 and min(dur[(1, 1, True)]) >= 150
    assert runs["link"].manifest["faults"][0]["ranks"] == [0, 1]
    assert runs["link"].manifest["faults"][0]["magnitude"] == {"delay_ms": 150.0}


def test_moving_straggler_truth_names_one_rank_per_step(runs):
    run = runs["moving"]
    (fault,) = run.manifest["faults"]
    assert fault["rank_by_step"] == {"0": 1, "1": 2, "2": 3}
    assert fault["ranks"] == [1, 2, 3] and fault["magnitude"]["compute_factor"] == 4.0


@pytest.fixture(scope="module")
def hang_run(trainer_hang_run):
    """BASE's layout, rank 2 hung in step 1's PP all-reduce (conftest: test_analysis_hangs reads it too)."""
    return trainer_hang_run


def test_hang_dumps_name_the_stalled_collective(hang_run):
    dumps = {r: load_dump(fr_path(hang_run, r)) for r in range(WORLD)}
    assert dumps[2]["dump_reason"] == "timeout"  # the stalled rank's watchdog
    pending = [e for e in dumps[0]["entries"] if e["state"] != "completed"]
    assert len(pending) == 1
    stuck = pending[0]
    assert stuck["profiling_name"] == "gloo:all_reduce" and stuck["step"] == 1
    members = json.loads(dumps[0]["pg_config"][stuck["process_group"][0]]["ranks"])
    assert members == [0, 2] and stuck["process_group"][1] == "pp"
    # rank 2 never issued it
    assert not any(e["process_group"][0] == stuck["process_group"][0]
                   and e["collective_seq_id"] == stuck["collective_seq_id"] for e in dumps[2]["entries"])
    manifest = json.loads((hang_run / "manifest.json").read_text())
    assert manifest["faults"][0]["kind"] == "hang" and manifest["faults"][0]["ranks"] == [2]


def test_torchfrtrace_names_the_missing_rank(hang_run):
    res = _torchfrtrace(hang_run / "fr")
    text = res.stdout + res.stderr
    blocks = text.split("Not all ranks joining collective")[1:]
    stalled = [b for b in blocks if "missing ranks: {2}" in b]
    assert stalled, text
    # the stalled collective: step 1's loss all_reduce over the PP group {0, 2}, seq 1
    assert any("gloo:all_reduce" in b and "expected ranks: {0, 2}" in b and ":pp" in b
               and b.lstrip().startswith(", sequence number: 1\n") for b in stalled), text
