"""Small NCCL-flavour Kineto traces written in the profiler's own layout, for ingest tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

BASE_NS = 1_700_000_000_000_000_000


def nccl_trace(rank: int, world: int = 2, steps: int = 2, with_info: bool = True) -> dict:
    """A 2-step trace: per step a matmul kernel, an all_reduce (record_param_comms + ncclDevKernel)."""
    ev: list[dict] = [{"ph": "M", "name": "process_name", "pid": 100 + rank, "tid": 0, "args": {"name": "python"}},
                      {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                       "tid": "PyTorch Profiler", "ts": 0.0, "dur": 1e6}]
    ranks = list(range(world))
    for s in range(steps):
        t0 = 1000.0 * s * 10
        corr = 10 * s
        ev += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 100 + rank, "tid": 7,
             "ts": t0, "dur": 9000.0, "args": {}},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 100 + rank, "tid": 7, "ts": t0 + 10,
             "dur": 50.5, "args": {"External id": corr}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100 + rank, "tid": 7,
             "ts": t0 + 20, "dur": 5.0, "args": {"correlation": corr + 1}},
            {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7,
             "ts": t0 + 30, "dur": 1234.567, "args": {"correlation": corr + 1, "stream": 7}},
            {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 100 + rank, "tid": 7,
             "ts": t0 + 100, "dur": 20.0,
             "args": {"Collective name": "allreduce", "Process Group Name": "0",
                      "Process Group Description": "default_pg", "Process Group Ranks": json.dumps(ranks),
                      "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float", "Group size": world}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100 + rank, "tid": 7,
             "ts": t0 + 110, "dur": 5.0, "args": {"correlation": corr + 2}},
            {"ph": "X", "cat": "kernel",
             "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "pid": 0,
             "tid": 20, "ts": t0 + 2000 + 100 * rank, "dur": 500.0 - 100 * rank,
             "args": {"correlation": corr + 2, "stream": 20, "Collective name": "allreduce",
                      "Process Group Name": "0", "Process Group Ranks": json.dumps(ranks),
                      "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float"}},
        ]
    out: dict = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "GPU"}]}
    if with_info:
        out["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world,
                                  "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "ranks": ranks}]}
    out["traceEvents"] = ev
    out["traceName"] = f"rank{rank}.json"
    out["displayTimeUnit"] = "ms"
    out["baseTimeNanoseconds"] = BASE_NS
    return out


def kineto_bytes(trace: dict) -> bytes:
    """Serialized like the profiler does: one event per line inside the array."""
    head = {k: v for k, v in trace.items() if k != "traceEvents"}
    lines = ",\n".join("  " + json.dumps(e) for e in trace["traceEvents"])
    keys = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items())
    return ("{" + keys + ', "traceEvents": [\n' + lines + "\n]}\n").encode()


def write_trace(path: Path, trace: dict, gz: bool = True) -> Path:
    data = kineto_bytes(trace)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path
