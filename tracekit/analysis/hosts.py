"""A slow host: slow workers that make up one host are one finding, of the host.

Several GPUs of one machine slowing down together point at what they share (the host's CPUs and
memory, its power and cooling, a PCIe switch), not at each GPU: eight findings that each say "drain
the node of rank r" for the same node, each costing its own 10% of a step, misstate both what to do
and what it costs. The ranks of one host run side by side, so the job loses about what the slowest
of them adds, not the sum: the finding costs what the job would save with all of them at their
peers' speed (the what-if replay), or, where the run cannot be replayed, the largest member's.

Merged: persistent slow workers (cause ``slow_compute``) that are every rank the run holds on a
host, or at least ``HOST_MIN_RANKS`` and half of them (a socket or PCIe switch serves half a
machine); transient ones likewise where they share their steps. A job on one host has no other
host to set it against: nothing is merged there.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from tracekit.analysis.findings import Finding, where
from tracekit.analysis.tables import RunTables

HOST_MIN_RANKS = 3  # below every rank of its host, a host finding needs this many slow ranks
NEXT_STEP_HOST = ("drain or test host {host} (CPU load and memory bandwidth, power and thermal limits, PCIe and "
                  "NVLink errors, then `nvidia-smi -q` on each of its GPUs); rerun without it to confirm")


def slow_hosts(findings: list[Finding], tables: RunTables, step_ns: float) -> list[Finding]:
    """``findings`` with each host's slow workers merged into one finding of the host."""
    hosts = tables.ranks.select("rank", "host").drop_nulls()
    host_of = {int(r): str(h) for r, h in hosts.iter_rows() if h}
    if len(set(host_of.values())) < 2:
        return findings
    members: dict[str, set[int]] = defaultdict(set)
    for r, h in host_of.items():
        members[h].add(r)
    groups: dict[tuple, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind in ("straggler", "transient") and f.cause == "slow_compute" and len(f.ranks) == 1 \
                and f.ranks[0] in host_of:
            groups[(host_of[f.ranks[0]], f.kind, f.steps if f.kind == "transient" else ())].append(f)
    merged: list[Finding] = []
    gone: set[int] = set()
    for (host, kind, _), fs in groups.items():
        ranks = sorted(f.ranks[0] for f in fs)
        held = members[host]
        if not (len(ranks) >= 2 and set(ranks) == held
                or len(ranks) >= HOST_MIN_RANKS and 2 * len(ranks) >= len(held)):
            continue
        merged.append(_host_finding(tables, host, kind, fs, ranks, len(held), step_ns))
        gone |= {id(f) for f in fs}
    if not merged:
        return findings
    return merged + [f for f in findings if id(f) not in gone]


def _host_finding(tables: RunTables, host: str, kind: str, fs: list[Finding], ranks: list[int], held: int,
                  step_ns: float) -> Finding:
    from tracekit.analysis.whatif import WhatIfError, saving

    ratios = [float(f.evidence.get("compute_ratio", float("nan"))) for f in fs]
    steps = fs[0].steps
    cost, share, how = max(f.cost_ns for f in fs), max(f.cost_ns for f in fs) / step_ns, "the costliest rank"
    try:  # all of them at their peers' speed at once: their costs overlap, they do not add
        saved, saved_share = saving(tables, ranks, list(steps) if kind == "transient" else None)
        cost, share, how = max(saved, 0.0), max(saved_share, 0.0), "what-if replay"
    except WhatIfError:
        pass
    lo, hi = min(ratios), max(ratios)
    span = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"
    every = (f"each of its {held} ranks computes {span} its peers" if len(ranks) == held
             else f"{len(ranks)} of its {held} ranks compute {span} their peers")
    place = f"host {host}: {where(tables, tuple(ranks))}"
    what = "is slow" if kind == "straggler" else "is slow in some steps"
    summary = f"{place} {what}: {every}: one slow machine, not {len(ranks)} slow GPUs"
    return Finding(kind, tuple(ranks), place, steps, cost, share, min(f.confidence for f in fs), "slow_compute",
                   summary, NEXT_STEP_HOST.format(host=host),
                   {"host": host, "host_ranks": held, "compute_ratio": hi, "compute_ratios": dict(zip(ranks, ratios)),
                    "cost_from": how, "members": [f.to_dict() for f in sorted(fs, key=lambda f: f.ranks)]})
