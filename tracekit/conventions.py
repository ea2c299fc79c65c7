"""How the reference trainer annotates its profiler traces, and how ingest reads that back.

gloo traces carry no group, size or sequence metadata (FORMATS.md section 1), so every op of the
trainer's comm layer runs inside a ``record_function`` span whose *name* carries it. This module is
the single place that writes and parses those names; docs/trace_conventions.md describes them.

    tk.comm op=all_gather pg=5 dim=cp seq=17 ranks=0,2 bytes=4096 dtype=bfloat16
    tk.comm op=send pg=9 dim=pp seq=3 ranks=0,4 peer=4 bytes=8192 dtype=bfloat16
    tk.compute phase=fwd vstage=1 mb=3
    tk.module layers.3.attention

``ranks`` lists the group's global ranks in group-local order; ``peer`` is the global rank of the
other side of a p2p op; ``seq`` counts ops per group (collectives) or per (group, peer, direction)
(p2p), starting at 0, exactly as the flight-recorder records written by the comm layer do.
"""

from __future__ import annotations

from dataclasses import dataclass

COMM_PREFIX = "tk.comm "
COMPUTE_PREFIX = "tk.compute "
MODULE_PREFIX = "tk.module "  # a part of the model's forward: 'tk.module layers.3.attention'
TRAINER_SPAN_PREFIXES = (COMPUTE_PREFIX, COMM_PREFIX, MODULE_PREFIX)

P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


class ConventionError(ValueError):
    """A span name that starts with a tracekit prefix but does not parse."""


@dataclass(frozen=True)
class CommAnnotation:
    op: str
    pg: str
    dim: str
    seq: int
    ranks: tuple[int, ...]
    nbytes: int
    dtype: str
    peer: int | None = None

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_OPS

    def span_name(self) -> str:
        parts = [
            f"op={self.op}",
            f"pg={self.pg}",
            f"dim={self.dim}",
            f"seq={self.seq}",
            "ranks=" + ",".join(str(r) for r in self.ranks),
        ]
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        parts += [f"bytes={self.nbytes}", f"dtype={self.dtype}"]
        return COMM_PREFIX + " ".join(parts)


@dataclass(frozen=True)
class ComputeAnnotation:
    phase: str  # fwd | bwd | opt
    vstage: int | None = None
    mb: int | None = None

    def span_name(self) -> str:
        parts = [f"phase={self.phase}"]
        if self.vstage is not None:
            parts.append(f"vstage={self.vstage}")
        if self.mb is not None:
            parts.append(f"mb={self.mb}")
        return COMPUTE_PREFIX + " ".join(parts)


def _fields(name: str, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for tok in name[len(prefix):].split():
        key, sep, val = tok.partition("=")
        if not sep or not key:
            raise ConventionError(f"malformed field {tok!r} in span {name!r}")
        out[key] = val
    return out


def parse_comm(name: str) -> CommAnnotation | None:
    """The annotation in a span name, None if the span is not a tracekit comm span."""
    if not name.startswith(COMM_PREFIX):
        return None
    f = _fields(name, COMM_PREFIX)
    try:
        return CommAnnotation(
            op=f["op"],
            pg=f["pg"],
            dim=f.get("dim", "other"),
            seq=int(f["seq"]),
            ranks=tuple(int(r) for r in f["ranks"].split(",") if r),
            nbytes=int(f.get("bytes", 0)),
            dtype=f.get("dtype", ""),
            peer=int(f["peer"]) if "peer" in f else None,
        )
    except (KeyError, ValueError) as e:
        raise ConventionError(f"bad comm span {name!r}: {e}") from None


def parse_compute(name: str) -> ComputeAnnotation | None:
    if not name.startswith(COMPUTE_PREFIX):
        return None
    f = _fields(name, COMPUTE_PREFIX)
    try:
        return ComputeAnnotation(
            phase=f["phase"],
            vstage=int(f["vstage"]) if "vstage" in f else None,
            mb=int(f["mb"]) if "mb" in f else None,
        )
    except (KeyError, ValueError) as e:
        raise ConventionError(f"bad compute span {name!r}: {e}") from None


# Frames of the reference trainer's CPU memory snapshots (reference_trainer/alloc_sites.py). The CPU
# profiler records allocations without a stack, so an allocation's frames are the profiler spans open
# around it on its thread, and a persistent buffer's is the trainer's own name for it. Their file
# names say that they are not source lines.
OP_FRAME_FILE = "<profiler op>"  # a cpu_op span: name 'aten::mm', 'autograd::engine::evaluate_function: ...'
ANNOTATION_FRAME_FILE = "<annotation>"  # a user_annotation span: 'tk.compute phase=fwd vstage=0 mb=1'
STATE_FRAME_FILE = "<trainer state>"  # a parameter, gradient bucket or optimizer state: 'parameter layers.0.wq.weight'


def module_span_name(module: str) -> str:
    """The span around one part of the model's forward ('layers.3.attention', 'embed', 'head')."""
    return MODULE_PREFIX + module


def annotation_context(name: str) -> str | None:
    """A span annotation as a short, step-independent place: 'fwd vstage=0' for a compute span (no
    micro-batch), 'all_gather cp' for a comm span (no sequence number), 'layers.3.attention' for a
    module span, None for ProfilerStep#N, and any other annotation as it is."""
    if name.startswith("ProfilerStep#"):
        return None
    if name.startswith(MODULE_PREFIX):
        return name[len(MODULE_PREFIX):]
    try:
        if (c := parse_compute(name)) is not None:
            return c.phase + (f" vstage={c.vstage}" if c.vstage is not None else "")
        if (m := parse_comm(name)) is not None:
            return f"{m.op} {m.dim}"
    except ConventionError:
        pass
    return name
