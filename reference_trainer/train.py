"""The per-rank training loop: data -> pipeline schedule -> ZeRO reduction and AdamW -> metrics.

``Trainer.train_step`` is one optimizer step, so callers can wrap steps in ``torch.profiler``
(and call ``prof.step()`` between them) without touching the loop.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from .activations import ActivationRecorder
from .comm import Comm
from .compute import ComputeSpans
from .config import TrainConfig
from .context_parallel import batch_shard_positions, document_causal_mask
from .data import Corpus, document_ids
from .data_parallel import ShardedOptimizer
from .model import DTYPES, MicroBatch, Stage, stage_specs
from .parallel_state import ParallelContext, build_context
from .pipeline import PipelineRunner, build_schedule


@dataclass
class StepResult:
    step: int
    loss: float
    seconds: float


class Trainer:
    def __init__(self, cfg: TrainConfig, comm: Comm):
        self.cfg = cfg.validate()
        self.ctx: ParallelContext = build_context(cfg.layout, comm)
        c, pp_rank = self.cfg, self.ctx.coords.pp
        dtype = DTYPES[c.compute_dtype]
        self.stages = {vs: Stage(c, self.ctx, vs, dtype).to(comm.device)
                       for vs in (k * c.pp + pp_rank for k in range(c.vstages))}
        self.optimizer = ShardedOptimizer(self.stages, c, self.ctx)
        self.schedule = build_schedule(c.pp, c.vstages, c.micro_batches, c.n_consecutive, c.schedule)[pp_rank]
        self.spans = ComputeSpans()  # add ComputeHooks here (timing, slow-rank injection)
        act_shape = (c.micro_batch_size, c.seq_len // (c.cp * c.tp), c.dim)
        self.runner = PipelineRunner(self.ctx, self.stages, self.schedule, act_shape, dtype,
                                     c.micro_batches, self.spans, on_backward=self.optimizer.after_backward)
        self.corpus = Corpus(c)
        self.step_index = 0
        self.data_hashes: dict[str, str] = {}  # this step's micro-batches, for the numerics check
        self.recorder = ActivationRecorder() if c.record_activations else None
        for stage in self.stages.values():
            stage.recorder = self.recorder

    def micro_batch(self, index: int, tokens: torch.Tensor) -> MicroBatch:
        """This rank's view of one micro-batch [b, S+1]: its CP positions, targets and mask."""
        c, dev = self.cfg, self.ctx.comm.device
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        doc = document_ids(inputs, c.eos_id)
        pos = batch_shard_positions(doc, c.cp, c.cp_sharding)  # [b, cp, S/cp]
        q_pos = pos[:, self.ctx.coords.cp]
        if self.recorder is not None:
            self.recorder.record_positions(index, q_pos)
        k_pos = pos.reshape(pos.shape[0], -1)  # the order in which K/V are all-gathered
        return MicroBatch(index=index, tokens=torch.gather(inputs, 1, q_pos).to(dev),
                          targets=torch.gather(targets, 1, q_pos).to(dev), positions=q_pos.to(dev),
                          mask=document_causal_mask(q_pos, k_pos, doc).to(dev))

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        if self.recorder is not None:
            self.recorder.clear()
        tokens = self.corpus.micro_batches(self.step_index, self.ctx.coords.dp)
        mbs = [self.micro_batch(i, t) for i, t in enumerate(tokens)]
        if self.cfg.dump_state:
            xy = self.ctx.coords  # sha256 of the int64 ids: the check compares its own batches with these
            self.data_hashes = {f"dp{xy.dp}/cp{xy.cp}/tp{xy.tp}/pp{xy.pp}/mb{i}": hashlib.sha256(
                t.to(torch.int64).contiguous().numpy().tobytes()).hexdigest() for i, t in enumerate(tokens)}
        local_loss = self.runner.run(mbs)
        with self.spans.span("opt"):
            self.optimizer.step()
        comm = self.ctx.comm
        # the loss lives on the last stage: sum over DP x CP (token shares), then over PP (zeros)
        loss = comm.all_reduce(comm.all_reduce(local_loss, self.ctx.dp_cp), self.ctx.pp)
        result = StepResult(self.step_index, float(loss), time.perf_counter() - t0)
        self.step_index += 1
        return result

    def full_state(self, loss: float) -> dict | None:
        """Unsharded loss, reduced gradients and updated fp32 parameters by canonical name,
        returned on global rank 0 (None elsewhere). Collective: every rank must call it.
        With ``record_activations`` also ``activations`` (every rank's shard per point and
        micro-batch, ``activations.shard_key``) and ``positions`` (the global positions each CP rank
        held), left sharded: the numerics check reassembles them from its own plan."""
        grads, params = self.optimizer.local_state()
        comm, xy = self.ctx.comm, self.ctx.coords
        records = ({}, {}) if self.recorder is None else self.recorder.export(xy.dp, xy.cp, xy.tp)
        parts = comm.gather_object((xy.as_dict(), grads, params, *records, self.data_hashes), comm.world)
        if parts is None:
            return None
        c = self.cfg
        specs = {s.name: s for vs in range(c.n_vstages_total) for s in stage_specs(c, vs)}
        owners = sorted((p for p in parts if p[0]["dp"] == 0 and p[0]["cp"] == 0), key=lambda p: p[0]["tp"])
        out: dict = {"loss": loss, "grads": {}, "params": {},
                     "data_hashes": {k: v for p in parts for k, v in p[5].items()}}
        for key, idx in (("grads", 1), ("params", 2)):
            for name, spec in specs.items():
                shards = [p[idx][name] for p in owners if name in p[idx]]
                out[key][name] = shards[0] if spec.tp_dim is None else torch.cat(shards, spec.tp_dim)
        if self.recorder is not None:
            out["activations"] = {k: v for p in parts for k, v in p[3].items()}
            out["positions"] = {k: v for p in parts for k, v in p[4].items()}
        return out


def run_training(cfg: TrainConfig, comm: Comm, out: Path | None,
                 on_step: Callable[[StepResult], None] | None = None,
                 setup: Callable[[Trainer], None] | None = None) -> tuple[list[StepResult], list[dict]]:
    """The loop shared by every rank and by the single-process reference. Rank 0 appends each
    step to ``<out>/steps.jsonl`` as it finishes (progress, partial runs) and writes
    ``<out>/metrics.json`` at the end; ``<out>/state/step<k>.pt`` when ``dump_state``.
    ``setup`` sees the Trainer before the first step (to add comm or compute hooks)."""
    trainer = Trainer(cfg, comm)
    if setup is not None:
        setup(trainer)
    results, states = [], []
    for _ in range(cfg.steps):
        r = trainer.train_step()
        results.append(r)
        if comm.rank == 0 and out is not None:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "steps.jsonl", "a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
        if on_step is not None:
            on_step(r)
        if cfg.dump_state:
            state = trainer.full_state(r.loss)
            if state is not None:
                states.append(state)
                if out is not None:
                    (out / "state").mkdir(parents=True, exist_ok=True)
                    torch.save(state, out / "state" / f"step{r.step}.pt")
    comm.wait_sends()
    if comm.rank == 0 and out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps({"steps": [asdict(r) for r in results]}, indent=1))
    return results, states


def run_single_process(cfg: TrainConfig, out: Path | None = None) -> tuple[list[StepResult], list[dict]]:
    """Train ``cfg`` in this process with every parallel size 1 (no process groups at all)."""
    if cfg.world_size != 1:
        raise ValueError(f"run_single_process needs a 1-rank config, got layout {cfg.layout}")
    torch.set_num_threads(1)
    return run_training(cfg, Comm.single(cfg.reduce_order), out)


def rank_main(rank: int, world_size: int, jobs: list[tuple[dict, str]], init_method: str) -> None:
    """Entry point of one spawned rank: runs each (config, out dir) job in turn on one world
    (every job needs the same world size; each builds its own process groups)."""
    torch.set_num_threads(1)
    cfgs = [TrainConfig.from_dict(c) for c, _ in jobs]
    first = cfgs[0]
    use_cuda = first.backend == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    comm = Comm.init_world(first.backend, rank, world_size, init_method, first.timeout_s,
                           first.reduce_order, device)
    try:
        for cfg, (_, out) in zip(cfgs, jobs):
            comm.reduce_order = cfg.reduce_order
            from .observe import observed_training  # (observe imports this module)
            observed_training(cfg, comm, Path(out))
    except BaseException:
        comm.shutdown(sync=False)  # the others may never reach a barrier
        raise
    comm.shutdown()
