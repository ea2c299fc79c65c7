"""What a run's records lack for straggler localization, and what to turn on to get it.

A verdict of "no data" is only useful with its reason: which records are missing, on which ranks,
and the switch that records them. ``missing_data`` returns those reasons, most fundamental first;
the CLI renders them under its verdict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import polars as pl

from tracekit.analysis.tables import RunTables, compute_events


@dataclass(frozen=True)
class Missing:
    what: str  # layout | steps | communication | groups | peers | compute | ranks
    detail: str  # what the records lack, with counts
    turn_on: str  # what to enable or pass so that they have it

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        return f"{self.detail}; {self.turn_on}"


def missing_data(tables: RunTables) -> list[Missing]:
    """The records localization needs that this run lacks (empty: nothing is missing)."""
    out: list[Missing] = []
    backend = tables.backend
    if not tables.has_layout:
        out.append(Missing("layout", "the run's dp/pp/cp/tp sizes are unknown (no manifest layout, and "
                           "the traces' distributedInfo.pg_config does not explain them)",
                           "profile with a torch that writes distributedInfo.pg_config (2.4 or later) and build "
                           "groups with init_device_mesh(..., mesh_dim_names=...), or pass a manifest.json "
                           "with a 'layout' {dp, pp, cp, tp}"))
    world = tables.runs["world_size"][0]
    seen = set(tables.events["rank"].unique().to_list()) if tables.events.height else set()
    if world and seen and len(seen) < world:
        gone = sorted(set(range(world)) - seen)
        out.append(Missing("ranks", f"traces of {len(gone)} of {world} ranks are missing ({_ranks(gone)})",
                           "profile every rank and ingest all their traces"))
    if not tables.steps.height:
        out.append(Missing("steps", "no ProfilerStep#N spans: events cannot be put in steps",
                           "profile with a schedule (torch.profiler.schedule(...)) and call prof.step() "
                           "once per training step"))
    coll, p2p = tables.collectives, tables.p2p
    if not coll.height and not p2p.height:
        out.append(Missing("communication", "no collectives or p2p in the traces",
                           "profile the CPU (ProfilerActivity.CPU) on every rank; on NCCL add "
                           "ProfilerActivity.CUDA for the kernels"))
    unl = coll.filter(pl.col("pg_name").is_null())
    if unl.height:
        how = ("set TORCH_FR_BUFFER_SIZE (e.g. 2000) and dump torch's flight recorder per rank "
               "(torch._C._distributed_c10d._dump_fr_trace) beside the traces, so that each "
               "collective's group is recorded") if backend != "nccl" else (
               "profile with record_shapes=True so that record_param_comms carries 'Process Group Name' "
               "and 'Seq', or dump the flight recorder (TORCH_FR_BUFFER_SIZE)")
        out.append(Missing("groups", f"{unl.height} of {coll.height} collectives have no process group "
                           f"(ranks {_ranks(sorted(unl['rank'].unique().to_list()))})", how))
    nopeer = p2p.filter(pl.col("peer").is_null())
    if nopeer.height:
        out.append(Missing("peers", f"{nopeer.height} of {p2p.height} p2p ops have no peer",
                           "record the pipeline layout (a 'pp' mesh dimension or a manifest layout); on NCCL "
                           "record_param_comms carries 'Dst Rank'/'Src Rank'"))
    comp = compute_events(tables.events)
    if tables.events.height and not comp.height:
        out.append(Missing("compute", "no compute spans: no annotated fwd/bwd spans, GPU kernels or CPU ops",
                           "profile with ProfilerActivity.CPU (and CUDA on GPUs)"))
    return out


def _ranks(rs: list[int]) -> str:
    return ", ".join(str(r) for r in rs[:16]) + (" ..." if len(rs) > 16 else "")
