"""Hang diagnosis from flight-recorder entries: a real gloo hang (torch's own FR dumps) and the cases
a ring buffer and NCCL states produce."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import polars as pl
import pytest

import tracekit
from reference_trainer.launch import start_method
from tracekit.analysis.hangs import diagnose_hang
from tracekit.analysis.tables import conform
from tracekit.ingest import ingest


def _hang_main(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    sub = dist.new_group([0, 1], group_desc="tp")
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    if rank != 2:  # rank 2 never joins the 4th world all-reduce: ranks 0 and 1 wait in it
        dist.all_reduce(t, async_op=True)
    import time

    time.sleep(0.5)
    (Path(out) / "fr").mkdir(exist_ok=True)
    (Path(out) / "fr" / f"rank{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    if rank == 0:
        (Path(out) / "manifest.json").write_text(json.dumps({"run_id": "gloo-hang", "world_size": 3,
                                                             "config": {"tp": 1, "cp": 1, "pp": 1, "dp": 3}}))
    os._exit(0)  # the pending all-reduce would block a clean shutdown


@pytest.fixture(scope="module")
def hang_store(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("hang") / "run"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_hang_main, args=(port, str(out)), nprocs=3, start_method=start_method("gloo"))
    db = out.parent / "s.duckdb"
    assert not ingest([out], db).failed
    return db


def test_real_gloo_hang_names_the_collective_and_the_absent_rank(hang_store: Path) -> None:
    with tracekit.open(hang_store) as s:
        rep = s.hangs()
    assert rep.hung and rep.culprits == (2,)
    stuck = rep.stuck[0]
    assert stuck.op == "all_reduce" and stuck.seq == 4
    assert stuck.joined == (0, 1) and stuck.missing == (2,) and stuck.no_record == ()
    assert len(rep.stuck) == 1  # the tp group [0, 1] finished its one all-reduce on both ranks
    assert "never joined" in rep.headline and "[2]" in rep.headline
    assert rep.to_dict()["culprits"] == [2]


def _entries(rows: list[tuple]) -> pl.DataFrame:
    """Flight-recorder rows in the order given (record_id); send/recv names are p2p entries."""
    df = pl.DataFrame(rows, schema={"rank": pl.Int64, "pg_name": pl.Utf8, "collective_seq_id": pl.Int64,
                                    "state": pl.Utf8, "profiling_name": pl.Utf8}, orient="row")
    p2p = pl.col("profiling_name").str.contains("send|recv")
    return conform(df.with_row_index("record_id").with_columns(
        pl.lit("r").alias("run_id"), p2p.alias("is_p2p"), pl.when(p2p).then(1).alias("p2p_seq_id")), "fr_entries")


def _groups(members: dict[str, list[int]]) -> pl.DataFrame:
    return pl.DataFrame({"pg_name": list(members), "pg_desc": ["dp"] * len(members),
                         "ranks": list(members.values())})


def test_nccl_states_stuck_collective_everyone_entered_is_reported() -> None:
    # all four entered #7, nobody completed it: a stall inside the collective, nobody missing
    rows = [(r, "0", s, "completed", "nccl:all_reduce") for r in range(4) for s in range(1, 7)]
    rows += [(r, "0", 7, "started", "nccl:all_reduce") for r in range(4)]
    rep = diagnose_hang(_entries(rows), _groups({"0": [0, 1, 2, 3]}))
    assert rep.hung and rep.stuck[0].seq == 7 and rep.stuck[0].joined == (0, 1, 2, 3) and not rep.stuck[0].missing


def test_nccl_states_one_rank_behind_and_one_without_dump() -> None:
    rows = [(r, "0", s, "completed", "nccl:all_gather") for r in (0, 1) for s in range(1, 5)]
    rows += [(r, "0", 5, "started", "nccl:all_gather") for r in (0, 1)]
    rows += [(2, "0", s, "completed", "nccl:all_gather") for s in range(1, 5)]  # stopped before #5
    rep = diagnose_hang(_entries(rows), _groups({"0": [0, 1, 2, 3]}))  # rank 3 left no dump
    s = rep.stuck[0]
    assert (s.seq, s.op, s.joined, s.missing, s.no_record) == (5, "all_gather", (0, 1), (2,), (3,))
    # rank 2 recorded, stopped before #5 and waits in nothing: the culprit; rank 3 has no data to blame
    assert rep.culprits == (2,) and rep.no_data == (3,) and rep.blocked == (0, 1)
    assert rep.headline.endswith("without data: rank 3: no flight-recorder entries"), rep.headline


def test_ranks_waiting_on_p2p_from_the_hung_stage_are_blocked_not_culprits() -> None:
    """Rank 3 never joins TP all-reduce #4 (its partner 2 waits in it); ranks 0 and 1, the previous
    stage, wait in a p2p receive from it and so never reach their own #4 either: blocked, not culprits."""
    rows = [(r, "tp", s, "completed", "nccl:all_reduce") for r in range(4) for s in range(1, 4)]
    rows += [(2, "tp", 4, "started", "nccl:all_reduce")]
    rows += [(r, "pp", None, "started", "nccl:recv 1<-0") for r in (0, 1)]
    rep = diagnose_hang(_entries(rows), _groups({"tp": [0, 1, 2, 3], "pp": [0, 2]}), world_size=5)
    assert rep.culprits == (3,) and rep.blocked == (0, 1, 2) and rep.no_data == (4,)


def test_a_member_without_records_beside_completed_collectives_is_no_hang() -> None:
    """Ranks 0 and 1 completed #1-#4 of group [0, 1, 2], which needed rank 2 too: rank 2's records are
    missing, nothing is stuck, and nobody is blamed."""
    rows = [(r, "0", s, "completed", "nccl:all_reduce") for r in (0, 1) for s in range(1, 5)]
    rep = diagnose_hang(_entries(rows), _groups({"0": [0, 1, 2]}), world_size=3)
    assert not rep.hung and rep.culprits == () and rep.no_data == (2,)


def test_a_rank_whose_completed_entries_left_the_ring_buffer_is_not_taken_as_waiting() -> None:
    """A ring buffer keeps each rank's newest entries. Ranks 0-2 completed DP all-gather #8 and wait in
    #9; rank 3 (the hung one) completed #8 too, but its buffer kept only #8, while ranks 1 and 2's
    buffers lost #8's completion and kept only their open #9. Rank 3 stopped before #9: the culprit."""
    rows = [(0, "dp", 8, "completed", "nccl:all_gather"), (0, "dp", 9, "started", "nccl:all_gather")]
    rows += [(r, "dp", 9, "started", "nccl:all_gather") for r in (1, 2)]
    rows += [(3, "dp", 8, "completed", "nccl:all_gather")]
    rep = diagnose_hang(_entries(rows), _groups({"dp": [0, 1, 2, 3]}), world_size=4)
    assert rep.hung and rep.stuck[0].seq == 9 and rep.stuck[0].missing == (3,), rep.headline
    assert rep.culprits == (3,) and rep.blocked == (0, 1, 2)


def test_no_hang_and_no_entries() -> None:
    rows = [(r, "0", s, "completed", "nccl:all_reduce") for r in range(2) for s in range(1, 4)]
    rep = diagnose_hang(_entries(rows), _groups({"0": [0, 1]}))
    assert not rep.hung and rep.headline.startswith("no hang")
    empty = diagnose_hang(_entries([]), _groups({}))
    assert not empty.hung and "no flight-recorder entries" in empty.headline


def test_trainer_hang_fault_names_the_stalled_rank(trainer_hang_run: Path) -> None:
    """The reference trainer with ``hang:rank=2,step=1,op=all_reduce,dim=pp`` (conftest; its flight
    recorder dumps on the watchdog): ``tracekit hangs`` on the run directory names rank 2 and the pp
    all-reduce."""
    from click.testing import CliRunner

    from tracekit.cli import main

    run = trainer_hang_run
    res = CliRunner().invoke(main, ["hangs", str(run), "--json", "--check"])
    assert res.exit_code == 1, res.output
    blob = json.loads(res.output)["hangs"]
    assert blob["hung"] and blob["culprits"] == [2]
    first = blob["stuck"][0]
    assert (first["pg_desc"], first["op"], first["joined"], first["missing"]) == ("pp", "all_reduce", [0], [2])


def test_a_receive_stamped_before_the_send_recorded_ahead_of_it_still_waits() -> None:
    """A batched send and receive of an interleaved pipeline: the recorder put the completed send
    first (record 10) and the receive, still started, after it (record 11), but stamped the receive
    15 us earlier. Ordered by time, the send was rank 0's newest entry, so rank 0 (blocked on the hung
    stage) waited in nothing and was named a culprit beside rank 3 (simulator draw 9)."""
    rows = [(r, "dp", s, "completed", "nccl:all_reduce") for r in range(4) for s in range(1, 4)]
    rows += [(2, "dp", 4, "started", "nccl:all_reduce"), (1, "dp", 4, "started", "nccl:all_reduce")]
    rows += [(0, "pp", None, "completed", "nccl:send 0->1"), (0, "pp", None, "started", "nccl:recv 0<-3")]
    fr = _entries(rows)
    t0 = 1_764_000_000_000_000_000
    created = [t0 + 1_000 * i for i in range(fr.height)]
    created[-1] = created[-2] - 15_000  # the receive, recorded last, stamped before the send
    fr = fr.with_columns(pl.Series("time_created_ns", created, dtype=pl.Int64))
    rep = diagnose_hang(fr, _groups({"dp": [0, 1, 2, 3], "pp": [0, 2]}), world_size=4)
    assert rep.culprits == (3,) and 0 in rep.blocked, rep.headline
