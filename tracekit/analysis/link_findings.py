"""Slow links as findings: those that cost at least the floor, the ones below it (named by a "no
straggler" answer), and those with a slow worker at one end (put in doubt)."""

from __future__ import annotations

from dataclasses import replace

import polars as pl

from tracekit.analysis.findings import CONFIDENCE_MAX, NEXT_STEP, Finding, named_ranks, where
from tracekit.analysis.links import CPU_TRANSPORTS
from tracekit.analysis.rootcause import peers, ratio_to_peers
from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables


def _one_cpu_host(tables: RunTables, ranks: tuple[int, ...]) -> str | None:
    """The host that every end of the link runs on, when the job's transport is the CPU's (gloo):
    there a slower "link" is its processes' share of the cores (torch-native jobs on a loaded 2-core
    machine: 4 of 14 clean runs had a 1.4-6.4x slow gloo group between two processes of one host)."""
    if tables.backend not in CPU_TRANSPORTS:
        return None
    hosts = set(tables.coords().filter(pl.col("rank").is_in(list(ranks)))["host"].to_list())
    return hosts.pop() if len(hosts) == 1 else None


def link_findings(tables: RunTables, links: pl.DataFrame, step_ns: float, metrics: pl.DataFrame) -> list[Finding]:
    out, seen = [], set()
    for row in links.filter(pl.col("slow")).iter_rows(named=True):
        ranks = tuple(int(r) for r in row["ranks"])
        if frozenset(ranks) in seen:  # both directions of one p2p pair: one link
            continue
        seen.add(frozenset(ranks))
        lay = tables.layout
        if row["link"] == "p2p":
            a, b = ranks
            place = (f"pipeline link rank {a} -> rank {b} (stage {lay.coords(a).pp} -> {lay.coords(b).pp})")
        else:
            place = where(tables, tuple(sorted(ranks)))
        conf = float(min(CONFIDENCE_MAX, 1 - 2.0 ** (-(row["z"] - row["z_bar"]) - 1)))
        summary = (f"slow link: {place} transfers {row['ratio']:.{2 if row['ratio'] < 1.5 else 1}f}x slower "
                   "than the same kind elsewhere")
        next_step = NEXT_STEP["slow_link"].format(who=named_ranks(ranks))
        host = _one_cpu_host(tables, ranks)
        if host is not None:  # measured right, but the link is the host's cores: in doubt as a link
            conf = min(conf, 0.5)
            summary += f", both ends on host {host} over a CPU transport (gloo)"
            next_step = NEXT_STEP["host_transfer"].format(who=f"host {host}")
        out.append(Finding("slow_link", ranks, place, (), row["excess_per_step_ns"],
                           row["excess_per_step_ns"] / step_ns, conf, "slow_link", summary, next_step,
                           {"link": row["name"], "ratio": row["ratio"], "z": row["z"], "z_bar": row["z_bar"],
                            "transfer_ns": row["transfer_ns"], "cpu_host": host, "compute_ratio": max(
                                (v for r in ranks if (v := ratio_to_peers(metrics, r, peers(tables, r), "compute_ns"))
                                 == v), default=float("nan"))}))
    return out


def minor_links(tables: RunTables, links: pl.DataFrame, step_ns: float, tun: Tunables) -> str:
    """Links that are measurably slower but cost less than the reporting floor: not findings, but
    a "no straggler" answer should not hide them."""
    minor = links.filter(~pl.col("slow") & (pl.col("ratio") >= tun.slow_link_ratio) & (pl.col("z") >= pl.col("z_bar"))
                         & (pl.col("excess_per_step_ns") > 0)).head(3)
    parts = []
    for row in minor.iter_rows(named=True):
        ranks = tuple(sorted(int(r) for r in row["ranks"]))
        ends = " -> rank ".join(str(r) for r in row["ranks"])
        place = f"p2p rank {ends}" if row["link"] == "p2p" else where(tables, ranks)
        # two decimals: a link at 0.99% of a step is below the 1% floor, and "(1.0%)" read as at it
        parts.append(f"{place} transfers {row['ratio']:.2f}x slower, costing {row['excess_per_step_ns'] / 1e6:.1f} ms "
                     f"per step ({row['excess_per_step_ns'] / step_ns:.2%})")
    floor = f"{tun.link_effect_min_frac:.0%} of a step"
    if tables.backend not in CPU_TRANSPORTS:
        floor += f"; {tun.link_broken_min_frac:.1%} for a link {tun.link_broken_ratio:g}x slower"
    return (f"below the reporting floor ({floor}): " + "; ".join(parts)) if parts else ""


def links_beside_stragglers(findings: list[Finding]) -> list[Finding]:
    """A slow link one of whose ends is itself a slow worker may be slow because of it: a slower
    device (or process, on CPUs) runs its communication slower too (torch-native jobs on gloo: the
    slow rank's own TP group came out a 1.4-3.2x slow link in 3 of 14 runs). The link is kept, said
    to be in doubt, at confidence at most 0.5, and the worker comes first."""
    workers = {r for f in findings if f.kind == "straggler" and f.cause == "slow_compute" for r in f.ranks}
    out = []
    for f in findings:
        inside = sorted(r for r in f.ranks if r in workers) if f.kind == "slow_link" else []
        if inside:
            who = ", ".join(f"rank {r}" for r in inside)
            f = replace(f, confidence=min(f.confidence, 0.5),
                        summary=f"{f.summary}, but {who} in it computes slowly, which can slow its transfers too",
                        next_step=f"first fix {who} (the slow worker), then check whether this link is still slow; "
                                  + f.next_step, evidence={**f.evidence, "straggler_in_link": inside})
        out.append(f)
    return out
