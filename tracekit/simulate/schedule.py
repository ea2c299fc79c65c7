"""The pipeline schedule (interleaved 1F1B, Llama 3 style) and the process groups of the job.

Interleaved 1F1B with V virtual stages per rank and M micro-batches: stage p holds the model
chunks c = v * PP + p (v < V). Forwards of N = min(PP, M) consecutive micro-batches run per chunk
before moving to the next chunk (Llama 3 makes N tunable so that any M works); backwards go through
the chunks in reverse. Warm-up forwards: (PP - p - 1) * 2 + (V - 1) * N as Megatron-LM's
interleaved schedule (plain 1F1B, V = 1: PP - p - 1), then one forward one backward, then the
remaining backwards; where M is not a multiple of N that can deadlock, and stages get the fewest
extra warm-up forwards that avoid it.
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


def _order(stage: int, pp: int, vstages: int, microbatches: int, warmup: int) -> list[Unit]:
    n = min(pp, microbatches)
    groups = [range(g, min(g + n, microbatches)) for g in range(0, microbatches, n)]
    fwd = [Unit("F", v, m) for g in groups for v in range(vstages) for m in g]
    bwd = [Unit("B", v, m) for g in groups for v in reversed(range(vstages)) for m in g]
    order = fwd[:warmup]
    f, b = warmup, 0
    while f < len(fwd):
        order += [fwd[f], bwd[b]]
        f, b = f + 1, b + 1
    return order + bwd[b:]


def _stuck(orders: list[list[Unit]], pp: int, vstages: int) -> list[int]:
    """The stages that wait forever when every stage runs its order (sends never block)."""
    last = pp * vstages - 1
    done: set[tuple[str, int, int]] = set()
    at = [0] * pp
    moved = True
    while moved:
        moved = False
        for p in range(pp):
            while at[p] < len(orders[p]):
                u = orders[p][at[p]]
                c = u.chunk(pp, p)
                need = ("F", c - 1, u.mb) if u.phase == "F" and c > 0 else \
                    ("B", c + 1, u.mb) if u.phase == "B" and c < last else None
                if need is not None and need not in done:
                    break
                done.add((u.phase, c, u.mb))
                at[p] += 1
                moved = True
    return [p for p in range(pp) if at[p] < len(orders[p])]


def stage_orders(pp: int, vstages: int, microbatches: int) -> list[list[Unit]]:
    """Every stage's order of forward and backward units in one step. Megatron's warm-up can
    deadlock when M is not a multiple of N (Llama 3 tunes N so that any M works): a stage that
    would wait forever gets one more warm-up forward until none does (all forwards first always
    works)."""
    total = microbatches * vstages
    if vstages == 1:
        warm = [min(pp - p - 1, total) for p in range(pp)]
    else:
        warm = [min((pp - p - 1) * 2 + (vstages - 1) * min(pp, microbatches), total) for p in range(pp)]
    while True:
        orders = [_order(p, pp, vstages, microbatches, warm[p]) for p in range(pp)]
        stuck = _stuck(orders, pp, vstages)
        if not stuck:
            return orders
        for p in stuck:
            warm[p] = min(warm[p] + 1, total)


def schedule_names(cfg: SimConfig) -> list[list[str]]:
    """The manifest's ``pipeline_schedule``: per stage, 'F<chunk>.<mb>' / 'B<chunk>.<mb>'."""
    return [[f"{u.phase}{u.chunk(cfg.pp, p)}.{u.mb}" for u in order]
            for p, order in enumerate(stage_orders(cfg.pp, cfg.vstages, cfg.n_microbatches))]


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
