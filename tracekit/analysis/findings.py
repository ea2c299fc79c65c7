"""What a finding is (``Finding``), what to do about each cause (``NEXT_STEP``), and how a place in
the job is named (``where``: coordinates, or a group by dimension and members): shared by the
diagnosis and its link findings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tracekit.analysis.hangs import rank_list
from tracekit.analysis.tables import RunTables

# No answer is certain, a finding or "no straggler": a confidence stops here (and never prints 1.00)
CONFIDENCE_MAX = 0.99

LISTED_MAX = 16  # members named one by one; a longer group by its count, ranges or stride (rank_list)


def named_ranks(ranks) -> str:
    """'ranks [4, 12]', or for more than LISTED_MAX '64 ranks [100, 356, ..., 16228] (stride 256)'."""
    return f"ranks {list(ranks)}" if len(ranks) <= LISTED_MAX else rank_list(ranks)

NEXT_STEP = {
    "slow_compute": "drain or test the node of {who} (GPU clocks and thermals, ECC/XID errors, `nvidia-smi -q`); "
                    "rerun without it to confirm",
    "cpu_bound": "profile the host side of {who} (data loader, CPU contention, Python GC, launch overhead)",
    "slow_link": "test the link between {who} (nccl-tests between those hosts, NIC/switch port error counters)",
    "host_transfer": "look at what else runs on {who}'s cores (load, thread counts, process pinning): a CPU "
                     "backend's transfers within one host are CPU work, and run slower when its cores are busy",
    "data_imbalance": "balance the work: per-document CP sharding or variable-length packing (WLB-LLM)",
    "stage_imbalance": "rebalance the pipeline: move layers off stage {who} (Llama 3 sheds a layer on the first "
                       "and last stage); if it holds no more layers than the others, test its nodes instead: "
                       "slow devices on every rank of a stage look the same in step times",
    "hang": "run `tracekit hangs` on this run, and dump the stack of {who} (py-spy dump) at the stuck collective",
    "unexplained": "profile {who} with more detail (CPU ops, kernels) to see where the time goes",
    "late_no_trace": "profile {who} too (its trace is missing, so why it is late is unknown), and meanwhile test "
                     "its node (GPU clocks and thermals, ECC/XID errors, `nvidia-smi -q`); rerun without it to confirm",
}


@dataclass(frozen=True)
class Finding:
    kind: str  # straggler | transient | moving | slow_link | stage_imbalance | data_imbalance | cpu_bound | hang
    ranks: tuple[int, ...]
    where: str  # coordinates, group or pair, named by member ranks
    steps: tuple[int, ...]  # the steps it shows in
    cost_ns: float  # per step it shows in
    cost_share: float  # of the median step time
    confidence: float
    cause: str  # the Cause kind behind it
    summary: str
    next_step: str
    evidence: dict = field(default_factory=dict)  # the cause's measurements (ratios, links, work)
    # the cost is what the finding adds at most (its extra compute, or waits the pipeline's slack
    # may absorb): the step grows by that much or less
    cost_upper_bound: bool = False

    def cost_text(self) -> str:
        """'15.4 ms per step (13.8%)', or 'at most ...' where the cost is an upper bound."""
        return f"{'at most ' if self.cost_upper_bound else ''}{self.cost_ns / 1e6:.1f} ms per step ({self.cost_share:.1%})"

    def to_dict(self) -> dict:
        evidence = {k: None if isinstance(v, float) and v != v else v for k, v in self.evidence.items()}
        return {**asdict(self), "ranks": list(self.ranks), "steps": list(self.steps), "evidence": evidence}


def where(tables: RunTables, ranks: tuple[int, ...]) -> str:
    lay = tables.layout
    if len(ranks) == 1:
        c = lay.coords(ranks[0]).as_dict()
        return f"rank {ranks[0]} (" + ", ".join(f"{d} {v}" for d, v in c.items() if getattr(lay, d) > 1) + ")"
    dim = lay.dim_of(ranks) if max(ranks) < lay.world_size else None
    if dim and "_" not in dim:  # one dimension's group; a combined one reads better as shared coordinates
        # a DP group of a 16,384-rank job has 64 members: by count and stride
        return f"{dim.upper()} group of {rank_list(ranks)}" if len(ranks) > LISTED_MAX else f"{dim.upper()} group {list(ranks)}"
    values = {d: {getattr(lay.coords(r), d) for r in ranks} for d in ("dp", "pp", "cp", "tp") if getattr(lay, d) > 1}
    shared = [f"{d} {next(iter(v))}" for d, v in values.items() if len(v) == 1]
    return named_ranks(ranks) + (f" (all {', '.join(shared)})" if shared else "")
