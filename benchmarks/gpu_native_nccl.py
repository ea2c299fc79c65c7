"""A torch-native job on one GPU over NCCL, written as a real job writes it (no tracekit on that
machine): FSDP2 ``fully_shard`` on ``init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))``, a
tiny Llama-like MLP stack, ``torch.profiler`` with CUDA activity, torch's own flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``) and a CUDA memory snapshot. Used to check that tracekit reads
what such a job records (issue 28: the same on a single-GPU NCCL run's traces).

    python benchmarks/gpu_native_nccl.py --out DIR        # on a GPU machine; then, anywhere:
    tracekit ingest DIR --store x.duckdb && tracekit stragglers x.duckdb && tracekit hangs x.duckdb
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import shutil
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.SiLU(), torch.nn.Linear(4096, 1024))
              for _ in range(4)]
    model = torch.nn.Sequential(*layers).cuda()
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    sched = torch.profiler.schedule(wait=1, warmup=1, active=args.steps - 2)
    out = args.out
    (out / "traces").mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                schedule=sched, record_shapes=True) as prof:
        for _ in range(args.steps):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss.detach())  # one plain collective per step besides FSDP's
            prof.step()
    torch.cuda.synchronize()
    trace = out / "traces" / "rank0.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    (out / "memory").mkdir(exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(out / "memory" / "rank0.pickle"))
    (out / "fr").mkdir(exist_ok=True)
    c10d = torch._C._distributed_c10d
    dump = (getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace)(True, True, False)
    (out / "fr" / "rank0").write_bytes(dump)
    print("fr entries:", len(pickle.loads(dump).get("entries", [])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
