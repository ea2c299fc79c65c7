"""One rank's view of the simulated run: its ops with their true start/end times, and its groups."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.simulate.model import Op, Trace
from tracekit.simulate.schedule import Group, Groups

STREAMS = {"compute": 7, "tp": 20, "cp": 24, "dp": 28, "pp_next": 32, "pp_prev": 36}


@dataclass
class RankOps:
    rank: int
    stage: int
    ops: list[Op]
    start: np.ndarray  # true ms per op (+inf: never issued)
    end: np.ndarray  # true ms per op (+inf: never completed)
    step_start: np.ndarray  # per step
    step_end: np.ndarray


class Views:
    """Per stage, every op's lanes stacked once, so that a rank's times are one column."""

    def __init__(self, trace: Trace, groups: Groups) -> None:
        self.trace, self.groups = trace, groups
        cfg = trace.cfg
        self.lay = cfg.layout
        self._stacked = {}
        for p, ops in enumerate(trace.ops):
            lanes = (cfg.dp, cfg.cp, cfg.tp)
            start = np.stack([o.start for o in ops]) if ops else np.zeros((0,) + lanes)
            end = np.stack([o.end for o in ops]) if ops else np.zeros((0,) + lanes)
            self._stacked[p] = (start, end)

    def rank(self, r: int) -> RankOps:
        c = self.lay.coords(r)
        start, end = self._stacked[c.pp]
        lane = (slice(None), c.dp, c.cp, c.tp)
        return RankOps(r, c.pp, self.trace.ops[c.pp], start[lane], end[lane],
                       self.trace.step_start[:, c.pp, c.dp, c.cp, c.tp], self.trace.step_end[:, c.pp, c.dp, c.cp, c.tp])

    def group(self, op: Op, r: int) -> Group:
        return self.groups.of[(op.dim, r)] if (op.dim, r) in self.groups.of else self._solo(op.dim, r)

    def _solo(self, dim: str, r: int) -> Group:
        # --names plain leaves out dimensions of size 1, which have no comm ops anyway
        return Group("?", dim, dim, (r,))

    def peer(self, op: Op, r: int) -> int:
        """The global rank on the other side of a p2p op (same dp, cp, tp; the peer stage)."""
        c = self.lay.coords(r)
        return self.lay.rank_of(dp=c.dp, pp=op.peer_stage, cp=c.cp, tp=c.tp)

    def stream(self, op: Op, r: int) -> int:
        if op.kind == "compute":
            return STREAMS["compute"]
        if op.kind in ("send", "recv"):
            stage = self.lay.coords(r).pp
            return STREAMS["pp_next"] if op.peer_stage == (stage + 1) % self.lay.pp else STREAMS["pp_prev"]
        return STREAMS[op.dim]
