"""Fault specs, their ground truth, CP data imbalance, and the flight recorder's dump triggers
(in-process: no spawned world)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("reference_trainer.train", reason="needs reference_trainer")

from reference_trainer.comm import CommRecord, Group  # noqa: E402
from reference_trainer.config import ConfigError, TrainConfig  # noqa: E402
from reference_trainer.faults import (FaultError, ImbalancedCorpus, check_faults, cp_pair_counts,  # noqa: E402
                                      ground_truth, parse_fault, parse_faults)
from reference_trainer.flight_recorder import FlightRecorder, fr_path, load_dump  # noqa: E402
from reference_trainer.observe import check_observability  # noqa: E402
from tracekit.conventions import CommAnnotation  # noqa: E402

CFG = TrainConfig(tp=2, cp=2, pp=2, dp=2, steps=5, seq_len=64)


def test_parse_slow_with_steps():
    f = parse_fault("slow:rank=5,factor=1.5,steps=2-4")
    assert (f.kind, f.params) == ("slow", {"rank": 5, "factor": 1.5, "steps": [2, 3, 4]})
    assert [f.slow_rank(s) for s in range(5)] == [None, None, 5, 5, 5]
    assert ground_truth(f, CFG) == {"kind": "slow", "spec": "slow:rank=5,factor=1.5,steps=2-4",
                                    "steps": [2, 3, 4], "ranks": [5], "magnitude": {"compute_factor": 1.5}}


def test_moving_straggler_ground_truth_per_step():
    f = parse_fault("moving:ranks=1+5+3,factor=2")
    gt = ground_truth(f, CFG)
    assert gt["rank_by_step"] == {"0": 1, "1": 5, "2": 3, "3": 1, "4": 5}
    assert gt["ranks"] == [1, 3, 5] and gt["steps"] == [0, 1, 2, 3, 4]


def test_several_specs_and_link_and_hang():
    fs = parse_faults("link:a=2,b=3,delay_ms=40;hang:rank=3,step=1,op=all_reduce,dim=dp")
    check_faults(fs, CFG)
    assert ground_truth(fs[0], CFG)["magnitude"] == {"delay_ms": 40.0}
    assert ground_truth(fs[1], CFG)["steps"] == [1] and ground_truth(fs[1], CFG)["dim"] == "dp"


@pytest.mark.parametrize("spec, msg", [
    ("fast:rank=1", "unknown kind"),
    ("slow:rank=1", "missing"),
    ("slow:rank=1,factor=0.5", "factor must be >= 1"),
    ("slow:rank=x,factor=2", "not a number"),
    ("slow:rank=1,factor=2,color=red", "unknown field"),
    ("slow:rank1,factor=2", "not key=value"),
])
def test_bad_specs_raise_naming_the_spec(spec, msg):
    with pytest.raises(FaultError, match=msg):
        parse_fault(spec)


@pytest.mark.parametrize("spec, msg", [
    ("slow:rank=16,factor=2", "outside the world"),
    ("link:a=1,b=1,delay_ms=5", "two different ranks"),
    ("hang:rank=0,step=9", "outside"),
    ("cp_imbalance:ranks=2", "CP ranks"),
])
def test_specs_that_do_not_fit_the_run(spec, msg):
    with pytest.raises(FaultError, match=msg):
        check_faults(parse_faults(spec), CFG)
    with pytest.raises(ConfigError):  # what the launcher and CLI see
        check_observability(CFG.replace(faults=spec))


def test_cp_imbalance_loads_chosen_rank_under_sequence_sharding_only():
    seq = CFG.replace(cp=2, cp_sharding="sequence")
    doc = seq.replace(cp_sharding="document")
    tokens = ImbalancedCorpus(seq, [1]).global_batch(0)
    a, b = cp_pair_counts(seq, tokens)
    assert b > 2.5 * a  # rank 1 holds the long documents' chunks
    a2, b2 = cp_pair_counts(doc, tokens)
    assert abs(a2 - b2) <= 0.05 * (a2 + b2)  # per-document sharding rebalances the same data
    gt_seq = ground_truth(parse_fault("cp_imbalance:ranks=1"), seq)
    gt_doc = ground_truth(parse_fault("cp_imbalance:ranks=1"), doc)
    assert gt_seq["ranks"] == [r for r in range(seq.world_size) if seq.layout.coords(r).cp == 1]
    assert gt_doc["ranks"] == []
    assert gt_seq["magnitude"]["pair_ratio_by_step"]["0"][1] > 1.4


def _record(seq: int, op: str = "all_reduce", peer: int | None = None) -> CommRecord:
    g = Group("7", "tp", (0, 1), 0)
    ann = CommAnnotation(op=op, pg="7", dim="tp", seq=seq, ranks=(0, 1), nbytes=16, dtype="float32", peer=peer)
    return CommRecord(ann, g, [[4]], [[4]], "float32")


def test_recorder_entries_follow_torch_schema(tmp_path: Path):
    fr = FlightRecorder(0, [Group("7", "tp", (0, 1), 0)], tmp_path)
    r0, r1 = _record(0), _record(0, "send", peer=1)
    fr.before(r0), fr.after(r0), fr.before(r1)
    d = load_dump(fr.dump("end"))
    assert d["version"] == "2.10" and d["pg_config"]["7"] == {"name": "7", "desc": "tp", "ranks": "[0, 1]"}
    e0, e1 = d["entries"]
    assert e0["state"] == "completed" and e0["profiling_name"] == "gloo:all_reduce"
    assert e0["input_dtypes"] == ["Float"] and e0["collective_seq_id"] == 0 and e0["duration_ms"] >= 0
    assert e1["state"] == "started" and e1["profiling_name"] == "gloo:send 0->1" and e1["is_p2p"]
    assert e1["collective_seq_id"] == e1["p2p_seq_id"] == -1 and e1["seq"] == 0


def test_watchdog_dumps_a_stall_once_and_signal_dumps_on_demand(tmp_path: Path):
    fr = FlightRecorder(0, [Group("7", "tp", (0, 1), 0)], tmp_path)
    fr.start_watchdog(0.3)
    try:
        fr.before(_record(0))  # never completes
        deadline = time.monotonic() + 10
        while "timeout" not in fr.dumps and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        assert fr.dumps == ["timeout"]  # once per stall, not once per tick
        assert load_dump(fr_path(tmp_path, 0))["entries"][0]["state"] == "started"
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "signal" not in fr.dumps and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fr.dumps[-1] == "signal"
        assert pickle.loads(fr_path(tmp_path, 0).read_bytes())["dump_reason"] == "signal"
    finally:
        fr.stop()


def test_load_dump_rejects_garbage(tmp_path: Path):
    bad = tmp_path / "rank0"
    bad.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="rank0"):
        load_dump(bad)
    bad.write_bytes(pickle.dumps({"entries": []}))
    with pytest.raises(ValueError, match="lacks"):
        load_dump(bad)
