"""The discrete-event model of the job: every op of every rank on the true clock (ms).

All ranks of one pipeline stage run the same op sequence, so a stage is simulated as one numpy
array over its (dp, cp, tp) lanes; stages advance in turn, each as far as its inputs allow (a
forward needs the previous chunk's send, a backward the next chunk's). Rules:
- compute: base x the rank's fault factor x lognormal noise x (rarely) a 5-30x deschedule spike;
- a collective completes for every member at max(arrivals) + transfer(size, link);
- p2p sends are asynchronous (the sender goes on); a recv and its send complete at
  max(send posted, recv posted) + transfer, and the receiver waits for it;
- a hang is a rank that never arrives: its arrival is +inf, which every later op that depends on
  it inherits (max), so blocked ranks show ops that started and never completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracekit.simulate.config import SimConfig
from tracekit.simulate.faults import Effects
from tracekit.simulate.schedule import Unit, stage_orders

AXIS = {"dp": 0, "cp": 1, "tp": 2}  # a stage's lanes: (DP, CP, TP)
RING = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}  # x (n-1)/n of the larger buffer
DTYPE_BYTES = {"BFloat16": 2, "Float": 4}


@dataclass
class Op:
    """One op of every lane of a stage; ``start``/``end`` per lane in true ms (+inf: never)."""

    step: int
    kind: str  # compute | collective | send | recv
    name: str  # compute: a kernel key (model.KERNELS); collective: all_reduce, all_gather, reduce_scatter
    start: np.ndarray
    end: np.ndarray
    dim: str | None = None  # the collective's group dimension; "pp" for p2p
    seq: int = 0  # collective: the group's sequence number; p2p: the rank's p2p count
    in_nelems: int = 0
    out_nelems: int = 0
    dtype: str = "BFloat16"
    peer_stage: int | None = None  # p2p: the other stage
    unit: str = ""  # e.g. F3.1 (chunk 3, micro-batch 1), "" outside the pipeline


@dataclass
class Trace:
    """The simulated run: per stage its ops in issue order, step spans, spikes."""

    cfg: SimConfig
    ops: list[list[Op]]
    step_start: np.ndarray  # (steps, PP, DP, CP, TP)
    step_end: np.ndarray
    spikes: list[dict] = field(default_factory=list)
    hung: dict | None = None  # the hang's collective: step, dim, op, seq


class Simulation:
    def __init__(self, cfg: SimConfig, effects: Effects) -> None:
        self.cfg, self.fx = cfg, effects
        self.rng = np.random.default_rng([cfg.seed, 1])
        self.lanes = (cfg.dp, cfg.cp, cfg.tp)
        ranks = np.arange(cfg.world_size).reshape(cfg.dp, cfg.pp, cfg.cp, cfg.tp)
        self.ranks = [ranks[:, p] for p in range(cfg.pp)]
        self.host = [r // cfg.ranks_per_host for r in self.ranks]
        self.ops: list[list[Op]] = [[] for _ in range(cfg.pp)]
        self.seq = [{d: 0 for d in ("tp", "cp", "dp")} for _ in range(cfg.pp)]
        self.p2p_count = [0] * cfg.pp
        self.sends: dict[tuple, tuple[int, Op]] = {}  # (phase, step, chunk, mb) -> (sending stage, send)
        self.spikes: list[dict] = []
        self.hung: dict | None = None
        s = cfg.seq_len // cfg.cp
        self.act = s * cfg.hidden  # an activation: the p2p message, and a TP all-reduce
        self.kv = max(1, s * cfg.hidden // (4 * cfg.tp))  # this rank's K and V (GQA, 1/4 of the heads)
        self.params = cfg.params_per_layer * cfg.layers // cfg.tp  # one chunk's weights on this rank

    # -- primitives ----------------------------------------------------------------------------------
    def compute(self, p: int, t: np.ndarray, step: int, name: str, base_ms: float, unit: str,
                attention: bool = False) -> np.ndarray:
        c = self.cfg
        factor = self.fx.compute[step, :, p] * (self.fx.attention[step, :, p] if attention else 1.0)
        noise = self.rng.lognormal(0.0, c.noise, self.lanes) if c.noise > 0 else 1.0
        dur = base_ms * factor * noise
        if c.spikes > 0:
            hit = self.rng.random(self.lanes) < c.spikes
            if hit.any():
                mult = self.rng.uniform(5.0, 30.0, self.lanes)
                dur = np.where(hit, dur * mult, dur)
                for lane in zip(*np.nonzero(hit)):
                    self.spikes.append({"rank": int(self.ranks[p][lane]), "step": step, "kernel": name,
                                        "unit": unit, "factor": round(float(mult[lane]), 2)})
        end = t + dur
        self.ops[p].append(Op(step, "compute", name, t, end, unit=unit))
        return end

    def _bandwidth(self, cross: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = self.cfg
        return np.where(cross, c.inter_gbps, c.intra_gbps) * 1e6, np.where(cross, 0.03, 0.01)  # bytes/ms, ms

    def collective(self, p: int, t: np.ndarray, step: int, dim: str, op: str, in_n: int, out_n: int,
                   dtype: str, unit: str) -> np.ndarray:
        c = self.cfg
        n = getattr(c, dim)
        axis = AXIS[dim]
        self.seq[p][dim] += 1
        arrive = t  # lanes arrays are never changed in place: ops share them (memory at 16K ranks)
        h = self.fx.hang
        if (h is not None and self.hung is None and step == h.params["step"]
                and h.params.get("dim", dim) == dim and h.params.get("op", op) == op):
            co = c.layout.coords(h.params["rank"])
            if co.pp == p:
                arrive = t.copy()
                arrive[co.dp, co.cp, co.tp] = np.inf
                self.hung = {"step": step, "dim": dim, "op": op, "seq": self.seq[p][dim], "stage": p}
        host = self.host[p]
        cross = host.max(axis=axis, keepdims=True) != host.min(axis=axis, keepdims=True)
        bw, lat = self._bandwidth(cross)
        nbytes = max(in_n, out_n) * DTYPE_BYTES[dtype]
        shape = [1, 1, 1]
        for d, a in AXIS.items():
            if d != dim:
                shape[a] = self.lanes[a]
        xfer = lat + RING[op] * (n - 1) / n * nbytes / bw
        xfer = xfer * (self.rng.lognormal(0.0, c.noise / 2, shape) if c.noise > 0 else 1.0)
        xfer = xfer + self.fx.collective_delay_ms(step, dim, p, self.lanes).max(axis=axis, keepdims=True)
        end = np.broadcast_to(arrive.max(axis=axis, keepdims=True) + xfer, self.lanes)  # a view: one value per group
        self.ops[p].append(Op(step, "collective", op, arrive, end, dim=dim, seq=self.seq[p][dim],
                              in_nelems=in_n, out_nelems=out_n, dtype=dtype, unit=unit))
        return end

    def send(self, p: int, t: np.ndarray, step: int, unit: Unit, to: int, key: tuple) -> None:
        self.p2p_count[p] += 1
        op = Op(step, "send", "send", t, np.broadcast_to(np.nan, self.lanes), dim="pp", seq=self.p2p_count[p],
                in_nelems=self.act, out_nelems=self.act, peer_stage=to, unit=self.tag(unit, p))
        self.ops[p].append(op)
        self.sends[key] = (p, op)

    def recv(self, p: int, t: np.ndarray, step: int, unit: Unit, key: tuple) -> np.ndarray:
        c = self.cfg
        src, send = self.sends.pop(key)
        bw, lat = self._bandwidth(self.host[p] != self.host[src])
        xfer = lat + self.act * DTYPE_BYTES["BFloat16"] / bw
        xfer = xfer * (self.rng.lognormal(0.0, c.noise / 2, self.lanes) if c.noise > 0 else 1.0)
        xfer = xfer + self.fx.p2p_delay_ms(step, p, src, self.lanes)
        end = np.maximum(send.start, t) + xfer
        send.end = end
        self.p2p_count[p] += 1
        self.ops[p].append(Op(step, "recv", "recv", t, end, dim="pp", seq=self.p2p_count[p],
                              in_nelems=self.act, out_nelems=self.act, peer_stage=src, unit=self.tag(unit, p)))
        return end

    def tag(self, u: Unit, p: int) -> str:
        return f"{u.phase}{u.chunk(self.cfg.pp, p)}.{u.mb}"

    # -- one forward or backward unit of a stage ------------------------------------------------------
    def needs(self, p: int, step: int, u: Unit) -> tuple | None:
        """The send this unit receives (None: it receives nothing)."""
        chunk, last = u.chunk(self.cfg.pp, p), self.cfg.vstages * self.cfg.pp - 1
        if u.phase == "F":
            return ("F", step, chunk - 1, u.mb) if chunk > 0 else None
        return ("B", step, chunk + 1, u.mb) if chunk < last else None

    def unit(self, p: int, t: np.ndarray, step: int, u: Unit) -> np.ndarray:
        c = self.cfg
        chunk, last, tag = u.chunk(c.pp, p), c.vstages * c.pp - 1, self.tag(u, p)
        key = self.needs(p, step, u)
        tp = c.tp > 1
        if u.phase == "F":
            t = self.recv(p, t, step, u, key) if key else self.compute(p, t, step, "embedding", 0.2, tag)
            for _ in range(c.layers):
                if c.cp > 1:
                    t = self.collective(p, t, step, "cp", "all_gather", self.kv, self.kv * c.cp, "BFloat16", tag)
                t = self.compute(p, t, step, "attn_fwd", c.attn_ms, tag, attention=True)
                if tp:
                    t = self.collective(p, t, step, "tp", "all_reduce", self.act, self.act, "BFloat16", tag)
                t = self.compute(p, t, step, "mlp_fwd", c.mlp_ms, tag)
                if tp:
                    t = self.collective(p, t, step, "tp", "all_reduce", self.act, self.act, "BFloat16", tag)
            if chunk == last:
                t = self.compute(p, t, step, "head_fwd", 1.0, tag)
                t = self.compute(p, t, step, "loss", 0.3, tag)
            else:
                self.send(p, t, step, u, (chunk + 1) % c.pp, ("F", step, chunk, u.mb))
            return t
        t = self.recv(p, t, step, u, key) if key else self.compute(p, t, step, "head_bwd", 2.0, tag)
        for _ in range(c.layers):
            t = self.compute(p, t, step, "mlp_bwd", 2 * c.mlp_ms, tag)
            if tp:
                t = self.collective(p, t, step, "tp", "all_reduce", self.act, self.act, "BFloat16", tag)
            t = self.compute(p, t, step, "attn_bwd", 2 * c.attn_ms, tag, attention=True)
            if c.cp > 1:
                t = self.collective(p, t, step, "cp", "reduce_scatter", self.kv * c.cp, self.kv, "BFloat16", tag)
            if tp:
                t = self.collective(p, t, step, "tp", "all_reduce", self.act, self.act, "BFloat16", tag)
        if chunk > 0:
            self.send(p, t, step, u, (chunk - 1) % c.pp, ("B", step, chunk, u.mb))
        return t

    def step_end(self, p: int, t: np.ndarray, step: int) -> np.ndarray:
        """ZeRO/FSDP over DP: reduce-scatter the gradients, step the optimizer, all-gather the weights."""
        c = self.cfg
        shard = self.params // c.dp
        if c.dp > 1:
            for _ in range(c.vstages):
                t = self.collective(p, t, step, "dp", "reduce_scatter", shard * c.dp, shard, "Float", "")
        t = self.compute(p, t, step, "optimizer", c.optimizer_ms, "")
        if c.dp > 1:
            for _ in range(c.vstages):
                t = self.collective(p, t, step, "dp", "all_gather", shard, shard * c.dp, "BFloat16", "")
        return t

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> Trace:
        c = self.cfg
        orders = stage_orders(c.pp, c.vstages, c.n_microbatches)
        tasks = [[("begin", s, None)] + [("unit", s, u) for u in orders[p]]
                 + [("end", s, None)] for p in range(c.pp) for s in range(c.steps)]
        tasks = [sum(tasks[p * c.steps:(p + 1) * c.steps], []) for p in range(c.pp)]
        at = [0] * c.pp
        t = [self.rng.uniform(0.0, 0.5, self.lanes) for _ in range(c.pp)]
        start = np.zeros((c.steps, c.pp) + self.lanes)
        end = np.zeros((c.steps, c.pp) + self.lanes)
        while any(at[p] < len(tasks[p]) for p in range(c.pp)):
            moved = False
            for p in range(c.pp):
                while at[p] < len(tasks[p]):
                    what, s, u = tasks[p][at[p]]
                    if what == "unit":
                        key = self.needs(p, s, u)
                        if key is not None and key not in self.sends:
                            break
                        t[p] = self.unit(p, t[p], s, u)
                    elif what == "begin":
                        start[s, p] = t[p]
                        t[p] = t[p] + 0.3 * (self.rng.lognormal(0.0, c.noise, self.lanes) if c.noise > 0 else 1.0)
                    else:
                        t[p] = end[s, p] = self.step_end(p, t[p], s)
                    at[p] += 1
                    moved = True
            if not moved:
                raise RuntimeError(f"pipeline schedule deadlocks (pp={c.pp}, vstages={c.vstages}, "
                                   f"microbatches={c.n_microbatches}); stages stopped at {at}")
        return Trace(c, self.ops, start, end, self.spikes, self.hung)


def simulate_job(cfg: SimConfig, effects: Effects) -> Trace:
    return Simulation(cfg, effects).run()
