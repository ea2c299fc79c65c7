"""Self-test: do real gloo collectives still add in the order ``numerics.reduction_order`` models?

The ring model pins gloo internals (segment sizes, chunk ownership, add order). A torch or gloo
upgrade may change them silently, and every bit-exact check built on the model would then fail for
the wrong reason. This module spawns real gloo ranks (one process group of ``world_size`` ranks with
sub-groups of 2, 3, 4 and 8 ranks, strided ones included so group-local indexing is exercised), runs
all-reduce and reduce-scatter (SUM and AVG) plus the canonical-order collectives on inputs that
cross the segment boundaries, and compares every rank's result with the models bit for bit.

Each case also records how many elements differ from the *other* order's model, which shows the
inputs are able to tell the orders apart (for n >= 3; with two ranks every order is the same sum).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import polars as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from numerics.canonical_comm import canonical_all_reduce_, canonical_reduce_scatter
from numerics.compare import bit_mismatches
from numerics.reduction_order import ORDERS, ring_plan

DEFAULT_GROUPS: tuple[tuple[int, ...], ...] = ((0, 1), (2, 5, 7), (0, 2, 4, 6), tuple(range(8)))
# Element counts: a single element, fewer elements than segments, an odd size spanning segments, and
# one large odd size (> 1 MiB) whose segment count is set by bytes (more than 2n MiB) and rounded up
# to a multiple of n for small groups.
DEFAULT_SIZES: dict[str, tuple[int, ...]] = {
    "float32": (1, 7, 1001, 1_800_001),  # 7.2 MB: 8 segments for n=2, 9 for n=3
    "bfloat16": (1, 7, 1001, 2_200_001),  # 4.4 MB: 6 segments for n=2
}
# (collective, op, order the real call follows)
COLLECTIVES = (
    ("all_reduce", "sum", "gloo_ring"),
    ("all_reduce", "avg", "gloo_ring"),
    ("reduce_scatter", "sum", "gloo_ring"),
    ("reduce_scatter", "avg", "gloo_ring"),
    ("all_reduce", "sum", "canonical"),
    ("all_reduce", "avg", "canonical"),
    ("reduce_scatter", "sum", "canonical"),
)
_REAL_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GlooModelMismatch(AssertionError):
    """The installed torch/gloo no longer adds in the modelled order."""


@dataclass(frozen=True)
class Case:
    case_id: int
    data_id: int  # cases sharing a data_id reduce the same inputs (generated once per rank)
    ranks: tuple[int, ...]
    collective: str
    op: str
    order: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class CaseResult:
    case_id: int
    rank: int
    n: int
    collective: str
    op: str
    order: str
    dtype: str
    numel: int
    num_segments: int
    mismatches: int  # real result vs the model of the order it follows: must be 0
    other_order_mismatches: int  # real result vs the other order's model: > 0 shows the inputs discriminate


def make_cases(groups: Sequence[Sequence[int]], sizes: dict[str, Sequence[int]]) -> list[Case]:
    cases = []
    data = [(tuple(ranks), dtype, numel) for ranks in groups for dtype, numels in sizes.items() for numel in numels]
    for data_id, (ranks, dtype, numel) in enumerate(data):
        n = len(ranks)
        for collective, op, order in COLLECTIVES:
            # reduce_scatter splits dim 0 into n equal slices: round the size up to a multiple of n
            size = -(-numel // n) * n if collective == "reduce_scatter" else numel
            cases.append(Case(len(cases), data_id, ranks, collective, op, order, dtype, size))
    return cases


def case_inputs(case: Case) -> list[torch.Tensor]:
    """Deterministic inputs of every group rank (long enough for all cases of the same data_id):
    normals spread over 13 binades so that additions round often and orders can be told apart."""
    n = len(case.ranks)
    numel = -(-case.numel // n) * n
    inputs = []
    for group_rank in range(n):
        gen = torch.Generator().manual_seed(1_000_003 * case.data_id + group_rank)
        x = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-6, 7, (numel,), generator=gen).float())
        inputs.append(x.to(getattr(torch, case.dtype)))
    return inputs


def _real(case: Case, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = len(case.ranks)
    if case.collective == "all_reduce":
        out = x.clone()
        if case.order == "canonical":
            canonical_all_reduce_(out, case.op, group)
        else:
            dist.all_reduce(out, op=_REAL_OP[case.op], group=group)
        return out
    out = torch.empty(case.numel // n, dtype=x.dtype)
    if case.order == "canonical":
        canonical_reduce_scatter(out, x, case.op, group)
    else:
        _reduce_scatter_single(out, x, op=_REAL_OP[case.op], group=group)
    return out


def _model(case: Case, order: str, inputs: list[torch.Tensor], me: int) -> torch.Tensor:
    model = ORDERS[order]
    if case.collective == "all_reduce":
        return model.all_reduce(inputs, case.op)
    return model.reduce_scatter(inputs, case.op)[me]


def _worker(rank: int, world_size: int, init_file: str, cases: list[Case], out_dir: str, timeout_s: float) -> None:
    torch.set_num_threads(1)  # thread count changes bits of some kernels; pin it everywhere
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    groups = {}
    for ranks in dict.fromkeys(c.ranks for c in cases):  # every rank creates every group, same order
        groups[ranks] = dist.new_group(list(ranks))
    results = []
    data_id, data = None, []
    for case in cases:
        if rank not in case.ranks:
            continue
        me, n = case.ranks.index(rank), len(case.ranks)
        if case.data_id != data_id:
            data_id, data = case.data_id, case_inputs(case)
        inputs = [x[: case.numel] for x in data]
        real = _real(case, inputs[me], groups[case.ranks])
        other = "canonical" if case.order == "gloo_ring" else "gloo_ring"
        x = inputs[0]
        results.append(
            CaseResult(
                case.case_id, rank, n, case.collective, case.op, case.order, case.dtype, case.numel,
                ring_plan(x.numel(), x.element_size(), n).num_segments,
                bit_mismatches(real, _model(case, case.order, inputs, me)),
                bit_mismatches(real, _model(case, other, inputs, me)),
            )
        )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps([asdict(r) for r in results]))
    dist.barrier()
    dist.destroy_process_group()


@dataclass(frozen=True)
class SelfTestReport:
    torch_version: str
    results: tuple[CaseResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.mismatches == 0 for r in self.results)

    def table(self) -> pl.DataFrame:
        return pl.DataFrame([asdict(r) for r in self.results]).sort(["case_id", "rank"])

    def failures(self) -> pl.DataFrame:
        return self.table().filter(pl.col("mismatches") > 0)


def run_gloo_selftest(
    world_size: int = 8,
    groups: Sequence[Sequence[int]] = DEFAULT_GROUPS,
    sizes: dict[str, Sequence[int]] | None = None,
    timeout_s: float = 300.0,
) -> SelfTestReport:
    """Run every case on real gloo ranks (spawned processes) and return per-rank results."""
    for ranks in groups:
        if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0 or max(ranks) >= world_size:
            raise ValueError(f"group {tuple(ranks)} is not a set of ranks of a {world_size}-rank world")
    cases = make_cases(groups, DEFAULT_SIZES if sizes is None else sizes)
    with tempfile.TemporaryDirectory(prefix="numerics-selftest-") as tmp:
        try:
            mp.spawn(_worker, args=(world_size, str(Path(tmp, "store")), cases, tmp, timeout_s), nprocs=world_size)
        except Exception as exc:  # a crashed or hung rank: surface what happened, with context
            raise RuntimeError(f"gloo self-test ranks failed ({world_size} ranks): {exc}") from exc
        results = [CaseResult(**r) for rank in range(world_size) for r in json.loads(Path(tmp, f"rank{rank}.json").read_text())]
    expected = sum(len(c.ranks) for c in cases)
    if len(results) != expected:
        raise RuntimeError(f"gloo self-test returned {len(results)} per-rank results, expected {expected}")
    return SelfTestReport(torch.__version__, tuple(results))


def check_gloo_matches_model(report: SelfTestReport) -> None:
    """Raise GlooModelMismatch, with the failing cases, unless every real result matched its model."""
    if report.ok:
        return
    bad = report.failures()
    with pl.Config(tbl_rows=40, tbl_cols=-1, tbl_width_chars=200):
        raise GlooModelMismatch(
            f"the installed torch {report.torch_version} / gloo no longer matches the reduction-order model in "
            f"numerics/reduction_order.py: {bad.height} rank results of {len(report.results)} differ bitwise. "
            f"Bit-exact numerics checks that emulate gloo collectives are invalid until the model is updated "
            f"(or the run is switched to the canonical order).\n{bad}"
        )


def assert_gloo_matches_model(**kwargs) -> SelfTestReport:
    """pytest-friendly: run the self-test (``run_gloo_selftest`` arguments) and raise
    GlooModelMismatch unless every real result matches its model."""
    report = run_gloo_selftest(**kwargs)
    check_gloo_matches_model(report)
    return report
