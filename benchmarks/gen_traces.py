"""Generate realistic NCCL-flavour Kineto traces for ingest benchmarks.

Per rank: ProfilerStep spans; per op a cpu_op with a child aten op, a cudaLaunchKernel, its GPU
kernel and the ac2g flow pair linking them (as the profiler writes them); every few ops a
collective: ``record_param_comms`` on the CPU and an ``ncclDevKernel_*`` kernel with the collective
args, in a tp=2 x dp layout whose groups are in ``distributedInfo.pg_config``. Written in the
profiler's own layout (one event over several lines). About 250 bytes and 1 event per 250 bytes.

    python benchmarks/gen_traces.py OUT_DIR --ranks 8 --events 160000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
from pathlib import Path

BASE_NS = 1_716_000_000_000_000_000
OPS = [("aten::linear", "aten::mm", "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn"),
       ("aten::gelu", "aten::gelu", "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>"),
       ("aten::layer_norm", "aten::native_layer_norm", "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"),
       ("aten::add", "aten::add", "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >")]
COLLS = [("allreduce", "AllReduce_Sum_bf16_RING_LL", "dp"), ("allgather", "AllGather_RING_LL", "tp"),
         ("reduce_scatter", "ReduceScatter_Sum_bf16_RING_LL", "tp")]


def _x(cat: str, name: str, pid: int, tid: int, ts: float, dur: float, args: str) -> str:
    return (f'  {{\n    "ph": "X", "cat": "{cat}", "name": {json.dumps(name)}, "pid": {pid}, "tid": {tid},\n'
            f'    "ts": {ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      {args}\n    }}\n  }}')


def _flow(ph: str, pid: int, tid: int, ts: float, corr: int) -> str:
    bp = "" if ph == "s" else ', "bp": "e"'
    return (f'  {{\n    "ph": "{ph}", "id": {corr}, "pid": {pid}, "tid": {tid}, "ts": {ts:.3f},\n'
            f'    "cat": "ac2g", "name": "ac2g"{bp}\n  }}')


def write_rank(path: Path, rank: int, world: int, n_events: int, seed: int = 0) -> int:
    rnd = random.Random(seed * 1000 + rank)
    pid, tid, stream, comm_stream = 4000 + rank, 4000 + rank, 7, 20
    tp_group = [rank - rank % 2, rank - rank % 2 + 1] if world > 1 else [0]
    dp_group = list(range(rank % 2, world, 2))
    info = {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 3, "nccl_version": "2.21.5",
            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                           "pg_size": world, "ranks": list(range(world))},
                          {"pg_name": "1", "pg_desc": "tp", "backend_config": "cuda:nccl", "pg_size": 2,
                           "ranks": tp_group},
                          {"pg_name": "2", "pg_desc": "dp", "backend_config": "cuda:nccl",
                           "pg_size": len(dp_group), "ranks": dp_group}]}
    head = ('{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {"id": 0, "name": "NVIDIA H100", '
            '"totalGlobalMem": 85000000000, "computeMajor": 9, "computeMinor": 0, "numSms": 132}\n  ],\n'
            f'  "distributedInfo": {json.dumps(info)},\n  "traceEvents": [\n')
    out, written, ts, corr, ext, step = [], 0, 1000.0, 1, 1, 0
    per_step = max(1, n_events // 10)
    step_start = ts
    with open(path, "w") as f:
        f.write(head)
        first = True
        while written < n_events:
            if written // per_step != step:
                out.append(_x("user_annotation", f"ProfilerStep#{step}", pid, tid, step_start, ts - step_start, '"External id": 0'))
                step, step_start = written // per_step, ts
                written += 1
            if rnd.random() < 0.08:
                cname, kname, dim = rnd.choice(COLLS)
                grp, pgn = (tp_group, "1") if dim == "tp" else (dp_group, "2")
                n = rnd.choice([1 << 20, 4 << 20, 16 << 20])
                cargs = (f'"External id": {ext},"Record function id": 0, "Collective name": "{cname}", '
                         f'"In msg nelems": {n}, "Out msg nelems": {n}, "Group size": {len(grp)}, '
                         f'"dtype": "BFloat16", "In split size": "[]", "Out split size": "[]", '
                         f'"Process Group Name": "{pgn}", "Process Group Description": "{dim}", '
                         f'"Process Group Ranks": "{json.dumps(grp)}", "Ev Idx": {ext}')
                out.append(_x("cpu_op", "record_param_comms", pid, tid, ts, 12.0, cargs))
                out.append(_x("cuda_runtime", "cudaLaunchKernel", pid, tid, ts + 2, 4.0,
                              f'"External id": {ext}, "cbid": 211, "correlation": {corr}'))
                out.append(_x("kernel", f"ncclDevKernel_{kname}(ncclDevKernelArgsStorage<4096ul>)", 0, comm_stream,
                              ts + 30, 200 + rnd.random() * 800,
                              f'"External id": {ext}, "queued": 0, "device": 0, "context": 1, "stream": {comm_stream}, '
                              f'"correlation": {corr}, "registers per thread": 96, "shared memory": 87568, '
                              f'"grid": [32, 1, 1], "block": [640, 1, 1], ' + cargs.split(",", 2)[2]))
                out += [_flow("s", pid, tid, ts + 2, corr), _flow("f", 0, comm_stream, ts + 30, corr)]
                written += 6
            else:
                op, child, kern = rnd.choice(OPS)
                dur = 5 + rnd.random() * 40
                out.append(_x("cpu_op", op, pid, tid, ts, dur + 10,
                              f'"External id": {ext},"Record function id": 0, "Sequence number": {ext}, '
                              f'"Fwd thread id": 0, "Ev Idx": {ext}, "Input Dims": [[8, 4096, 4096], [4096, 4096]], '
                              '"Input type": ["c10::BFloat16", "c10::BFloat16"]'))
                out.append(_x("cpu_op", child, pid, tid, ts + 1, dur + 5,
                              f'"External id": {ext + 1},"Record function id": 0, "Ev Idx": {ext + 1}'))
                out.append(_x("cuda_runtime", "cudaLaunchKernel", pid, tid, ts + 3, 4.0,
                              f'"External id": {ext + 1}, "cbid": 211, "correlation": {corr}'))
                out.append(_x("kernel", kern, 0, stream, ts + 20, dur * 3,
                              f'"External id": {ext + 1}, "queued": 0, "device": 0, "context": 1, "stream": {stream}, '
                              f'"correlation": {corr}, "registers per thread": 168, "shared memory": 98304, '
                              '"blocks per SM": 1.5, "warps per SM": 12.0, "grid": [132, 1, 1], "block": [256, 1, 1], '
                              '"est. achieved occupancy %": 18'))
                out += [_flow("s", pid, tid, ts + 3, corr), _flow("f", 0, stream, ts + 20, corr)]
                written += 6
            ts += 60 + rnd.random() * 20
            corr += 1
            ext += 2
            if len(out) > 5000:
                f.write(("" if first else ",\n") + ",\n".join(out))
                first, out = False, []
        out.append(_x("user_annotation", f"ProfilerStep#{step}", pid, tid, step_start, ts - step_start, '"External id": 0'))
        f.write(("" if first else ",\n") + ",\n".join(out))
        f.write('\n  ],\n  "traceName": "rank%d.json",\n  "displayTimeUnit": "ms",\n'
                '  "baseTimeNanoseconds": %d\n}\n' % (rank, BASE_NS))
    return written + 1


def generate(out: Path, ranks: int, events: int, jobs: int = 1) -> list[Path]:
    """Write (or reuse, when already complete) rank<R>.json for ``ranks`` ranks under ``out``, in
    ``jobs`` processes (each rank's content depends only on its rank, so the files are the same)."""
    out.mkdir(parents=True, exist_ok=True)
    done = out / f".complete-{ranks}x{events}"
    paths = [out / f"rank{r}.json" for r in range(ranks)]
    if done.exists() and all(p.exists() for p in paths):
        return paths
    work = [(p, r, ranks, events) for r, p in enumerate(paths)]
    if jobs > 1:
        with multiprocessing.Pool(min(jobs, ranks)) as pool:
            pool.starmap(write_rank, work, chunksize=1)
    else:
        for job in work:
            write_rank(*job)
    done.touch()
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=160_000)
    a = ap.parse_args()
    ps = generate(a.out, a.ranks, a.events)
    print(f"{len(ps)} traces, {sum(p.stat().st_size for p in ps) / 1e6:.0f} MB in {a.out}")
