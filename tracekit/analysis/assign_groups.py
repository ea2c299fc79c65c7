"""Groups, sequence numbers and peers for the communication that torch-native jobs leave unlabelled.

gloo records its collectives as ``gloo:*`` spans on worker threads and its p2p as ``gloo:send`` /
``gloo:recv`` on the main thread, with no group, sequence number or peer (FORMATS.md section 1);
ingest stores them with ``pg_name`` and ``peer`` NULL and a per-rank ``seq`` that matches nothing
across ranks. This module fills those in from what a run does hold, when its tables are loaded
(``RunTables.from_mapping``), so that every analysis sees labelled rows whatever store it reads:

- the groups of each rank (``groups``: ``distributedInfo.pg_config``, with their dimension);
- the worker thread of each span (``events.tid``): a gloo process group runs its ops on threads of
  its own, so all spans of a thread belong to one group;
- which group a thread serves: with the flight recorder (``fr_entries``: group, sequence and kind
  of every collective the rank issued), the assignment of threads to groups whose op counts, per
  kind, match the recorder's per group; without it, the group whose other members complete a
  collective of the same kind closest to each of the thread's completions (every member of an
  instance finishes when the last one's data arrives). Order, kinds and shapes alone cannot tell
  the groups apart: in a symmetric SPMD job every rank of a stage issues the same sequence, so
  relabelling a dp op as tp on every rank is just as consistent;
- the sequence number: the op's order among its group's ops on the rank (a group's ops start in the
  order they were issued, which every member shares), the recorder's ``collective_seq_id`` where the
  counts agree; counted from the first profiler step, as ingest counts labelled ops;
- p2p peers from the pipeline layout: the neighbouring stage of the rank's pp group (same dp, cp,
  tp), the nearer in completion time where both neighbours exist; ``seq`` per (peer, direction).

Not handled: ranks on hosts with skewed clocks and no flight recorder (the time test compares
completions across ranks as they are); two ops of one group whose worker threads start them out of
issue order (a thread preempted between taking an op and starting it), which swaps their numbers on
that rank; middle pipeline stages are told apart by completion time only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from tracekit import classify


@dataclass(frozen=True)
class Assignment:
    """What was labelled and how: per rank, each worker thread's group."""

    collectives_labelled: int
    collectives_left: int  # unlabelled rows that no group could be given
    p2p_labelled: int
    p2p_left: int
    method: str  # flight_recorder | timing | flight_recorder+timing (ranks differ) | none
    threads: dict[int, dict[str, str]] = field(default_factory=dict)  # rank -> tid -> pg_name
    consistency: float = 1.0  # share of matched instances whose members agree on the op

    def to_dict(self) -> dict:
        return {**self.__dict__, "threads": {str(k): v for k, v in self.threads.items()}}


def needs_assignment(collectives: pl.DataFrame, p2p: pl.DataFrame) -> bool:
    """Are there gloo rows without a group (collectives) or a peer (p2p)?"""
    unl = pl.col("pg_name").is_null() & (pl.col("source") == "gloo")
    return bool(collectives.filter(unl).height or p2p.filter(unl | pl.col("peer").is_null()
                                                             & (pl.col("source") == "gloo")).height)


def _rank_groups(groups: pl.DataFrame) -> dict[int, list[tuple[str, str, tuple[int, ...]]]]:
    """rank -> [(pg_name, dim, ranks)] of the groups with more than one member."""
    out: dict[int, list] = {}
    for name, dim, ranks in groups.select("pg_name", "dim", "ranks").iter_rows():
        if ranks is None or len(ranks) < 2 or name is None:
            continue
        for r in ranks:
            out.setdefault(int(r), []).append((str(name), dim, tuple(int(x) for x in ranks)))
    return out


def _with_tid(coll: pl.DataFrame, events: pl.DataFrame) -> pl.DataFrame:
    """The unlabelled gloo collectives with the thread their span ran on."""
    spans = events.filter(pl.col("name").str.starts_with("gloo:")).select(
        pl.col("rank").cast(pl.Int32), pl.col("ts_ns").cast(pl.Int64).alias("start_ns"),
        pl.col("name"), pl.col("tid")).unique(["rank", "start_ns", "name"], keep="first")
    c = coll.with_columns(pl.col("rank").cast(pl.Int32), pl.col("start_ns").cast(pl.Int64))
    return c.join(spans.drop("name"), on=["rank", "start_ns"], how="left")


def _fr_counts(fr: pl.DataFrame | None, rank: int, lo: int, hi: int) -> dict[str, dict[str, int]] | None:
    """pg_name -> op -> entries the rank's recorder created in [lo, hi] (None: no recorder)."""
    if fr is None or not fr.height:
        return None
    mine = fr.filter((pl.col("rank") == rank) & ~pl.col("is_p2p").fill_null(False)
                     & pl.col("time_created_ns").is_between(lo, hi))
    if not mine.height:
        return None
    out: dict[str, dict[str, int]] = {}
    for pg, name in mine.select("pg_name", "profiling_name").iter_rows():
        op = classify.comm_op(name or "")
        if not op:
            continue
        out.setdefault(str(pg), {}).setdefault(op, 0)
        out[str(pg)][op] += 1
    return out


def _by_counts(threads: dict[str, dict[str, int]], fr: dict[str, dict[str, int]],
               candidates: list[str]) -> dict[str, str] | None:
    """The assignment of threads to groups whose per-kind op counts best match the recorder's."""
    tids = sorted(threads)
    pgs = [p for p in candidates if p in fr]
    if not pgs or len(pgs) ** len(tids) > 200_000:
        return None
    ops = sorted({o for t in threads.values() for o in t} | {o for p in pgs for o in fr[p]})
    best, best_cost, ties = None, None, 0
    for combo in itertools.product(pgs, repeat=len(tids)):
        total = {p: dict.fromkeys(ops, 0) for p in pgs}
        for t, p in zip(tids, combo):
            for o, n in threads[t].items():
                total[p][o] += n
        cost = sum(abs(total[p][o] - fr[p].get(o, 0)) for p in pgs for o in ops)
        if best_cost is None or cost < best_cost:
            best, best_cost, ties = dict(zip(tids, combo)), cost, 1
        elif cost == best_cost:
            ties += 1
    return best if ties == 1 else None  # groups whose counts agree: the recorder cannot tell them apart


def _by_timing(rank: int, spans: pl.DataFrame, others: dict[int, dict[str, np.ndarray]],
               candidates: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, str]:
    """Each thread's group: the one whose members complete same-kind ops nearest its completions
    (``others``: rank -> op -> sorted completion times). Python loops: O(spans x group members)."""
    out: dict[str, str] = {}
    for tid, part in spans.filter(pl.col("tid").is_not_null()).group_by("tid"):
        tid = tid[0]
        best, best_d = None, None
        for name, _, members in candidates:
            dist = []
            for op, end in part.select("op", "end_ns").iter_rows():
                worst = 0.0
                for m in members:
                    if m == rank:
                        continue
                    ends = others.get(m, {}).get(op)
                    if ends is None or not len(ends):
                        worst = np.inf
                        break
                    i = np.searchsorted(ends, end)
                    near = min(abs(ends[j] - end) for j in (i - 1, i) if 0 <= j < len(ends))
                    worst = max(worst, float(near))
                dist.append(worst)
            d = float(np.median(dist)) if dist else np.inf
            if np.isfinite(d) and (best_d is None or d < best_d):
                best, best_d = name, d
        if best is not None:
            out[str(tid)] = best
    return out


def _ordinal(keys: list[str]) -> pl.Expr:
    """The op's order among the rows of ``keys`` by start, counted from the rank's first step."""
    return (pl.int_range(pl.len()).over(keys, order_by="start_ns")
            - (pl.col("start_ns") < pl.col("_first")).sum().over(keys)).cast(pl.Int64)


def assign(collectives: pl.DataFrame, p2p: pl.DataFrame, events: pl.DataFrame, groups: pl.DataFrame,
           coords: pl.DataFrame | None, steps: pl.DataFrame, fr_entries: pl.DataFrame | None = None
           ) -> tuple[pl.DataFrame, pl.DataFrame, Assignment]:
    """Collectives and p2p with group, seq and peer filled in where ingest left them NULL.

    ``coords``: rank, dp, pp, cp, tp (RunTables.coords(); None: no layout, peers stay unknown);
    ``fr_entries``: the store's table of that name, or None. Labelled rows are returned unchanged."""
    unl = (pl.col("pg_name").is_null() & (pl.col("source") == "gloo"))
    todo = collectives.filter(unl)
    keep = collectives.filter(~unl)
    by_rank = _rank_groups(groups)
    first = steps.group_by(pl.col("rank").cast(pl.Int32)).agg(pl.col("start_ns").min().cast(pl.Int64).alias("_first"))
    threads: dict[int, dict[str, str]] = {}
    methods: set[str] = set()
    labelled = todo.head(0)
    if todo.height:
        spans = _with_tid(todo, events)
        ends = {r: {op: np.sort(p["end_ns"].to_numpy()) for (op,), p in part.group_by("op")}
                for (r,), part in spans.group_by("rank")}
        for (rank,), part in spans.group_by("rank"):
            cands = [g for g in by_rank.get(int(rank), []) if g[1] != "pp"]
            counts = {str(t): dict(zip(*np.unique(p["op"].to_numpy(), return_counts=True)))
                      for (t,), p in part.filter(pl.col("tid").is_not_null()).group_by("tid")}
            fr = _fr_counts(fr_entries, int(rank), int(part["start_ns"].min()), int(part["end_ns"].max()))
            got = _by_counts({t: {str(k): int(v) for k, v in c.items()} for t, c in counts.items()}, fr,
                             [g[0] for g in cands]) if fr else None
            if got is not None:
                methods.add("flight_recorder")
            else:
                got = _by_timing(int(rank), part, ends, cands)
                methods.update(["timing"] if got else [])
            threads[int(rank)] = got
        mapping = pl.DataFrame([(r, t, p) for r, m in threads.items() for t, p in m.items()],
                               schema={"rank": pl.Int32, "tid": pl.Utf8, "_pg": pl.Utf8}, orient="row")
        spans = spans.join(mapping, on=["rank", "tid"], how="left").join(first, on="rank", how="left")
        spans = spans.with_columns(pl.col("_first").fill_null(pl.col("start_ns").min().over("rank")))
        labelled = spans.with_columns(
            pl.col("_pg").alias("pg_name"),
            pl.when(pl.col("_pg").is_not_null()).then(_ordinal(["rank", "_pg"]))
            .otherwise(pl.col("seq")).alias("seq")).select(collectives.columns)
    out_coll = pl.concat([keep, labelled.cast(dict(collectives.schema))], how="vertical_relaxed")
    if coords is not None:
        out_p2p, p_lab, p_left = _peers(p2p, by_rank, coords, first)
    else:
        out_p2p, p_lab, p_left = p2p, 0, int(p2p.filter(pl.col("peer").is_null()).height)
    consistency = _consistency(out_coll)
    left = int(labelled.filter(pl.col("pg_name").is_null()).height)
    return out_coll, out_p2p, Assignment(labelled.height - left, left, p_lab, p_left,
                                 "+".join(sorted(methods)) or "none", threads, consistency)


def _consistency(coll: pl.DataFrame) -> float:
    inst = coll.filter(pl.col("pg_name").is_not_null()).group_by("pg_name", "seq").agg(
        pl.col("op").n_unique().alias("ops"), pl.len().alias("n")).filter(pl.col("n") > 1)
    return float((inst["ops"] == 1).mean()) if inst.height else 1.0


def _peers(p2p: pl.DataFrame, by_rank: dict, coords: pl.DataFrame, first: pl.DataFrame
           ) -> tuple[pl.DataFrame, int, int]:
    """p2p peers from the pipeline layout: the neighbouring stages in the rank's pp group."""
    unl = pl.col("peer").is_null() & (pl.col("source") == "gloo")
    todo, keep = p2p.filter(unl), p2p.filter(~unl)
    if not todo.height:
        return p2p, 0, 0
    pp_of = dict(coords.select("rank", "pp").iter_rows())
    pp_group = {r: next(((n, m) for n, d, m in gs if d == "pp"), None) for r, gs in by_rank.items()}
    ends = {(r, d): np.sort(p["end_ns"].to_numpy()) for (r, d), p in todo.group_by("rank", "direction")}
    peers, names = [], []
    for rank, direction, end in todo.select("rank", "direction", "end_ns").iter_rows():
        g = pp_group.get(int(rank))
        if g is None:
            peers.append(None), names.append(None)
            continue
        stage = pp_of[int(rank)]
        near = [m for m in g[1] if abs(pp_of[m] - stage) == 1]
        other = "recv" if direction == "send" else "send"
        if len(near) > 1:  # a middle stage: the neighbour whose opposite op completes nearest
            def gap(m: int) -> float:
                e = ends.get((m, other))
                if e is None or not len(e):
                    return np.inf
                i = np.searchsorted(e, end)
                return min(abs(float(e[j]) - end) for j in (i - 1, i) if 0 <= j < len(e))
            near = [min(near, key=gap)]
        peers.append(near[0] if near else None), names.append(g[0] if near else None)
    done = todo.with_columns(pl.Series("peer", peers, dtype=pl.Int32), pl.Series("pg_name", names, dtype=pl.Utf8),
                             pl.col("rank").cast(pl.Int32))
    done = done.join(first, on="rank", how="left").with_columns(
        pl.col("_first").fill_null(pl.col("start_ns").min().over("rank")))
    done = done.with_columns(pl.when(pl.col("peer").is_not_null())
                             .then(_ordinal(["rank", "peer", "direction"]))
                             .otherwise(pl.col("seq")).alias("seq")).select(p2p.columns)
    left = int(done.filter(pl.col("peer").is_null()).height)
    return pl.concat([keep, done.cast(dict(p2p.schema))], how="vertical_relaxed"), done.height - left, left
