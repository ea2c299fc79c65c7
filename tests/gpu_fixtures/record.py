"""Record real NCCL/CUDA artifacts on a machine with a GPU, for the tests that read them back.

    python tests/gpu_fixtures/record.py OUT_DIR

One process, one GPU, an NCCL process group of world size 1 (NCCL refuses two ranks on one GPU),
a small bf16 model trained for a few steps with data-parallel-style collectives. It writes what
a real job writes, by torch's own functions:

- ``rank0.json.gz``: ``torch.profiler`` Chrome trace (CPU + CUDA activity), with
  ``distributedInfo``, ``record_param_comms`` and NCCL's kernels where NCCL launches any;
- ``fr_rank0.pkl`` and ``<OUT>_fr_json/fr_rank0.json``: ProcessGroupNCCL's flight recorder
  (``TORCH_NCCL_TRACE_BUFFER_SIZE``), pickle and JSON, with timing (``TORCH_NCCL_ENABLE_TIMING``),
  in two folders since both name rank 0;
- ``snapshot_rank0.pickle``: ``torch.cuda.memory._dump_snapshot`` of the profiled steps (Python
  and C++ frames, torch's default ``stacks="all"``);
- ``provenance.json``: torch, CUDA, NCCL and GPU versions, and what failed, if anything.

Each part is tried on its own, so that one failure still leaves the others. The tests that use
the recorded files are in tests/test_ingest_gpu_fixtures.py; the files are in tests/gpu_fixtures/
(README.md there says how they were made).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function, schedule  # noqa: E402

STEPS = 6
PROFILED = schedule(wait=1, warmup=1, active=3, repeat=1)  # steps 2-4


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def train(out: Path, notes: dict) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    half = dist.new_group([0], group_desc="dp_shard")  # a second group, so pg_config has two
    model = torch.nn.Sequential(*[Block(256) for _ in range(4)]).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=dev, dtype=torch.float32)
    gathered = torch.empty(flat.numel(), device=dev, dtype=torch.float32)

    def step() -> None:
        x = torch.randn(8, 128, 256, device=dev, dtype=torch.bfloat16)
        with record_function("forward"):
            loss = model(x).float().pow(2).mean()
        with record_function("backward"):
            loss.backward()
        with record_function("grad_sync"):
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            torch.cat([p.grad.float().flatten() for p in model.parameters()], out=flat)
            shard = torch.empty_like(flat)
            dist.reduce_scatter_tensor(shard, flat, group=half)
            dist.all_gather_into_tensor(gathered, shard, group=half)
            dist.broadcast(flat, src=0)
            dist.all_to_all_single(torch.empty_like(flat), flat)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()

    torch.cuda.memory._record_memory_history(max_entries=100_000)  # torch's defaults: context and stacks "all"
    traces: list[Path] = []

    def save(prof) -> None:
        path = out / "rank0.json"
        prof.export_chrome_trace(str(path))
        traces.append(path)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=PROFILED,
                 on_trace_ready=save, record_shapes=True) as prof:
        for _ in range(STEPS):
            step()
            prof.step()
    torch.cuda.synchronize()
    try:
        torch.cuda.memory._dump_snapshot(str(out / "snapshot_rank0.pickle"))
    except Exception:
        notes["failed"]["snapshot"] = traceback.format_exc()
    torch.cuda.memory._record_memory_history(enabled=None)
    for path in traces:
        with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
    c10d = torch._C._distributed_c10d
    for name, fn, kwargs in [
        ("fr_rank0.pkl", "_dump_nccl_trace", dict(includeCollectives=True, includeStackTraces=True, onlyActive=False)),
        (f"../{out.name}_fr_json/fr_rank0.json", "_dump_nccl_trace_json",
         dict(includeCollectives=True, onlyActive=False)),
    ]:
        try:
            data = getattr(c10d, fn)(**kwargs)
            (out / name).parent.mkdir(exist_ok=True)
            (out / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        except Exception:
            notes["failed"][name] = traceback.format_exc()
    dist.destroy_process_group()


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    notes: dict = {"failed": {}, "torch": torch.__version__, "cuda": torch.version.cuda,
                   "env": {k: os.environ[k] for k in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ENABLE_TIMING")}}
    try:
        notes["gpu"] = torch.cuda.get_device_name(0)
        notes["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        train(out, notes)
    except Exception:
        notes["failed"]["train"] = traceback.format_exc()
    (out / "provenance.json").write_text(json.dumps(notes, indent=1))
    print(json.dumps(notes, indent=1))
    sys.exit(1 if notes["failed"] else 0)


if __name__ == "__main__":
    main()
