"""Process groups of every dimension for one rank, built from the shared rank layout."""

from __future__ import annotations

from dataclasses import dataclass

from tracekit.topology import Coords, Layout

from .comm import Comm, Group

# Creation order is part of the contract: every rank creates every group in this order, so torch's
# group names ("1", "2", ...) agree across ranks and across runs of the same layout.
GROUP_DIMS: tuple[str, ...] = ("tp", "cp", "pp", "dp", "dp_cp")


@dataclass
class ParallelContext:
    layout: Layout
    rank: int
    coords: Coords
    comm: Comm
    tp: Group
    cp: Group
    pp: Group
    dp: Group
    dp_cp: Group  # ZeRO shards optimizer state and gradients over DP x CP
    pp_bwd: Group  # backward p2p: the pp group itself on gloo, a second communicator on NCCL

    @property
    def is_first_pp(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_pp(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    def pp_rank_global(self, pp_index: int) -> int:
        """Global rank of the member of this rank's PP group at pipeline position ``pp_index``."""
        return self.pp.ranks[pp_index % self.layout.pp]


def build_context(layout: Layout, comm: Comm) -> ParallelContext:
    if layout.world_size != comm.world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, world has {comm.world_size}")
    rank = comm.rank
    mine: dict[str, Group] = {}
    for dim in GROUP_DIMS:
        for ranks in layout.groups(dim):
            g = comm.new_group(ranks, dim)
            if rank in ranks:
                mine[dim] = g
    mine["pp_bwd"] = mine["pp"]
    if comm.backend == "nccl":
        # NCCL ignores tags and matches p2p messages per communicator in issue order. Forward and
        # backward messages between two PP ranks are each issued in the same order on both sides,
        # but not interleaved the same way (pp = 2 with virtual stages), so they get separate
        # communicators. gloo matches by tag and keeps one PP group (cleaner traces).
        for ranks in layout.groups("pp"):
            g = comm.new_group(ranks, "pp", desc="pp_bwd")
            if rank in ranks:
                mine["pp_bwd"] = g
    return ParallelContext(layout=layout, rank=rank, coords=layout.coords(rank), comm=comm, **mine)
