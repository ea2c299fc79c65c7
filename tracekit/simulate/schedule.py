"""The pipeline schedule (interleaved 1F1B, Llama 3 style) and the process groups of the job.

Interleaved 1F1B with V virtual stages per rank and M micro-batches: stage p holds the model
chunks c = v * PP + p (v < V). Forwards of N = min(PP, M) consecutive micro-batches run per chunk
before moving to the next chunk (Llama 3 makes N tunable so that any M works); backwards go through
the chunks in reverse. Warm-up forwards: (PP - p - 1) * 2 + (V - 1) * N as Megatron-LM's
interleaved schedule (plain 1F1B, V = 1: PP - p - 1), then one forward one backward, then the
remaining backwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracekit.simulate.config import SimConfig
from tracekit.topology import Layout

MESH_ORDER = ("dp", "pp", "cp", "tp")  # init_device_mesh(..., mesh_dim_names=("dp", "pp", "cp", "tp"))
PLAIN_DESCS = ({"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp"},
               {"tp": "tensor_model_parallel", "cp": "context_parallel", "pp": "pipeline_model_parallel",
                "dp": "data_parallel"},
               {"tp": "undefined", "cp": "undefined", "pp": "undefined", "dp": "undefined"})


@dataclass(frozen=True)
class Unit:
    phase: str  # "F" or "B"
    vstage: int  # v < V
    mb: int

    def chunk(self, pp: int, stage: int) -> int:
        return self.vstage * pp + stage


def stage_order(stage: int, pp: int, vstages: int, microbatches: int) -> list[Unit]:
    """The order in which ``stage`` runs its forward and backward units in one step."""
    n = min(pp, microbatches)
    groups = [range(g, min(g + n, microbatches)) for g in range(0, microbatches, n)]
    fwd = [Unit("F", v, m) for g in groups for v in range(vstages) for m in g]
    bwd = [Unit("B", v, m) for g in groups for v in reversed(range(vstages)) for m in g]
    total = len(fwd)
    if vstages == 1:
        warmup = min(pp - stage - 1, total)
    else:
        warmup = min((pp - stage - 1) * 2 + (vstages - 1) * n, total)
    order = fwd[:warmup]
    f, b = warmup, 0
    while f < total:
        order += [fwd[f], bwd[b]]
        f, b = f + 1, b + 1
    return order + bwd[b:]


def schedule_names(cfg: SimConfig) -> list[list[str]]:
    """The manifest's ``pipeline_schedule``: per stage, 'F<chunk>.<mb>' / 'B<chunk>.<mb>'."""
    return [[f"{u.phase}{u.chunk(cfg.pp, p)}.{u.mb}" for u in stage_order(p, cfg.pp, cfg.vstages, cfg.n_microbatches)]
            for p in range(cfg.pp)]


@dataclass(frozen=True)
class Group:
    name: str  # torch's pg_name: "0" for the world, then one number per group created
    desc: str
    dim: str  # world, tp, cp, pp, dp
    ranks: tuple[int, ...]


class Groups:
    """Every process group, named as torch names them (one counter over all ``new_group`` calls,
    which every rank makes for every group, member or not), described per ``cfg.names``."""

    def __init__(self, cfg: SimConfig) -> None:
        lay: Layout = cfg.layout
        self.flavour = cfg.seed % 3 if cfg.names == "plain" else None
        world = Group("0", "default_pg", "world", tuple(range(cfg.world_size)))
        self.all = [world]
        self.of: dict[tuple[str, int], Group] = {("world", r): world for r in range(cfg.world_size)}
        for dim in MESH_ORDER:
            if cfg.names == "plain" and getattr(lay, dim) == 1:
                continue  # hand-made groups: only the dimensions that exist
            for ranks in lay.groups(dim):
                g = Group(str(len(self.all)), self.describe(cfg, dim), dim, tuple(ranks))
                self.all.append(g)
                for r in ranks:
                    self.of[(dim, r)] = g

    def describe(self, cfg: SimConfig, dim: str) -> str:
        if cfg.names == "mesh":
            return f"mesh_{dim}"
        if cfg.names == "plain":
            return PLAIN_DESCS[self.flavour][dim]
        return "undefined"

    def member_of(self, rank: int) -> list[Group]:
        return [g for g in self.all if rank in g.ranks]
