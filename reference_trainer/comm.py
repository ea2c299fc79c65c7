"""THE communication choke point: every torch.distributed call of the trainer lives in this file.

Every collective and p2p op passes through ``Comm._dispatch``, which
1. assigns the op's sequence number (collectives: per group; p2p: per (group, peer, direction)),
2. runs the op inside a ``record_function`` span named by ``tracekit.conventions.CommAnnotation``,
3. calls the registered ``CommHook``s before and after the op (after = when it completed, for
   asynchronous sends at their ``wait``), so recording and fault injection plug in here without
   touching the parallelism files.

Reductions honour ``reduce_order``: ``native`` uses the backend's all_reduce / reduce_scatter;
``canonical`` all-gathers and sums in rank order, ((x0 + x1) + x2) + ..., each add rounded in the
tensor's dtype, which any backend reproduces and a sequential emulator can follow bit for bit.
Ops on groups of size 1 move no data and are not dispatched (nothing is recorded for them).
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from tracekit.conventions import CommAnnotation



def chained_sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical order: ``((t0 + t1) + t2) + ...``, each add rounded in the terms' dtype.
    (numerics has its own copy; tests/test_numerics_independence.py checks the two agree.)"""
    acc = terms[0].clone()
    for t in terms[1:]:
        acc.add_(t)  # elementwise, one rounding per add (torch's bf16 sum would accumulate in fp32)
    return acc

class CommError(RuntimeError):
    """Misuse of the comm layer (unknown group, wrong peer, size mismatch)."""


@dataclass(frozen=True, eq=False)
class Group:
    """A process group as the trainer sees it: torch's name, the dimension it spans, its ranks."""

    name: str  # torch's process-group name ("" for a group of one that needs no torch group)
    dim: str  # tp, cp, pp, dp, dp_cp, world
    ranks: tuple[int, ...]  # global ranks in group-local order
    rank: int  # this process's global rank
    pg: Any = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def local_rank(self) -> int:
        return self.ranks.index(self.rank)


@dataclass
class CommRecord:
    """One dispatched op, handed to hooks. Hooks may annotate ``extra`` (e.g. timestamps)."""

    annotation: CommAnnotation
    group: Group
    input_sizes: list[list[int]]
    output_sizes: list[list[int]]
    dtype: str
    is_async: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def op(self) -> str:
        return self.annotation.op

    @property
    def seq(self) -> int:
        return self.annotation.seq


class CommHook(Protocol):
    """Observer of the comm layer. ``before`` runs just before the op is issued (a fault injector
    may sleep or block here); ``after`` runs once the op has completed on this rank. A hook may also
    define ``during(record)``: it runs inside the op's profiler span, just before the transfer (a
    slow-link injector delays the transfer there, so that the rank arrives on time)."""

    def before(self, record: CommRecord) -> None: ...

    def after(self, record: CommRecord) -> None: ...


class PendingSend:
    """An asynchronous send in flight; ``wait`` completes it and runs the ``after`` hooks."""

    def __init__(self, work: Any, record: CommRecord, hooks: Sequence[CommHook], keep: torch.Tensor):
        self._work, self.record, self._hooks, self._keep = work, record, hooks, keep
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        self.done = True
        self._keep = None  # the buffer may be freed only now
        for h in self._hooks:
            h.after(self.record)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _move_dim_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()


class Comm:
    """The per-process comm layer. Build with ``Comm.init_world`` (multi-process) or ``Comm.single()``."""

    def __init__(self, rank: int, world_size: int, reduce_order: str = "native",
                 device: torch.device | None = None, backend: str = "none"):
        if reduce_order not in ("native", "canonical"):
            raise CommError(f"reduce_order must be native or canonical, got {reduce_order!r}")
        self.rank, self.world_size, self.reduce_order = rank, world_size, reduce_order
        self.device = device or torch.device("cpu")
        self.backend = backend
        self.timeout_s: float | None = None
        self.hooks: list[CommHook] = []
        self._coll_seq: dict[str, int] = {}
        self._p2p_seq: dict[tuple[str, int, str], int] = {}
        self._pending: list[PendingSend] = []
        self.groups: list[Group] = []  # the groups this rank belongs to, in creation order
        self.world = Group("", "world", tuple(range(world_size)), rank, None)  # set by init_world

    # -- setup ---------------------------------------------------------------------------------
    @classmethod
    def init_world(cls, backend: str, rank: int, world_size: int, init_method: str,
                   timeout_s: float, reduce_order: str, device: torch.device) -> "Comm":
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        comm = cls(rank, world_size, reduce_order, device, backend)
        comm.timeout_s = timeout_s  # every group gets it (new_group's default is torch's 30 min)
        comm.world = Group(dist.group.WORLD.group_name, "world", tuple(range(world_size)), rank,
                           dist.group.WORLD)
        return comm

    @classmethod
    def single(cls, reduce_order: str = "native", device: torch.device | None = None) -> "Comm":
        """A world of one process: no torch.distributed at all, every group has size 1."""
        return cls(0, 1, reduce_order, device)

    def new_group(self, ranks: Sequence[int], dim: str, desc: str | None = None) -> Group:
        """Create a group (torch ``group_desc`` = ``desc`` or the dimension). Every rank must call
        this for every group, in the same order."""
        ranks = tuple(ranks)
        if self.world_size == 1:
            return Group("", dim, ranks, self.rank, None)
        timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s else None
        pg = dist.new_group(list(ranks), group_desc=desc or dim, timeout=timeout)
        if self.rank not in ranks:
            return Group("", dim, ranks, self.rank, None)
        group = Group(pg.group_name, dim, ranks, self.rank, pg)
        self.groups.append(group)
        return group

    def add_hook(self, hook: CommHook) -> None:
        self.hooks.append(hook)

    def remove_hook(self, hook: CommHook) -> None:
        self.hooks.remove(hook)

    def shutdown(self, sync: bool = True) -> None:
        """Tear the process groups down. With ``sync`` (a run that ended normally) every rank first
        waits for the others at a barrier, so that none closes its connections while a peer is
        still using them (a rank of a gloo world was seen to abort at exit under CPU contention)."""
        self.wait_sends()
        if self.world_size > 1 and dist.is_initialized():
            if sync:
                dist.barrier()
            dist.destroy_process_group()

    # -- the dispatch --------------------------------------------------------------------------
    def _dispatch(self, op: str, group: Group, inputs: Sequence[torch.Tensor],
                  outputs: Sequence[torch.Tensor], run: Callable[[], Any],
                  peer: int | None = None, is_async: bool = False) -> Any:
        if group.pg is None:
            raise CommError(f"rank {self.rank} is not a member of {group.dim} group {group.ranks}")
        if peer is None:
            key = group.name
            seq = self._coll_seq.get(key, 0)
            self._coll_seq[key] = seq + 1
        else:
            pkey = (group.name, peer, "send" if op in ("send", "isend") else "recv")
            seq = self._p2p_seq.get(pkey, 0)
            self._p2p_seq[pkey] = seq + 1
        ref = inputs[0] if inputs else outputs[0]
        nbytes = sum(t.numel() * t.element_size() for t in (inputs or outputs))
        ann = CommAnnotation(op=op, pg=group.name, dim=group.dim, seq=seq, ranks=group.ranks,
                             nbytes=nbytes, dtype=_dtype_name(ref), peer=peer)
        record = CommRecord(ann, group, [list(t.shape) for t in inputs],
                            [list(t.shape) for t in outputs], _dtype_name(ref), is_async)
        for h in self.hooks:
            h.before(record)
        with record_function(ann.span_name()):
            for h in self.hooks:
                if hasattr(h, "during"):
                    h.during(record)
            result = run()
        if not is_async:
            for h in self.hooks:
                h.after(record)
        return record, result

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
        """Reduce over the group; returns a new tensor (sum honours reduce_order, max is exact)."""
        if group.size == 1:
            return t.clone()
        if op == "sum" and self.reduce_order == "canonical":
            parts = self._gather_parts(t, group)
            return chained_sum(parts)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        out = t.contiguous().clone()
        self._dispatch("all_reduce", group, [out], [out],
                       lambda: dist.all_reduce(out, op=red, group=group.pg))
        return out

    def _gather_parts(self, t: torch.Tensor, group: Group) -> list[torch.Tensor]:
        src = t.contiguous()
        out = torch.empty((group.size,) + tuple(src.shape), dtype=src.dtype, device=src.device)
        self._dispatch("all_gather", group, [src], [out],
                       lambda: dist.all_gather_single(out.view(-1), src.view(-1), group=group.pg))
        return list(out.unbind(0))

    def all_gather(self, t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Concatenate every member's tensor along ``dim``, in group-local rank order."""
        if group.size == 1:
            return t
        parts = self._gather_parts(_move_dim_first(t, dim), group)
        return torch.cat(parts, 0).movedim(0, dim) if dim != 0 else torch.cat(parts, 0)

    def reduce_scatter(self, t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Sum over the group, then keep this member's 1/size slice along ``dim``."""
        if group.size == 1:
            return t.clone()
        if t.shape[dim] % group.size:
            raise CommError(f"reduce_scatter: size {t.shape[dim]} of dim {dim} not divisible by "
                            f"{group.dim} group size {group.size}")
        src = _move_dim_first(t, dim)
        n = src.shape[0] // group.size
        if self.reduce_order == "canonical":
            full = chained_sum(self._gather_parts(src, group))
            out = full[group.local_rank * n:(group.local_rank + 1) * n].contiguous()
        else:
            out = torch.empty((n,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
            self._dispatch("reduce_scatter", group, [src], [out],
                           lambda: dist.reduce_scatter_single(out, src, group=group.pg))
        return out.movedim(0, dim) if dim != 0 else out

    def gather_object(self, obj: Any, group: Group) -> list[Any] | None:
        """Pickle ``obj`` to the group's first member; returns the list there, None elsewhere."""
        if group.size == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device),
                                group).cpu()
        width = int(sizes.max())
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:payload.numel()] = payload
        allp = self.all_gather(padded.to(self.device), group).cpu().view(group.size, width)
        if group.local_rank != 0:
            return None
        return [pickle.loads(allp[i, :int(sizes[i])].numpy().tobytes()) for i in range(group.size)]

    def barrier(self, group: Group) -> None:
        if group.size > 1:
            token = torch.zeros(1, device=self.device)
            self._dispatch("barrier", group, [token], [token],
                           lambda: dist.all_reduce(token, group=group.pg))

    # -- point to point ------------------------------------------------------------------------
    def send(self, t: torch.Tensor, peer: int, group: Group, tag: int = 0) -> PendingSend:
        """Asynchronous send to global rank ``peer``; completed by ``wait_sends`` (or its wait)."""
        if peer not in group.ranks or peer == self.rank:
            raise CommError(f"send: peer {peer} not another member of {group.dim} group {group.ranks}")
        buf = t.detach().contiguous()
        record, work = self._dispatch(
            "send", group, [buf], [], lambda: dist.isend(buf, group=group.pg, tag=tag,
                                                         group_dst=group.ranks.index(peer)),
            peer=peer, is_async=True)
        pending = PendingSend(work, record, self.hooks, buf)
        self._pending.append(pending)
        return pending

    def recv(self, shape: Sequence[int], dtype: torch.dtype, peer: int, group: Group,
             tag: int = 0) -> torch.Tensor:
        """Blocking receive from global rank ``peer``."""
        if peer not in group.ranks or peer == self.rank:
            raise CommError(f"recv: peer {peer} not another member of {group.dim} group {group.ranks}")
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self._dispatch("recv", group, [], [buf],
                       lambda: dist.recv(buf, group=group.pg, tag=tag,
                                         group_src=group.ranks.index(peer)), peer=peer)
        return buf

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            p.wait()
