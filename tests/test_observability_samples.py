"""The bundled sample runs (sample_traces/, made by sample_traces/regenerate.py) read back: torch's
torchfrtrace accepts their dumps, the memory snapshots load, and the ground truth in each manifest
is what the traces show (the slow rank has the longest own compute; the loaded CP ranks are slower
than their CP peers). A ``-m slow`` test regenerates the 16-rank 2x2x2x2 run of issue 3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest

from reference_trainer.profiling import read_trace, trace_path
from _trainer_trace import exclusive_compute_ms

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_traces"



def _run(name: str) -> tuple[Path, dict]:
    run = SAMPLES / name
    if not (run / "manifest.json").exists():
        pytest.skip(f"{run} not bundled")
    return run, json.loads((run / "manifest.json").read_text())


@pytest.mark.parametrize("name", ["slow_rank_8", "cp_imbalance_8"])
def test_sample_dumps_pass_torchfrtrace_and_snapshots_load(name):
    run, m = _run(name)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(run / "fr")],
                         capture_output=True, text=True, timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "Not all ranks" not in text and "mismatch" not in text.lower(), text
    res = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(run / "memory/rank0.pickle")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert m["artifacts"]["memory_source"] == "profiler_events"


def test_slow_rank_sample_matches_its_ground_truth():
    run, m = _run("slow_rank_8")
    (fault,) = m["faults"]
    ms = {r: exclusive_compute_ms(read_trace(trace_path(run, r))) for r in range(m["world_size"])}
    slow = fault["ranks"][0]
    assert max(ms, key=ms.get) == slow, ms
    assert ms[slow] > 1.4 * median(v for r, v in ms.items() if r != slow), ms


def test_cp_imbalance_sample_loaded_ranks_are_slower_than_their_cp_peers():
    run, m = _run("cp_imbalance_8")
    (fault,) = m["faults"]
    assert fault["sharding"] == "sequence" and fault["cp_ranks"] == [1]
    ms = {r: exclusive_compute_ms(read_trace(trace_path(run, r))) for r in range(m["world_size"])}
    loaded = set(fault["ranks"])
    for r in loaded:
        peer = r ^ 1  # tp = 1: the CP partner differs in the lowest bit
        assert peer not in loaded and ms[r] > ms[peer], (r, peer, ms)


@pytest.mark.slow
def test_sixteen_rank_slow_run_regenerates_and_checks(tmp_path):
    res = subprocess.run([sys.executable, str(SAMPLES / "regenerate.py"), "--out", str(tmp_path), "--with-16",
                          "--only", "slow_rank_16"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "slow_rank_16"
    m = json.loads((run / "manifest.json").read_text())
    assert m["world_size"] == 16 and m["faults"][0]["ranks"] == [11]
    ms = {r: exclusive_compute_ms(read_trace(trace_path(run, r))) for r in range(16)}
    assert max(ms, key=ms.get) == 11, ms
