"""Which 4D layout a run had, from the process groups it recorded (no manifest).

Three sources, most trusted first; ``LayoutGuess.source`` says which one decided:
- ``group-names``: groups described by dimension, as ``init_device_mesh(..., mesh_dim_names=...)``
  records them (``mesh_tp``, ``mesh_dp``; FORMATS.md) or as a job names its own groups (``tp``).
  Groups of size 1 count too: a ``mesh_cp`` of one rank says CP is 1. Named sizes fix the layout when
  their product is the world, or when one dimension is left to take the rest.
- ``group-structure``: no names, so every factorization of the world is scored by how many recorded
  groups it explains (``Layout.infer``); the groups that carried point-to-point sends are the
  pipeline's. Groups fix the strides, not always the names: when another labelling explains the
  groups as well (e.g. a 2-rank innermost group is TP or CP), ``ambiguity`` says so.
- ``unknown``: nothing recorded explains a layout.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from tracekit.topology import DIMS, PP_OUTERMOST, Layout, LayoutError

# Descriptions that name a dimension: ours and torch DeviceMesh's ("mesh_" + the dim name).
ALIASES = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "sp": "cp", "fsdp": "dp",
           "ddp": "dp", "pipe": "pp", "pipeline": "pp", "tensor": "tp", "context": "cp", "data": "dp"}
# torchtitan's HSDP mesh splits DP in two ("dp_replicate" outer, "dp_shard" inner) and flattens them
# into "dp": the parts' product is DP where no "dp" group was recorded, and the parts name no group
# of the layout (before, "dp_shard" read as DP and conflicted with the flattened "dp", twice its size)
DP_PARTS = ("dp_replicate", "dp_shard")


# Words in longer descriptions (Megatron's 'tensor_model_parallel', 'pipeline_model_parallel', ...).
WORDS = {"tensor": "tp", "context": "cp", "pipeline": "pp", "data": "dp"}


def dim_of_desc(desc: str | None) -> str | None:
    """The dimension a group description names ('mesh_tp' -> 'tp', 'tensor_model_parallel' -> 'tp'),
    or None (also when it names several, as Megatron's 'data_parallel_with_context' does)."""
    if not desc:
        return None
    d = desc.strip().lower()
    d = d[5:] if d.startswith("mesh_") else d
    if d in ALIASES:
        return ALIASES[d]
    named = {dim for word, dim in WORDS.items() if word in d.replace("-", "_").split("_")}
    return named.pop() if len(named) == 1 and "expert" not in d else None


# What a run with no layout found is analysed as, and what each view says of it.
ASSUMED_LAYOUTS = {
    "assumed-dp": "no parallel layout recorded: every rank is compared with every other as a data-parallel replica",
    "assumed-pp": "no parallel layout recorded: the ranks are taken as the stages of one pipeline, in rank order "
                  "(their p2p ops chain them so)",
}


def assumed_layout(world: int, p2p_pairs: Iterable[Sequence[int]]) -> str:
    """The ``ASSUMED_LAYOUTS`` key for a run of ``world`` ranks with no layout: one pipeline where
    its p2p (rank, peer) pairs chain every rank to its neighbours in rank order (taken as replicas,
    a 2-stage job's heavier stage read "a slow worker" at 0.99), else data-parallel replicas."""
    pairs = [(int(a), int(b)) for a, b in p2p_pairs]
    chained = bool(pairs) and all(abs(a - b) == 1 for a, b in pairs) and {a for a, _ in pairs} == set(range(world))
    return "assumed-pp" if chained else "assumed-dp"


@dataclass(frozen=True)
class LayoutGuess:
    layout: Layout | None
    source: str  # group-names | group-structure | unknown
    ambiguity: str | None = None  # why another layout would explain the groups as well


def _dp_part(desc: str | None) -> str | None:
    """'dp_replicate' or 'dp_shard' where ``desc`` names that part of DP ('mesh_dp_shard'), else None."""
    d = (desc or "").strip().lower()
    d = d[5:] if d.startswith("mesh_") else d
    return d if d in DP_PARTS else None


def _named_sizes(world: int, groups: list[tuple[str | None, tuple[int, ...]]]) -> tuple[dict[str, int], str | None]:
    sizes: dict[str, set[int]] = {}
    parts: dict[str, int] = {}
    for desc, ranks in groups:
        dim = dim_of_desc(desc)
        if dim is not None and ranks:
            sizes.setdefault(dim, set()).add(len(set(ranks)))
        part = _dp_part(desc)
        if part and ranks:
            parts[part] = max(parts.get(part, 1), len(set(ranks)))
    if parts and "dp" not in sizes:
        sizes["dp"] = {math.prod(parts.values())}
    bad = {d: sorted(v) for d, v in sizes.items() if len(v) > 1}
    if bad:
        return {}, f"groups named alike have different sizes: {bad}"
    return {d: v.pop() for d, v in sizes.items()}, None


def _named_order(groups: list[tuple[str | None, tuple[int, ...]]], sizes: dict[str, int]) -> tuple[str, ...]:
    """Dimensions innermost first by the stride of their named groups (the smallest gap between a
    group's ranks), the unnamed or size-1 ones where DIMS has them."""
    stride: dict[str, int] = {}
    for desc, ranks in groups:
        dim = dim_of_desc(desc) or ("dp" if _dp_part(desc) else None)  # DP's inner part sets its stride
        members = sorted(set(ranks))
        if dim is None or len(members) < 2 or sizes.get(dim, 1) < 2:
            continue
        gap = min(b - a for a, b in zip(members, members[1:]))
        stride[dim] = min(stride.get(dim, gap), gap)
    ranked = iter(sorted(stride, key=stride.get))
    return tuple(next(ranked) if d in stride else d for d in DIMS)


def _fits(lay: Layout, groups: list[tuple[str | None, tuple[int, ...]]]) -> bool:
    """Every named group of size > 1 is a group of its dimension in the [TP, CP, PP, DP] order."""
    for desc, ranks in groups:
        dim = dim_of_desc(desc)
        if dim is None or len(set(ranks)) < 2:
            continue
        if max(ranks) >= lay.world_size or tuple(sorted(lay.group(min(ranks), dim))) != tuple(sorted(ranks)):
            return False
    return True


def infer_layout(world: int, groups: Iterable[tuple[str | None, Sequence[int]]],
                 p2p_groups: Iterable[Sequence[int]] = ()) -> LayoutGuess:
    """The layout a run's recorded groups (description, ranks) describe, and how it was found.
    ``p2p_groups`` are the groups that carried send/recv (a hint that they are the pipeline's)."""
    if world < 1:
        return LayoutGuess(None, "unknown", f"world size {world}")
    if world == 1:  # one rank: every dimension is 1, whatever the groups say
        return LayoutGuess(Layout(), "group-names", None)
    recorded = [(desc, tuple(int(r) for r in ranks)) for desc, ranks in groups]
    named, conflict = _named_sizes(world, recorded)
    note = conflict
    if named and not conflict:
        prod = 1
        for v in named.values():
            prod *= v
        rest = [d for d in DIMS if d not in named]
        sizes = None
        if prod == world:
            sizes = {**{d: 1 for d in rest}, **named}
        elif world % prod == 0 and len(rest) == 1:
            sizes = {**named, rest[0]: world // prod}
        elif world % prod == 0 and "dp" in rest:  # the unnamed remainder is data parallel, as in every job
            sizes = {**{d: 1 for d in rest}, **named, "dp": world // prod}
            note = f"dimensions {rest} unnamed; the remaining factor {world // prod} taken as dp"
        if sizes is not None:
            lay = Layout(**sizes)
            if _fits(lay, recorded):
                return LayoutGuess(lay, "group-names", note)
            # the mesh may order its dimensions otherwise (torchtitan, Megatron-LM: PP outermost):
            # the order the named groups' strides give
            ordered = Layout(**sizes, order=_named_order(recorded, sizes))
            if _fits(ordered, recorded):
                return LayoutGuess(ordered, "group-names", note)
            note = (f"named groups follow neither the [tp, cp, pp, dp] rank order of {lay} nor the order "
                    "of their own strides; layout taken from the group structure")
    structural = [r for _, r in recorded if 1 < len(set(r)) < world]
    if not structural:
        return LayoutGuess(None, "unknown", note)
    hints = {tuple(sorted(r)): dim_of_desc(d) for d, r in recorded if dim_of_desc(d)}
    hints.update({tuple(sorted(r)): "pp" for r in p2p_groups if 1 < len(set(r)) < world})
    try:
        lay = Layout.infer(world, structural, hints)
    except LayoutError as e:
        return LayoutGuess(None, "unknown", str(e))
    return LayoutGuess(lay, "group-structure", note or _ambiguity(lay, structural, hints))


def _ambiguity(lay: Layout, groups: list[tuple[int, ...]], hints: dict) -> str | None:
    """Another labelling of the same strides that explains every group the chosen one explains
    (the names of dimensions no description or p2p fixed are then a guess)."""
    explained = {g for g in groups if lay.dim_of(g)}
    sizes = [getattr(lay, d) for d in DIMS]
    for perm, order in itertools.product(set(itertools.permutations(sizes)), (DIMS, PP_OUTERMOST)):
        other = Layout(**dict(zip(DIMS, perm)), order=order)
        if other == lay:
            continue
        if all(other.dim_of(g) for g in explained) and not any(
                h in DIMS and other.dim_of(g) != h for g, h in hints.items() if g in explained):
            same = [d for d in DIMS if getattr(lay, d) > 1]
            return (f"groups fit {lay} and {other} alike: which of {same} each is was guessed "
                    "(name the mesh dims, e.g. init_device_mesh(..., mesh_dim_names=...), or ingest with a manifest)")
    return None
