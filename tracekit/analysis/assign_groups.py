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
  kind, match the recorder's per group; without it, completion times (every member of an instance
  finishes when the last one's data arrives) and counts: a thread's nearest group (whose members
  complete same-kind ops closest to its own) alone fails where a member was descheduled, as a
  frequent group completes something near any instant; so a pipeline stage's ranks, which issue
  the same ops per kind on each dimension, take the same counts per dimension, those whose groups'
  k-th ops complete together on all members (``_by_timing``). Order, kinds and shapes alone cannot
  tell the groups apart: in a symmetric SPMD job every rank of a stage issues the same sequence, so
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
from collections import Counter
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


def _gap(ends: np.ndarray | None, t: int) -> float:
    """How far the nearest of the sorted ``ends`` is from t (inf: there are none)."""
    if ends is None or not len(ends):
        return np.inf
    i = np.searchsorted(ends, t)
    return float(min(abs(int(ends[j]) - t) for j in (i - 1, i) if 0 <= j < len(ends)))


def _distances(rank: int, spans: pl.DataFrame, others: dict[int, dict[str, np.ndarray]],
               candidates: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, dict[str, float]]:
    """thread -> group -> how far the group's members complete same-kind ops from the thread's
    completions: the median over its ops of the worst member's nearest (``others``: rank -> op ->
    sorted completion times). Python loops: O(spans x group members)."""
    out: dict[str, dict[str, float]] = {}
    for (tid,), part in spans.filter(pl.col("tid").is_not_null()).group_by("tid"):
        rows = part.select("op", "end_ns").rows()
        out[str(tid)] = {name: float(np.median([max([_gap(others.get(m, {}).get(op), end) for m in members
                                                      if m != rank], default=0.0) for op, end in rows]))
                         for name, _, members in candidates}
    return out


def _ways(counts: dict[str, dict[str, int]], dist: dict[str, dict[str, float]], cands: list) -> dict:
    """The rank's ways to give its threads groups, the cheapest (summed distance) of each signature:
    signature (ops per kind of each group, keyed by dimension where the rank's are distinct) ->
    (summed distance, thread -> group). Threads near no group stay out; over 4096 ways: the nearest."""
    tids = sorted(t for t in dist if any(np.isfinite(list(dist[t].values()))))
    options = [[p for p, d in dist[t].items() if np.isfinite(d)] for t in tids]
    dims = [d for _, d, _ in cands]
    key = {n: d if None not in dims and len(set(dims)) == len(dims) else n for n, d, _ in cands}
    combos = (itertools.product(*options) if np.prod([len(o) for o in options]) <= 4096
              else [tuple(min(o, key=dist[t].get) for t, o in zip(tids, options))])
    out: dict[tuple, tuple[float, dict[str, str]]] = {}
    for combo in combos:
        total: dict[str, Counter] = {}
        for t, p in zip(tids, combo):
            total.setdefault(key[p], Counter()).update(counts.get(t, {}))
        sig = tuple(sorted((k, tuple(sorted(v.items()))) for k, v in total.items()))
        cost = sum(dist[t][p] for t, p in zip(tids, combo))
        if sig not in out or cost < out[sig][0]:
            out[sig] = (cost, dict(zip(tids, combo)))
    return out


def _misfit(assigned: dict[int, dict[str, str]], spans: dict[int, pl.DataFrame], groups: set) -> float:
    """How far apart the members' k-th ops of each group complete (k-th by start on each member),
    summed over the ops; a steady offset of a member (its thread descheduled for a while) counts an
    eighth: a few late threads must not outweigh ops paired with the wrong instances."""
    total = 0.0
    for name, members in groups:
        ends = [spans[m].filter(pl.col("tid").is_in([t for t, p in assigned[m].items() if p == name]))
                .sort("start_ns")["end_ns"].to_numpy() for m in members if m in assigned]
        if len({len(e) for e in ends}) > 1:
            return np.inf
        for d in (e - ends[0] for e in ends[1:] if len(e)):
            steady = float(np.median(d))
            total += float(np.abs(d - steady).sum()) + len(d) * abs(steady) / 8
    return total


def _by_timing(ranks: dict[int, tuple[pl.DataFrame, dict, dict, list]]) -> dict[int, dict[str, str]]:
    """Each rank's thread -> group (``ranks``: rank -> (spans, thread op counts, distances, groups)).

    A stage (ranks joined by groups without pp) takes one signature: of those most of its ranks can
    give, the 8 cheapest by summed distance and each rank's own cheapest, the one whose groups' k-th
    ops complete together on all members (``_misfit``), then the cheapest. A rank that cannot give
    it (a damaged trace) keeps its own cheapest way."""
    ways = {r: _ways(c, d, g) for r, (_, c, d, g) in ranks.items()}
    stage_of = {r: r for r in ranks}  # the lowest rank its stage's groups reach
    joins = {tuple(m for m in ms if m in ranks) for *_, cands in ranks.values() for _, dim, ms in cands
             if dim and dim != "other" and "pp" not in dim.split("_") and any(m in ranks for m in ms)}
    while any(stage_of[m] != min(stage_of[x] for x in ms) for ms in joins for m in ms):
        for ms in joins:
            stage_of.update(dict.fromkeys(ms, min(stage_of[m] for m in ms)))
    out: dict[int, dict[str, str]] = {}
    for st in set(stage_of.values()):
        stage = [r for r in ranks if stage_of[r] == st]
        held: dict[tuple, list[int]] = {}  # signature -> the ranks that can give it
        for r in stage:
            for s in ways[r]:
                held.setdefault(s, []).append(r)
        most = max((len(h) for h in held.values()), default=0)
        sigs = sorted((s for s, h in held.items() if len(h) == most), key=lambda s: sum(ways[r][s][0] for r in held[s]))
        own = {r: min(ways[r], key=lambda s: ways[r][s][0]) for r in stage if ways[r]}
        groups = {(n, tuple(m for m in ms if m in stage)) for r in stage for n, _, ms in ranks[r][3]}
        best = min(sigs[:8] + [s for s in sigs[8:] if s in own.values()], default=None, key=lambda s: _misfit(
            {r: ways[r][s][1] for r in held[s]}, {r: ranks[r][0] for r in held[s]}, groups))
        for r in stage:
            out[r] = ways[r][best][1] if best in ways[r] else ways[r][own[r]][1] if r in own else {}
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
    timing: dict[int, tuple] = {}  # ranks the recorder cannot label
    methods: set[str] = set()
    labelled = todo.head(0)
    if todo.height:
        spans = _with_tid(todo, events)
        ends = {r: {op: np.sort(p["end_ns"].to_numpy()) for (op,), p in part.group_by("op")}
                for (r,), part in spans.group_by("rank")}
        for (rank,), part in spans.group_by("rank"):
            cands = [g for g in by_rank.get(int(rank), []) if g[1] != "pp"]
            counts = {str(t): {str(k): int(n) for k, n in zip(*np.unique(p["op"].to_numpy(), return_counts=True))}
                      for (t,), p in part.filter(pl.col("tid").is_not_null()).group_by("tid")}
            fr = _fr_counts(fr_entries, int(rank), int(part["start_ns"].min()), int(part["end_ns"].max()))
            got = _by_counts(counts, fr, [g[0] for g in cands]) if fr else None
            if got is not None:
                methods.add("flight_recorder")
                threads[int(rank)] = got
            else:
                timing[int(rank)] = (part, counts, _distances(int(rank), part, ends, cands), cands)
        for rank, got in _by_timing(timing).items():
            methods.update(["timing"] if got else [])
            threads[rank] = got
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
