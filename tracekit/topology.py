"""The 4D rank layout, shared by the trainer, ingest and every analysis.

Dimensions are ordered innermost to outermost as [TP, CP, PP, DP] by default (Llama 3's order, and
the trainer's): ``rank = tp + TP*(cp + CP*(pp + PP*dp))``, i.e. ``arange(world).view(DP, PP, CP, TP)``.
A job may order them otherwise (``Layout.order``): torchtitan and Megatron-LM put PP outermost,
[TP, CP, DP, PP]. A "TP group" is the set of ranks that differ only in their tp coordinate, and so
on; combined groups (e.g. DP x CP, over which ZeRO shards) differ only in the named dimensions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

DIMS: tuple[str, ...] = ("tp", "cp", "pp", "dp")  # innermost to outermost
OUTER_TO_INNER: tuple[str, ...] = tuple(reversed(DIMS))


class LayoutError(ValueError):
    """An impossible or inconsistent layout."""


@dataclass(frozen=True)
class Coords:
    dp: int
    pp: int
    cp: int
    tp: int

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}


def _normalize_dims(dims: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(dims, str):
        dims = tuple(d for d in dims.replace("+", "_").split("_") if d)
    out = tuple(dims)
    for d in out:
        if d not in DIMS:
            raise LayoutError(f"unknown dimension {d!r}; expected one of {DIMS}")
    if len(set(out)) != len(out):
        raise LayoutError(f"dimension repeated in {dims!r}")
    return out


def dims_label(dims: str | Sequence[str]) -> str:
    """Canonical name of a (combined) dimension, outermost first: ('cp', 'dp') -> 'dp_cp'."""
    d = _normalize_dims(dims)
    return "_".join(x for x in OUTER_TO_INNER if x in d)


# PP outermost (torchtitan's mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"), Megatron-LM's
# default order "tp-cp-ep-dp-pp"): the other order real jobs use
PP_OUTERMOST: tuple[str, ...] = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    # innermost to outermost; only the dimensions above 1 matter, so an order that places them as
    # DIMS does is stored as DIMS (layouts that number ranks alike compare equal)
    order: tuple[str, ...] = DIMS

    def __post_init__(self) -> None:
        for d in DIMS:
            v = getattr(self, d)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"{d} must be a positive integer, got {v!r}")
        order = tuple(self.order)
        if sorted(order) != sorted(DIMS):
            raise LayoutError(f"order must hold each of {DIMS} once, got {order!r}")
        used = [d for d in order if getattr(self, d) > 1]
        if used == [d for d in DIMS if getattr(self, d) > 1]:
            order = DIMS
        object.__setattr__(self, "order", order)
        strides, s = {}, 1
        for d in order:
            strides[d] = s
            s *= getattr(self, d)
        object.__setattr__(self, "_strides", strides)  # not a field: equality and hash stay the sizes' and order's

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def size(self, dims: str | Sequence[str]) -> int:
        n = 1
        for d in _normalize_dims(dims):
            n *= getattr(self, d)
        return n

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours along one dimension."""
        if dim in self._strides:
            return self._strides[dim]
        (dim,) = _normalize_dims(dim)
        return self._strides[dim]

    def as_dict(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    def __str__(self) -> str:
        return "x".join(f"{d}{getattr(self, d)}" for d in reversed(self.order))

    # -- rank <-> coordinates --------------------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        st = self._strides
        return Coords(dp=rank // st["dp"] % self.dp, pp=rank // st["pp"] % self.pp, cp=rank // st["cp"] % self.cp,
                      tp=rank // st["tp"] % self.tp)

    def rank_of(self, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        at = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for name, v in at.items():
            if not 0 <= v < getattr(self, name):
                raise LayoutError(f"{name}={v} outside size {getattr(self, name)}")
        st = self._strides
        return dp * st["dp"] + pp * st["pp"] + cp * st["cp"] + tp * st["tp"]

    # -- groups ----------------------------------------------------------------------------------
    def group(self, rank: int, dims: str | Sequence[str]) -> tuple[int, ...]:
        """Ranks that share every coordinate of ``rank`` except those in ``dims``.

        Ordered with the innermost varying dimension fastest, so the position of a rank in the
        tuple is its group-local rank (as torch.distributed.new_group(ranks) would number it).
        """
        d = _normalize_dims(dims)
        base = self.coords(rank).as_dict()
        outer_first = tuple(reversed(self.order))
        ranges = [range(getattr(self, x)) if x in d else (base[x],) for x in outer_first]
        return tuple(
            self.rank_of(**dict(zip(outer_first, combo))) for combo in itertools.product(*ranges)
        )

    def groups(self, dims: str | Sequence[str]) -> list[tuple[int, ...]]:
        """Every group of the (combined) dimension, each once, ordered by its smallest rank."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group(r, dims), None)
        return sorted(seen, key=lambda g: g[0])

    def dim_of(self, ranks: Iterable[int]) -> str | None:
        """Name the (combined) dimension a set of ranks forms, or None.

        Single dimensions are preferred over combinations; a group that spans the whole world is
        'world' unless a single dimension of size world_size explains it.
        """
        target = tuple(sorted(ranks))
        if not target:
            return None
        if len(target) == 1:
            return None
        candidates: list[tuple[str, ...]] = [(d,) for d in DIMS]
        candidates += [c for n in (2, 3) for c in itertools.combinations(DIMS, n)]
        for c in candidates:
            if self.size(c) != len(target):
                continue
            if target[0] >= self.world_size or target[-1] >= self.world_size:
                return None
            if tuple(sorted(self.group(target[0], c))) == target:
                return dims_label(c)
        if len(target) == self.world_size and target == tuple(range(self.world_size)):
            return "world"
        return None

    # -- inference -------------------------------------------------------------------------------
    @classmethod
    def infer(
        cls,
        world_size: int,
        groups: Iterable[Sequence[int]],
        hints: Mapping[tuple[int, ...], str] | None = None,
    ) -> "Layout":
        """Infer sizes from recorded process groups (e.g. Kineto or flight-recorder pg_config).

        Every factorization of ``world_size`` is scored by how many recorded groups it explains
        as a single or combined dimension; ``hints`` maps a group (sorted ranks) to the dimension
        its description names (e.g. pg_desc 'tp'), and a contradicted hint costs more than an
        unexplained group. A layout is penalized for inner dimensions (tp, cp, pp) larger than 1
        that no recorded group shows (the remainder belongs in DP, which always exists). Remaining
        ties go to TP for the innermost groups and to DP for the outermost (the two dimensions every
        job has), then to PP over CP.
        """
        if world_size < 1:
            raise LayoutError(f"world_size must be >= 1, got {world_size}")
        hints = {tuple(sorted(k)): v for k, v in (hints or {}).items()}
        recorded = {tuple(sorted(g)) for g in groups if 1 < len(set(g)) < world_size}
        if any(r < 0 or r >= world_size for g in recorded for r in g):
            raise LayoutError(f"a recorded group names a rank outside world of size {world_size}")
        best: tuple[tuple[int, ...], Layout] | None = None
        for tp, cp, pp in itertools.product(_divisors(world_size), repeat=3):
            if world_size % (tp * cp * pp):
                continue
            for order in (DIMS, PP_OUTERMOST):
                lay = cls(tp=tp, cp=cp, pp=pp, dp=world_size // (tp * cp * pp), order=order)
                if order != DIMS and lay.order == DIMS:
                    continue  # the same numbering
                explained = contradicted = 0
                for g in recorded:
                    dim = lay.dim_of(g)
                    if dim is None:
                        continue
                    explained += 1
                    hint = hints.get(g)
                    if hint is not None and hint in DIMS and hint != dim:
                        contradicted += 1
                # Unused inner dimensions cost: prefer the layout with the fewest non-trivial
                # dims that no recorded group shows (then the largest dp).
                used = {lay.dim_of(g) for g in recorded}
                idle = sum(1 for d in ("tp", "cp", "pp") if getattr(lay, d) > 1 and d not in used)
                # another order only where it explains more (a p2p group the default calls DP)
                score = (explained - 2 * contradicted, -idle, lay.order == DIMS, lay.tp, lay.dp, lay.pp)
                if best is None or score > best[0]:
                    best = (score, lay)
        assert best is not None
        return best[1]


def order_from_coords(sizes: Mapping[str, int], rows: Iterable[Sequence[int]]) -> tuple[str, ...]:
    """The dimension order (innermost first) that numbers ranks as ``rows`` (rank, dp, pp, cp, tp)
    say: DIMS where it does or where nothing tells, else PP_OUTERMOST, else any order that does.
    The run's ranks carry their coordinates (written at ingest); the runs table only the sizes."""
    rows = [tuple(int(x) for x in r) for r in rows if all(x is not None for x in r)]
    if not rows:
        return DIMS
    orders = [DIMS, PP_OUTERMOST] + [o for o in itertools.permutations(DIMS) if o not in (DIMS, PP_OUTERMOST)]
    for order in orders:
        lay = Layout(**{d: int(sizes[d]) for d in DIMS}, order=order)
        st = [lay.stride(d) for d in ("dp", "pp", "cp", "tp")]
        if all(r[0] == sum(c * k for c, k in zip(r[1:], st)) for r in rows):
            return lay.order
    return DIMS


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
