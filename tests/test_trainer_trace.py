"""A profiled step of a real 4-rank run (tp 2, pp 2): the Chrome trace names every group's dimension
in ``distributedInfo.pg_config`` and carries one ``tk.comm`` span per op per participating rank with
matching (group, sequence) across the group, plus ``tk.compute`` spans for every action."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from reference_trainer.comm import Comm
from reference_trainer.config import TrainConfig
from reference_trainer.launch import free_port, run_world, start_method
from reference_trainer.train import Trainer
from tracekit.conventions import parse_comm, parse_compute

CFG = TrainConfig(tp=2, pp=2, n_layers=2, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, seq_len=32,
                  micro_batches=3, steps=1)


def _worker(rank: int, world: int, out: str, init_method: str) -> None:
    torch.set_num_threads(1)
    comm = Comm.init_world("gloo", rank, world, init_method, 300, "native", torch.device("cpu"))
    trainer = Trainer(CFG, comm)
    trainer.train_step()  # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step()
    prof.export_chrome_trace(str(Path(out) / f"rank{rank}.json"))
    comm.shutdown()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    run_world(_worker, 4, (str(out), f"tcp://127.0.0.1:{free_port()}"), timeout_s=600, method=start_method("gloo"))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_pg_config_names_dimensions(traces):
    for rank, t in enumerate(traces):
        info = t["distributedInfo"]
        assert info["rank"] == rank and info["world_size"] == 4
        by_desc = collections.defaultdict(list)
        for pg in info["pg_config"]:
            by_desc[pg["pg_desc"]].append(sorted(pg["ranks"]))
        # torch lists the groups this rank belongs to, each under its dimension
        for dim in ("tp", "pp", "cp", "dp", "dp_cp"):
            assert sorted(CFG.layout.group(rank, dim)) in by_desc[dim], (rank, dim, dict(by_desc))


def test_every_comm_op_appears_on_every_member_with_matching_sequence(traces):
    seen = collections.defaultdict(set)  # (pg, seq, op, peer-direction) -> ranks
    for rank, t in enumerate(traces):
        for e in t["traceEvents"]:
            a = parse_comm(e.get("name", ""))
            if a is None:
                continue
            assert rank in a.ranks
            key = (a.pg, a.seq, a.op) if not a.is_p2p else (
                a.pg, a.seq, tuple(sorted((rank, a.peer))), rank if a.op == "send" else a.peer)
            seen[key].add(rank)
    coll = {k: v for k, v in seen.items() if len(k) == 3}
    p2p = {k: v for k, v in seen.items() if len(k) == 4}
    assert coll and p2p
    for (pg, seq, op), ranks in coll.items():
        assert len(ranks) == 2, (pg, seq, op, ranks)  # both members of the 2-rank group
    for key, ranks in p2p.items():
        assert ranks == set(key[2]), key  # the sender and the receiver
    # forward and backward activations of 3 micro-batches in each direction between the stages
    assert len(p2p) == 2 * 3 * 2


def test_compute_spans_cover_every_action(traces):
    for rank, t in enumerate(traces):
        anns = [parse_compute(e["name"]) for e in t["traceEvents"] if e.get("name", "").startswith("tk.compute ")]
        phases = collections.Counter(a.phase for a in anns)
        assert phases == {"fwd": 3, "bwd": 3, "opt": 1}, (rank, phases)
        assert {a.vstage for a in anns if a.phase == "fwd"} == {rank // 2}
