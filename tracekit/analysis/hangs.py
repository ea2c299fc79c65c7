"""Hang diagnosis from flight-recorder entries: where did the ranks stop, and who never joined?

Every rank's flight recorder lists the collectives it entered, per process group, with a
per-group ``collective_seq_id`` and a state (scheduled, started, completed). In a hang, the
group's members disagree: some entered instance ``seq`` and wait in it; the others never reached it
(they are stuck earlier, in another group, or in compute). Per group, the stuck instance is the
first one not completed by every member that recorded anything; without completion states (torch's
gloo recorder often leaves entries "scheduled"), it is the furthest instance any member entered,
and the members that did not enter it never joined. Members with no dump at all are "no record".
p2p entries (``p2p_seq_id``) are checked the same way per group. Ring buffers keep only the newest
entries, so only the maximum sequence per rank is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import polars as pl

from tracekit.analysis.damaged import describe



def rank_list(ranks, shown: int = 16) -> str:
    """Ranks for a sentence: the list up to ``shown`` of them, else their count and contiguous
    ranges (a hang in a 16,384-rank job blocks thousands), or their stride where they are evenly
    spaced (a DP group of 64 ranks of such a job, one in every 256)."""
    ranks = sorted(int(r) for r in ranks)
    if len(ranks) <= shown:
        return str(ranks)
    gaps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(gaps) == 1 and (stride := gaps.pop()) > 1:
        return f"{len(ranks):,} ranks [{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] (stride {stride})"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    text = ", ".join(parts[:8]) + (f", ... ({len(parts) - 8} more ranges)" if len(parts) > 8 else "")
    return f"{len(ranks):,} ranks [{text}]"

@dataclass(frozen=True)
class StuckCollective:
    pg_name: str
    pg_desc: str | None
    seq: int
    op: str
    members: tuple[int, ...]
    joined: tuple[int, ...]  # entered the instance (and wait in it)
    missing: tuple[int, ...]  # recorded the group but never entered the instance
    no_record: tuple[int, ...]  # members without any flight-recorder entry for this group
    last_seq: dict[int, int]  # per member, the furthest instance it entered

    def to_dict(self) -> dict:
        return {"pg_name": self.pg_name, "pg_desc": self.pg_desc, "seq": self.seq, "op": self.op,
                "members": list(self.members), "joined": list(self.joined), "missing": list(self.missing),
                "no_record": list(self.no_record), "last_seq": {str(k): v for k, v in self.last_seq.items()}}


@dataclass(frozen=True)
class HangReport:
    ranks_with_records: tuple[int, ...]
    stuck: list[StuckCollective] = field(default_factory=list)
    # ranks whose newest entry never completed (waiting in a collective or a p2p op), with that op
    waiting: dict[int, str] = field(default_factory=dict)
    world_size: int | None = None
    # ranks without flight-recorder data (none recorded, or their dump failed to ingest) -> why:
    # named as such, never taken for culprits (a rank that holds the job may be one of them)
    damaged: dict[int, str] = field(default_factory=dict)

    @property
    def hung(self) -> bool:
        return bool(self.stuck)

    @property
    def culprits(self) -> tuple[int, ...]:
        """Ranks that never joined a collective others wait in and are not themselves waiting in
        any operation (a stuck collective, or a p2p receive from a hung stage): the ones holding the
        job. Only when no recorded rank is such are the members without any record named (a rank
        that died leaves no dump). Damaged ranks (their data failed to ingest) are never named:
        ``no_data`` lists them with the ranks that recorded nothing."""
        waiting = {r for s in self.stuck for r in s.joined} | set(self.waiting)
        absent = {r for s in self.stuck for r in s.missing} - set(self.damaged)
        silent = {r for s in self.stuck for r in s.no_record} - set(self.damaged)
        return tuple(sorted(absent - waiting)) or tuple(sorted(silent)) or \
            tuple(sorted(absent - {r for s in self.stuck for r in s.joined}))

    @property
    def blocked(self) -> tuple[int, ...]:
        """Ranks waiting behind the culprits: in the stuck collectives, or in other operations."""
        waiting = {r for s in self.stuck for r in s.joined} | set(self.waiting)
        return tuple(sorted(waiting - set(self.culprits)))

    @property
    def no_data(self) -> tuple[int, ...]:
        """Ranks with no flight-recorder entry at all, or whose data failed to ingest (``damaged``)."""
        silent = set(self.damaged)
        if self.world_size:
            silent |= {r for r in range(self.world_size) if r not in set(self.ranks_with_records)}
        else:
            silent |= {r for s in self.stuck for r in s.no_record}
        return tuple(sorted(silent))

    @property
    def headline(self) -> str:
        text = self._verdict()
        silent = {r: self.damaged.get(r, "no flight-recorder entries") for r in self.no_data} if self.stuck \
            else self.damaged
        return text + (f"; without data: {describe(silent)}" if silent else "")

    def _verdict(self) -> str:
        if not self.ranks_with_records:
            return "no flight-recorder entries: nothing to say about hangs"
        if not self.stuck:
            return f"no hang: every group's members reached the same collective ({len(self.ranks_with_records)} ranks)"
        s = self.stuck[0]
        never = sorted({*s.missing, *s.no_record} - set(self.damaged))
        text = (f"hang in {s.op} #{s.seq} of group {s.pg_desc or s.pg_name} {rank_list(s.members)}: ranks "
                f"{rank_list(s.joined)} "
                f"wait, " + (f"ranks {never} never joined" if never else "no rank with data is absent")
                + (f"; culprit(s): {list(self.culprits)}" if self.culprits else
                   "; the culprit is among the ranks without data"))
        behind = [r for r in self.blocked if r not in s.joined]
        if behind:
            text += f"; blocked behind them in other operations: {rank_list(behind)}"
        return text

    def to_dict(self) -> dict:
        return {"headline": self.headline, "hung": self.hung, "culprits": list(self.culprits),
                "blocked": list(self.blocked), "no_data": list(self.no_data),
                "waiting": {str(k): v for k, v in self.waiting.items()},
                "damaged": {str(r): why for r, why in self.damaged.items()},
                "ranks_with_records": list(self.ranks_with_records), "stuck": [s.to_dict() for s in self.stuck]}


def _op(profiling_name: str | None) -> str:
    name = profiling_name or "?"
    name = name.split(":", 1)[1] if ":" in name else name
    return name.split(" ", 1)[0]


def _waiting(fr: pl.DataFrame) -> dict[int, str]:
    """Per rank, the operation it waits in: its newest entry, when that never completed (only where
    the recorder keeps completion states; torch's gloo recorder leaves every entry 'scheduled')."""
    if not fr.filter(pl.col("state") == "completed").height:
        return {}
    # newest by the recorder's own order (record_id), its creation time only where that is missing:
    # a batched send and receive can be stamped out of order (a receive 15 us before the send
    # recorded ahead of it), and a rank waiting in that receive then looked idle, a culprit
    have = [c for c in ("record_id", "time_created_ns") if c in fr.columns]
    if not have:
        return {}
    newest = fr.sort(have, nulls_last=False, maintain_order=True).group_by("rank", maintain_order=True).last()
    open_ = newest.filter(pl.col("state") != "completed")
    return {int(r): f"{_op(n)} in group {g}" for r, n, g in open_.select("rank", "profiling_name", "pg_name").iter_rows()}


def diagnose_hang(fr_entries: pl.DataFrame, groups: pl.DataFrame, world_size: int | None = None,
                  damaged: Mapping[int, str] | None = None) -> HangReport:
    """The collectives where ranks stopped. ``groups`` (pg_name, pg_desc, ranks) gives membership;
    a group it lacks gets the ranks that recorded it. ``damaged``: ranks without usable
    flight-recorder data and why (tracekit.analysis.damaged), named and never taken for culprits."""
    damaged = dict(damaged or {})
    if not fr_entries.height:
        return HangReport((), world_size=world_size, damaged=damaged)
    fr = fr_entries.with_columns(
        pl.col("rank").cast(pl.Int64),
        pl.when(pl.col("is_p2p").fill_null(False)).then(pl.col("p2p_seq_id")).otherwise(
            pl.col("collective_seq_id")).alias("seq"),
        pl.col("state").fill_null("").alias("state"),
    ).drop_nulls("seq")
    members = {n: sorted(int(x) for x in r) for n, r in
               groups.select("pg_name", "ranks").drop_nulls().unique("pg_name").iter_rows()} if groups.height else {}
    descs = dict(groups.select("pg_name", "pg_desc").unique("pg_name").iter_rows()) if groups.height else {}
    have_completion = bool(fr.filter(pl.col("state") == "completed").height)
    stuck: list[StuckCollective] = []
    for (pg, p2p), g in fr.group_by("pg_name", "is_p2p", maintain_order=True):
        if p2p:  # a p2p sequence counts per pair, not per group: skip unless it is a 2-rank group
            if len(members.get(pg, g["rank"].unique().to_list())) != 2:
                continue
        mem = members.get(pg) or sorted(g["rank"].unique().to_list())
        last = dict(g.group_by("rank").agg(pl.col("seq").max()).iter_rows())
        done = dict(g.filter(pl.col("state") == "completed").group_by("rank").agg(pl.col("seq").max()).iter_rows())
        recorded = [r for r in mem if r in last]
        if have_completion:
            # the recorder keeps a ring buffer: a rank whose completed entries of this group fell out
            # of it completed everything before its oldest entry still there
            oldest = dict(g.group_by("rank").agg(pl.col("seq").min()).iter_rows())
            first_open = min(done.get(r, oldest[r] - 1) + 1 for r in recorded)
            if all(done.get(r, -1) >= last[r] for r in recorded) and len(set(last.values())) == 1:
                # everyone recorded completed all it entered: nothing is stuck here (a collective
                # completes only with every member, so a member without records took part in them;
                # its records are missing, which ``no_data`` says)
                continue
            seq = first_open
        else:
            seq = max(last.values())
            if all(last[r] == seq for r in recorded) and len(recorded) == len(mem):
                continue
        joined = tuple(r for r in recorded if last[r] >= seq)
        missing = tuple(r for r in recorded if last[r] < seq)
        no_record = tuple(r for r in mem if r not in last)
        if not missing and not no_record:
            if not have_completion:
                continue
            # everyone entered; nobody finished: a stall inside the collective (e.g. a dead link)
        row = g.filter(pl.col("seq") == seq).head(1)
        op = _op(row["profiling_name"][0]) if row.height else "?"
        desc = descs.get(pg) or (row["pg_desc"][0] if row.height else None)
        stuck.append(StuckCollective(pg, desc, int(seq), op, tuple(mem), joined, missing, no_record,
                                     {int(r): int(v) for r, v in last.items()}))
    report = HangReport(tuple(sorted(fr["rank"].unique().to_list())), stuck, _waiting(fr), world_size, damaged)
    culprits = set(report.culprits)
    # the collective the culprits are absent from first: it is where the job stopped; the others
    # stalled behind it (their absent members wait in it)
    stuck.sort(key=lambda s: (not culprits & {*s.missing, *s.no_record}, -len(s.missing) - len(s.no_record),
                              s.pg_name))
    return report
