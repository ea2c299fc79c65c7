"""A slow host: found as a whole where it is half of every stage (``slow_host_ranks``), and its
slow workers made one finding of the host (``slow_hosts``).

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

import math
import warnings
from collections import defaultdict

import numpy as np
import polars as pl

from tracekit.analysis.findings import Finding, where
from tracekit.analysis.standout import biweight_spread
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables

HOST_MIN_RANKS = 3  # below every rank of its host, a host finding needs this many slow ranks
# A host slow as a whole, tested against the other hosts (slow_host_ranks): its ranks' typical
# effect over the other hosts' by at least this ratio (a host's median over its ranks moves by a
# fraction of a percent with kernel noise or chips that differ), and this share of its ranks past
# halfway between the two levels
HOST_MIN_RATIO = 1.05
HOST_UNIFORM_SHARE = 0.75
NEXT_STEP_HOST = ("drain or test host {host} (CPU load and memory bandwidth, power and thermal limits, PCIe and "
                  "NVLink errors, then `nvidia-smi -q` on each of its GPUs); rerun without it to confirm")


def _host_of(tables: RunTables) -> dict[int, str]:
    return {int(r): str(h) for r, h in tables.ranks.select("rank", "host").drop_nulls().iter_rows() if h}


def slow_host_ranks(speed: pl.DataFrame, tables: RunTables,
                    tun: Tunables = Tunables()) -> dict[str, tuple[frozenset[int], float]]:
    """The ranks of hosts slow as a whole, from ``compute_speed``'s first look. Each rank is
    compared with its stage peers' median; where one host is half of every stage (one of two
    hosts), that median is half slow, the ranks' effects split in two, and against that spread no
    rank stands out on its own (a 1.1x host of a cp 2 x dp 8 job went unseen; with two ranks a
    stage, each slow rank was called moving at 0.99). So hosts are compared as wholes: a host's
    level (the median of its ranks' median steps) against the other hosts' ranks', in units of
    the two medians' standard errors (from the ranks' spread within their hosts) or, with three
    hosts or more, of the other hosts' levels' spread, whichever is larger, against the bar the
    ranks' own test uses for that many hosts. Faults only slow, so of two hosts the slower is the
    one, where most of its ranks are past halfway between the two levels. Returned, per such host:
    all of its ranks (to be left out of every reference and judged each on its own) and how sure
    the host test is (``margin_confidence`` of its margin)."""
    from tracekit.analysis.culprits import _table, margin_confidence

    host_of = _host_of(tables)
    if len(set(host_of.values())) < 2 or not speed.height:
        return {}
    ranks, _, mat = _table(speed)
    if mat.shape[0] < tun.compute_min_steps:
        return {}
    e = mat - np.nanmedian(mat, axis=1, keepdims=True)
    # each rank's median step: a host slow in every step moves it, ranks slow in some steps do not
    # (three ranks of a host of four taking turns at 1.5x passed as a slow host by their trimmed
    # means, and the moving straggler went unseen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank without steps: NaN, left out below
        effects = np.nanmedian(e, axis=0)
    by_host: dict[str, list[int]] = defaultdict(list)
    for j, r in enumerate(ranks):
        if r in host_of and math.isfinite(effects[j]):
            by_host[host_of[r]].append(j)
    by_host = {h: js for h, js in by_host.items() if len(js) >= 2}
    if len(by_host) < 2:
        return {}
    level = {h: float(np.median(effects[js])) for h, js in by_host.items()}
    within = biweight_spread(np.concatenate([effects[js] - level[h] for h, js in by_host.items()]))
    bar = tun.host_margin_min + tun.compute_margin_per_log * math.log(max(1.0, len(by_host) / 2))
    slow: dict[str, tuple[frozenset[int], float]] = {}
    for h, js in by_host.items():
        rest = [j for g, ks in by_host.items() if g != h for j in ks]
        base = float(np.median(effects[rest]))
        gap = level[h] - base
        others = [level[g] for g in by_host if g != h]
        se = 1.2533 * within * math.sqrt(1 / len(js) + 1 / len(rest))  # a median's, 1.25x a mean's
        unit = max(se, biweight_spread(np.array(others)) if len(others) >= 2 else 0.0, tun.compute_noise_floor)
        past = [j for j in js if effects[j] > base + gap / 2]
        if gap / unit >= bar and gap >= math.log(HOST_MIN_RATIO) and len(past) >= HOST_UNIFORM_SHARE * len(js):
            # all of its ranks out of the references: each is then judged on its own against healthy
            # ones (at 15% noise two of a 1.1x host's eight fell short of halfway, were measured
            # against the host's own ranks, and came out 'moving')
            slow[h] = frozenset(ranks[j] for j in js), margin_confidence(gap / unit, bar, len(past) / len(js))
    return slow


def slow_hosts(findings: list[Finding], tables: RunTables, step_ns: float,
               whole: dict[str, tuple[frozenset[int], float]] | None = None) -> list[Finding]:
    """``findings`` with each host's slow workers merged into one finding of the host. ``whole``:
    hosts found slow as wholes (``slow_host_ranks``): named with every rank they hold, at the host
    test's confidence, their ranks' own findings folded in (at 15% noise, two of a 1.1x host's eight
    ranks fell short of the ranks' own bar, one of them then 'moving')."""
    host_of = _host_of(tables)
    if len(set(host_of.values())) < 2:
        return findings
    members: dict[str, set[int]] = defaultdict(set)
    for r, h in host_of.items():
        members[h].add(r)
    merged: list[Finding] = []
    gone: set[int] = set()
    for host, (_, sure) in (whole or {}).items():
        mine = [f for f in findings if f.kind in ("straggler", "transient", "moving") and f.cause == "slow_compute"
                and len(f.ranks) == 1 and host_of.get(f.ranks[0]) == host]
        persistent = [f for f in mine if f.kind == "straggler"]
        if persistent:
            merged.append(_host_finding(tables, host, "straggler", persistent, sorted(members[host]),
                                        len(members[host]), step_ns, sure))
            gone |= {id(f) for f in mine}
    groups: dict[tuple, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind in ("straggler", "transient") and f.cause == "slow_compute" and len(f.ranks) == 1 \
                and f.ranks[0] in host_of and id(f) not in gone:
            groups[(host_of[f.ranks[0]], f.kind, f.steps if f.kind == "transient" else ())].append(f)
    for (host, kind, _), fs in groups.items():
        ranks = sorted(f.ranks[0] for f in fs)
        held = members[host]
        if not (len(ranks) >= 2 and set(ranks) == held
                or len(ranks) >= HOST_MIN_RANKS and 2 * len(ranks) >= len(held)):
            continue
        merged.append(_host_finding(tables, host, kind, fs, ranks, len(held), step_ns, min(f.confidence for f in fs)))
        gone |= {id(f) for f in fs}
    if not merged:
        return findings
    return merged + [f for f in findings if id(f) not in gone]


def _host_finding(tables: RunTables, host: str, kind: str, fs: list[Finding], ranks: list[int], held: int,
                  step_ns: float, confidence: float) -> Finding:
    """The host's finding over ``ranks``, from its ranks' own findings ``fs`` (their ratios: where
    the host was found as a whole, some of its ranks may have none)."""
    from tracekit.analysis.whatif import WhatIfError, saving

    by_rank = {f.ranks[0]: float(f.evidence.get("compute_ratio", float("nan"))) for f in fs}
    ratios = list(by_rank.values())
    steps = fs[0].steps
    costliest = max(fs, key=lambda f: f.cost_ns)
    cost, share, how, bound = costliest.cost_ns, costliest.cost_ns / step_ns, "the costliest rank", \
        costliest.cost_upper_bound
    try:  # all of them at their peers' speed at once: their costs overlap, they do not add
        saved, saved_share = saving(tables, ranks, list(steps) if kind == "transient" else None)
        cost, share, how, bound = max(saved, 0.0), max(saved_share, 0.0), "what-if replay", False
    except WhatIfError:
        pass
    lo, hi = min(ratios), max(ratios)
    span = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"
    every = (f"each of its {held} ranks computes {span} its peers" if len(fs) == len(ranks) == held
             else f"{len(ranks)} of its {held} ranks compute {span} their peers" if len(fs) == len(ranks)
             else f"its {len(ranks)} ranks are slower than the other hosts' as a whole, {len(fs)} of them beyond noise "
                  f"on their own ({span} their peers)")
    place = f"host {host}: {where(tables, tuple(ranks))}"
    what = "is slow" if kind == "straggler" else "is slow in some steps"
    summary = f"{place} {what}: {every}: one slow machine, not {len(ranks)} slow GPUs"
    return Finding(kind, tuple(ranks), place, steps, cost, share, confidence, "slow_compute",
                   summary, NEXT_STEP_HOST.format(host=host),
                   {"host": host, "host_ranks": held, "compute_ratio": hi, "compute_ratios": by_rank,
                    "cost_from": how, "members": [f.to_dict() for f in sorted(fs, key=lambda f: f.ranks)]},
                   cost_upper_bound=bound)
