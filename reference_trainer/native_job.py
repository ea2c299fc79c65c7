"""A torch-native 3D-parallel job that tracekit did not write: the kind users bring.

Tiny Llama-like model; FSDP2 ``fully_shard`` over dp, DTensor tensor + sequence parallel
(``parallelize_module``) over tp, ``torch.distributed.pipelining`` (GPipe) over pp, all on
``init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))`` with gloo. Profiled
with plain ``torch.profiler`` (no tracekit annotations): ``<out>/traces/rank<R>.json.gz``. torch's
own flight recorder is dumped to ``<out>/fr/rank<R>`` with ``pg_config`` rebuilt from Python (gloo
writes it empty, FORMATS.md section 2). ``<out>/manifest.json`` holds the layout and ground truth
in the trainer's schema.

A slow rank (``--slow-rank R --slow-factor F``) stretches every aten op it runs, forward and
backward, to F times its own duration by spinning after it (a dispatch mode, on every rank), so
the slowdown lies inside its compute ops as a slow device's would; communication ops are left alone.

    python -m reference_trainer.native_job --dp 2 --pp 2 --tp 2 --steps 4 --out DIR \
        [--slow-rank R --slow-factor 1.5] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

DIM, HEADS, FFN, VOCAB, SEQ, BATCH, LAYERS_PER_STAGE, MICROBATCHES = 32, 4, 64, 64, 8, 4, 2, 2
FR_BUFFER = "2000"


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = DIM // HEADS  # local heads = -1: the tp shard of the heads
        q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first, the norm and head on the last."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS_PER_STAGE)})
        self.norm = RMSNorm(DIM) if last else None
        self.output = nn.Linear(DIM, VOCAB, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def apply_tp(stage: Stage, tp_mesh) -> None:
    """Megatron-style TP with sequence parallelism (torchtitan's plan): activations between blocks
    are sharded along the sequence; the stage boundary carries the local sequence shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    top = {}
    if stage.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if top:
        parallelize_module(stage, tp_mesh, top)
    for block in stage.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


class SlowOps(TorchDispatchMode):
    """Stretch every aten op to ``factor`` times its duration by spinning after it (a sleep
    overshoots tens of microseconds, longer than these ops); communication ops run untouched.

    Every rank runs under the mode (factor 1: no spin), so that its own cost per op, large beside
    the tiny ops of this model, is paid alike everywhere and the traces have the same events; the
    slow rank spins ``factor - 1`` times each op's duration including that cost, measured once on
    a block's forward and backward."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.extra, self.overhead, self.ops = 0.0, 0.0, 0
        if factor != 1.0:
            self.overhead = self._own_overhead()
        self.extra = factor - 1.0

    def _own_overhead(self) -> float:
        block, x = Block(), torch.randn(BATCH, SEQ, DIM, requires_grad=True)

        def once() -> float:
            t0 = time.perf_counter()
            block(x).sum().backward()
            return time.perf_counter() - t0
        once()
        plain = min(once() for _ in range(5))
        self.ops = 0
        with self:
            moded = min(once() for _ in range(5))
        return max(0.0, (moded - plain) / max(1, self.ops / 5))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "aten":
            return func(*args, **(kwargs or {}))
        self.ops += 1
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if self.extra > 0:
            t1 = time.perf_counter()
            until = t1 + self.extra * (t1 - t0 + self.overhead)
            while time.perf_counter() < until:
                pass
        return out


def _fr_dump(out: Path, rank: int) -> None:
    """torch's recorder, with the pg_config gloo leaves empty rebuilt from the live groups."""
    from torch.distributed.distributed_c10d import _get_process_group_name, _world
    raw = torch._C._distributed_c10d._dump_fr_trace(True, True, False)
    dump = pickle.loads(raw)
    groups = {}
    for pg in _world.pg_map:
        name = _get_process_group_name(pg)
        groups[name] = {"name": name, "desc": getattr(pg, "group_desc", "") or "",
                        "ranks": str(dist.get_process_group_ranks(pg))}
    dump["pg_config"] = groups
    (out / "fr").mkdir(parents=True, exist_ok=True)
    (out / "fr" / f"rank{rank}").write_bytes(pickle.dumps(dump))


def _worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      TORCH_FR_BUFFER_SIZE=FR_BUFFER)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _train(rank, args)
    finally:
        dist.destroy_process_group()


def _train(rank: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    out = Path(args.out)
    mesh = init_device_mesh("cpu", (args.dp, args.pp, args.tp), mesh_dim_names=("dp", "pp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(args.seed)  # same weights everywhere before sharding
    model = Stage(first=pp_rank == 0, last=pp_rank == args.pp - 1)
    if args.tp > 1:
        apply_tp(model, mesh["tp"])
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # each dp replica its own data; tp and pp peers the same
    gen = torch.Generator().manual_seed(args.seed * 1000 + mesh["dp"].get_local_rank())

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    schedule = None
    if args.pp > 1:
        stage = PipelineStage(model, pp_rank, args.pp, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    stretch = SlowOps(args.slow_factor if rank == args.slow_rank else 1.0)
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import schedule as profiler_schedule
    # one warm-up step (the pipeline's shape exchange, first-call setup) outside the trace; the
    # schedule is what makes the profiler write ProfilerStep#N spans, the steps of the trace
    sched = profiler_schedule(wait=0, warmup=1, active=args.steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, schedule=sched) as prof:
        for _ in range(args.steps + 1):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            target = torch.roll(tokens, -1, dims=1)
            stretch.__enter__()
            try:
                if schedule is None:
                    loss_fn(model(tokens), target).backward()
                elif pp_rank == 0:
                    schedule.step(tokens)
                elif pp_rank == args.pp - 1:
                    schedule.step(target=target)
                else:
                    schedule.step()
            finally:
                stretch.__exit__(None, None, None)
            opt.step()
            opt.zero_grad()
            prof.step()
    (out / "traces").mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "traces" / f"rank{rank}.json.gz"))
    _fr_dump(out, rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manifest(args: argparse.Namespace, pids: list[int]) -> dict:
    world = args.dp * args.pp * args.tp
    faults = []
    if args.slow_rank is not None:
        faults.append({"kind": "slow", "spec": f"slow:rank={args.slow_rank},factor={args.slow_factor}",
                       "ranks": [args.slow_rank], "steps": list(range(1, args.steps + 1)),
                       "magnitude": {"compute_factor": args.slow_factor}})
    return {"job": "native_job", "layout": {"tp": args.tp, "cp": 1, "pp": args.pp, "dp": args.dp},
            "world_size": world, "backend": "gloo", "torch_version": torch.__version__,
            "hosts": [socket.gethostname()] * world, "pids": pids, "seed": args.seed, "steps": args.steps,
            "faults": faults, "argv": sys.argv}


def run(args: argparse.Namespace) -> dict:
    """Spawn the world, train, write traces, FR dumps and the manifest; return the manifest."""
    world = args.dp * args.pp * args.tp
    if args.slow_rank is not None and not 0 <= args.slow_rank < world:
        raise SystemExit(f"--slow-rank {args.slow_rank} outside the world of {world}")
    from reference_trainer.launch import start_method  # forks where it can, as the trainer's worlds do

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_worker, args=(world, args, _free_port()), nprocs=world, join=False,
                             start_method=start_method("gloo"))
    pids = list(ctx.pids())
    while not ctx.join():
        pass
    m = manifest(args, pids)
    (out / "manifest.json").write_text(json.dumps(m, indent=1))
    return m


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m reference_trainer.native_job", description=__doc__.split("\n")[0])
    for d in ("dp", "pp", "tp"):
        p.add_argument(f"--{d}", type=int, default=2, choices=(1, 2, 4))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-factor", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
