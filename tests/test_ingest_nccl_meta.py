"""NCCL collective sequence numbers and p2p peers, where the trace's own metadata allows them.

The traces are written in the profiler's layout (tests/_traces.py): a tp x dp job whose kernels carry
no ``Seq``, kernels whose metadata lives only on the ``record_param_comms`` op that launched them
(same ``External id``), and p2p kernels (``ncclDevKernel_SendRecv``) whose peer comes from ``Dst
Rank``/``Src Rank``, from the group-local ``Rank``, or from a two-rank group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import tracekit
from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
from _traces import BASE_NS, write_trace  # noqa: E402

TP = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
DP = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}


class Trace:
    """A rank's trace under construction; times in microseconds."""

    def __init__(self, rank: int, world: int = 4) -> None:
        self.rank, self.world, self.ext, self.ev = rank, world, 1000, []

    def step(self, n: int, t0: float, dur: float) -> None:
        self.ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 10, "tid": 1,
                        "ts": t0, "dur": dur, "args": {}})

    def comm(self, t: float, coll: str, pg: str, ranks: list[int], kernel: str, stream: int, *,
             on_kernel: bool = True, rpc_args: dict | None = None, nelems: int = 256) -> None:
        """A record_param_comms op launching an NCCL kernel; the metadata goes on the kernel (as
        real NCCL traces have it) unless ``on_kernel`` is False (then only the CPU op has it)."""
        self.ext += 1
        meta = {"Collective name": coll, "Process Group Name": pg, "Process Group Ranks": json.dumps(ranks),
                "In msg nelems": nelems, "Out msg nelems": nelems, "dtype": "Float", "Group size": len(ranks)}
        self.ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 10, "tid": 1, "ts": t,
                        "dur": 5.0, "args": {"External id": self.ext, **meta, **(rpc_args or {})}})
        self.ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": 1,
                        "ts": t + 1, "dur": 2.0, "args": {"External id": self.ext, "correlation": self.ext}})
        kargs = {"External id": self.ext, "correlation": self.ext, "stream": stream}
        self.ev.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{kernel}(ncclDevKernelArgsStorage<4096ul>)",
                        "pid": 0, "tid": stream, "ts": t + 10 + self.rank, "dur": 40.0 + self.rank,
                        "args": {**kargs, **(meta if on_kernel else {})}})

    def doc(self) -> dict:
        pgs = [{"pg_name": "tp", "pg_desc": "tp", "ranks": TP[self.rank]},
               {"pg_name": "dp", "pg_desc": "dp", "ranks": DP[self.rank]}]
        return {"schemaVersion": 1,
                "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": self.world, "pg_config": pgs},
                "traceEvents": self.ev, "baseTimeNanoseconds": BASE_NS}


def _two_group_trace(rank: int) -> dict:
    """One op before the first step, then 2 steps; tp and dp ops interleave differently per rank
    (dp first on odd ranks), as independent groups may."""
    t = Trace(rank)
    t.comm(10.0, "allreduce", "tp", TP[rank], "AllReduce_Sum_f32_RING_LL", 20)  # before any step
    for s in range(2):
        t0 = 1000.0 + 1000 * s
        t.step(s, t0, 900.0)
        ops = [("allgather", "tp", "AllGather_RING_LL", 20), ("allreduce", "dp", "AllReduce_Sum_f32_RING_LL", 21),
               ("reduce_scatter", "tp", "ReduceScatter_Sum_f32_RING_LL", 20)]
        if rank % 2:
            ops = [ops[1], ops[0], ops[2]]
        for i, (coll, pg, kern, stream) in enumerate(ops):
            ranks = TP[rank] if pg == "tp" else DP[rank]
            t.comm(t0 + 50 + 200 * i, coll, pg, ranks, kern, stream, on_kernel=(s == 0))
    return t.doc()


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("nccl2g")
    for r in range(4):
        write_trace(d / "run" / f"rank{r}.json.gz", _two_group_trace(r))
    rep = ingest([d / "run"], d / "s.duckdb")
    assert len(rep.ok) == 4 and not rep.failed, [f.error for f in rep.failed]
    return d / "s.duckdb"


def test_seq_counts_per_group_from_the_first_step(two_groups: Path) -> None:
    with tracekit.open(two_groups) as s:
        rows = s.sql("SELECT rank, pg_name, list(seq ORDER BY start_ns) AS seqs, list(op ORDER BY start_ns) AS ops "
                     "FROM collectives GROUP BY ALL ORDER BY ALL").rows()
    tp_ops = ["all_reduce", "all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    for rank, pg, seqs, ops in rows:
        if pg == "tp":  # the op before the first step is -1 on every rank
            assert (seqs, ops) == ([-1, 0, 1, 2, 3], tp_ops), (rank, seqs, ops)
        else:
            assert (pg, seqs, ops) == ("dp", [0, 1], ["all_reduce", "all_reduce"]), (rank, seqs, ops)


def test_seq_matches_the_same_op_on_every_member(two_groups: Path) -> None:
    """Every (group, seq) instance is one op with one size on all members of the group."""
    with tracekit.open(two_groups) as s:
        inst = s.sql("SELECT pg_name, seq, list(DISTINCT op) AS ops, count(*) AS n, list(rank ORDER BY rank) AS r "
                     "FROM collectives GROUP BY pg_name, seq, "
                     "CASE WHEN pg_name = 'tp' THEN rank // 2 ELSE rank % 2 END ORDER BY ALL").rows()
    assert len(inst) == 2 * 5 + 2 * 2
    for pg, seq, ops, n, ranks in inst:
        assert len(ops) == 1 and n == 2, (pg, seq, ops, ranks)


def test_metadata_of_the_launching_cpu_op_fills_bare_kernels(two_groups: Path) -> None:
    """Step 1's kernels have no args: group, op and size come from their record_param_comms."""
    with tracekit.open(two_groups) as s:
        step1 = s.sql("SELECT pg_name, op, nbytes, dtype FROM collectives WHERE rank = 1 AND step = 1 "
                      "ORDER BY start_ns").rows()
    assert step1 == [("dp", "all_reduce", 1024, "Float"), ("tp", "all_gather", 1024, "Float"),
                     ("tp", "reduce_scatter", 1024, "Float")]


def _p2p_trace(rank: int) -> dict:
    """Ranks 0 and 2 exchange over the 4-rank 'world' group (peer from Dst/Src Rank, then from the
    group-local Rank), and over the two-rank dp group with no rank args at all; torch's Seq given
    only for the first exchange."""
    t = Trace(rank)
    t.step(0, 0.0, 10_000.0)
    world, me_send = [0, 1, 2, 3], rank == 0
    peer = 2 if rank == 0 else 0
    first, second = ("send", "recv") if me_send else ("recv", "send")
    t.comm(100.0, first, "world", world, "SendRecv", 30, on_kernel=False,
           rpc_args={"Dst Rank" if first == "send" else "Src Rank": peer, "Seq": 7})
    t.comm(300.0, second, "world", world, "SendRecv", 30, on_kernel=False, rpc_args={"Rank": peer})
    for i in range(2):
        t.comm(500.0 + 200 * i, first, "dp", DP[rank], "SendRecv", 31, on_kernel=False)
    t.ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                 "pid": 0, "tid": 32, "ts": 2000.0, "dur": 5.0, "args": {"correlation": 1, "stream": 32}})
    return t.doc()


def test_p2p_peers_directions_and_seq(tmp_path: Path) -> None:
    for r in (0, 2):
        write_trace(tmp_path / "run" / f"rank{r}.json.gz", _p2p_trace(r))
    rep = ingest([tmp_path / "run"], tmp_path / "s.duckdb")
    assert len(rep.ok) == 2, [f.error for f in rep.failed]
    with tracekit.open(tmp_path / "s.duckdb") as s:
        rows = s.sql("SELECT rank, peer, direction, pg_name, seq, nbytes FROM p2p ORDER BY rank, start_ns").rows()
    assert rows == [
        (0, 2, "send", "world", 7, 1024), (0, 2, "recv", "world", 0, 1024),  # Dst Rank; Rank=2 through the group
        (0, 2, "send", "dp", 0, 1024), (0, 2, "send", "dp", 1, 1024),  # two-rank group: the other member
        (0, None, None, None, 0, None),  # a bare SendRecv kernel: nothing to go on
        (2, 0, "recv", "world", 7, 1024), (2, 0, "send", "world", 0, 1024),
        (2, 0, "recv", "dp", 0, 1024), (2, 0, "recv", "dp", 1, 1024),
        (2, None, None, None, 0, None),
    ]
