"""One run's store tables as polars frames: the input every analysis takes.

The Store facade loads these from DuckDB (``WHERE run_id = ?``); ingest modules such as
``tracekit.ingest.optable`` return the same mapping, so analyses run on either.
"""

from __future__ import annotations

import json
import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping

import polars as pl

from tracekit import schema
from tracekit.analysis.assign_groups import assign, needs_assignment
from tracekit.topology import Layout, order_from_coords

if TYPE_CHECKING:
    from tracekit.analysis.assign_groups import Assignment

TABLE_NAMES = ("runs", "ranks", "groups", "events", "collectives", "p2p", "steps")
POLARS_TYPES = {"INTEGER": pl.Int32, "BIGINT": pl.Int64, "VARCHAR": pl.Utf8, "BOOLEAN": pl.Boolean,
                "DOUBLE": pl.Float64, "JSON": pl.Utf8, "TIMESTAMP": pl.Datetime("us"),
                "INTEGER[]": pl.List(pl.Int32)}


def ranked_source(con, table: str, ranks: list[tuple[int, int]] | None) -> tuple[str, str]:
    """(FROM source, extra WHERE clause) reading only ``ranks`` (inclusive ranges; None: all) of a
    per-rank table: on a Parquet dataset through its ``<table>_parts`` view, whose ``rank_block``
    partition column prunes whole files (tracekit/dataset.py). The ranks go to DuckDB as one IN
    list: a disjunction of ranges is not pushed into the Parquet scan, and a DP group's scope (336
    ranks in 75 ranges of a 16,384-rank dataset) read each table 2.3-3.7x slower that way."""
    if ranks is None:
        return table, ""
    members = sorted({r for a, b in ranks for r in range(int(a), int(b) + 1)})
    within = f" AND rank IN ({', '.join(map(str, members))})"
    parts = con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = ?", [f"{table}_parts"]).fetchall()
    if not parts or not parts[0][0]:
        return table, within
    from tracekit.schema import RANK_BLOCK

    blocks = sorted({k for a, b in ranks for k in range(int(a) // RANK_BLOCK, int(b) // RANK_BLOCK + 1)})
    return f"{table}_parts", f" AND rank_block IN ({', '.join(map(str, blocks))}){within}"


def per_tables(fn):
    """Compute ``fn(tables, *args)`` once per tables object: the diagnosis asks for the same derived
    frames (matched collectives, compute speed, link transfers) from several places. The key is
    the call's arguments bound to the signature, defaults filled in, so that ``f(t)`` and
    ``f(t, flag=False)`` are one entry (the compute speed was computed twice per diagnosis)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(tables, *args, **kwargs):
        cache = getattr(tables, "cache", None)
        bound = signature.bind(tables, *args, **kwargs)
        bound.apply_defaults()
        key = (fn.__module__, fn.__qualname__, tuple(bound.arguments.items())[1:])
        try:
            hash(key)
        except TypeError:  # an argument that cannot be a key (a frame of offsets): no caching
            cache = None
        if cache is None:
            return fn(tables, *args, **kwargs)
        if key not in cache:
            cache[key] = fn(tables, *args, **kwargs)
        return cache[key]
    return wrapper


def conform(df: pl.DataFrame, table: str) -> pl.DataFrame:
    """The schema's columns of ``table`` in order and with their polars types; columns the
    frame lacks (a source that cannot fill them) become NULL."""
    types = dict(schema.TABLES[table])
    return df.select([(pl.col(c) if c in df.columns else pl.lit(None)).cast(POLARS_TYPES[types[c]]).alias(c)
                      for c in schema.columns(table)])


class TablesError(ValueError):
    """Tables that an analysis cannot work from (missing table or column, several runs)."""


@dataclass(frozen=True)
class RunTables:
    run_id: str
    runs: pl.DataFrame
    ranks: pl.DataFrame
    groups: pl.DataFrame
    events: pl.DataFrame
    collectives: pl.DataFrame
    p2p: pl.DataFrame
    steps: pl.DataFrame
    # how unlabelled gloo communication was given groups, seqs and peers (assign_groups), if any
    labelling: "Assignment | None" = None
    # frames derived from these tables that several analyses share (``per_tables``); not an init
    # field, so that ``replace`` gives new tables an empty cache
    cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def from_mapping(cls, tables: Mapping[str, pl.DataFrame], run_id: str | None = None) -> "RunTables":
        """Check that every table is present with the schema's columns and holds one run; label
        unlabelled gloo communication (``assign_groups``, with ``fr_entries`` when the mapping
        has it), recording how in ``labelling``."""
        missing = [t for t in TABLE_NAMES if t not in tables]
        if missing:
            raise TablesError(f"missing tables {missing}")
        for t in TABLE_NAMES:
            lacking = [c for c in schema.columns(t) if c not in tables[t].columns]
            if lacking:
                raise TablesError(f"table {t!r} lacks columns {lacking}")
        runs = tables["runs"]
        if run_id is None:
            if runs.height != 1:
                raise TablesError(f"expected one run in 'runs', found {runs.height}; pass run_id")
            run_id = runs["run_id"][0]
        frames = {t: tables[t].filter(pl.col("run_id") == run_id) for t in TABLE_NAMES}
        frames["p2p"] = with_p2p_peers(frames["p2p"], frames["groups"], frames["steps"])
        for t in ("collectives", "p2p"):
            frames[t] = prefer_profiler(frames[t])
        if frames["runs"].height != 1:
            raise TablesError(f"run {run_id!r} not found in 'runs'")
        out = cls(run_id=run_id, **frames)
        if needs_assignment(out.collectives, out.p2p):
            fr = tables.get("fr_entries")
            fr = fr.filter(pl.col("run_id") == run_id) if fr is not None else None
            coll, p2p, how = assign(out.collectives, out.p2p, out.events, out.groups,
                                    out.coords() if out.has_layout else None, out.steps, fr)
            out = replace(out, collectives=coll, p2p=p2p, labelling=how)
        return out

    @classmethod
    def from_duckdb(cls, con, run_id: str, ranks: list[tuple[int, int]] | None = None) -> "RunTables":
        """Load one run from an open DuckDB connection holding the store's tables; with ``ranks``
        (inclusive rank ranges) only those ranks' rows of the per-rank tables (a scoped analysis)."""
        frames = {}
        for t in TABLE_NAMES:
            source, scope = ranked_source(con, t, ranks) if t not in ("runs", "groups") else (t, "")
            try:
                rel = con.sql(f"SELECT {', '.join(schema.columns(t))} FROM {source} WHERE run_id = $run_id{scope}",
                              params={"run_id": run_id})
                frames[t] = pl.from_arrow(rel.to_arrow_table())
            except Exception as e:  # noqa: BLE001 - duckdb raises CatalogException and friends
                raise TablesError(f"cannot read table {t!r} from the store: {e}") from None
        try:  # optional: labels unlabelled gloo collectives (assign_groups)
            frames["fr_entries"] = pl.from_arrow(con.sql(
                "SELECT run_id, rank, pg_name, profiling_name, is_p2p, time_created_ns FROM "
                "{} WHERE run_id = $run_id{}".format(*ranked_source(con, "fr_entries", ranks)), params={"run_id": run_id}).to_arrow_table())
        except Exception:  # noqa: BLE001 - an older store without the table
            pass
        return cls.from_mapping(frames, run_id)

    @property
    def has_layout(self) -> bool:
        row = self.runs.row(0, named=True)
        return all(row.get(d) is not None for d in ("tp", "cp", "pp", "dp"))

    @functools.cached_property
    def layout(self) -> Layout:
        row = self.runs.row(0, named=True)
        sizes = {d: row[d] for d in ("tp", "cp", "pp", "dp")}
        if any(v is None for v in sizes.values()):
            raise TablesError(f"run {self.run_id!r} has no layout (tp/cp/pp/dp NULL)")
        sizes = {k: int(v) for k, v in sizes.items()}
        # the order its ranks were numbered in, from their coordinates (PP outermost in torchtitan)
        known = self.ranks.select("rank", "dp", "pp", "cp", "tp").head(4096).rows() \
            if all(c in self.ranks.columns for c in ("dp", "pp", "cp", "tp")) else []
        return Layout(**sizes, order=order_from_coords(sizes, known))

    @property
    def backend(self) -> str:
        """The job's communication backend as recorded ('nccl', 'gloo', ...), lower case; '' if unknown."""
        if "backend" not in self.runs.columns or not self.runs.height:
            return ""
        return (self.runs["backend"][0] or "").lower()

    @property
    def manifest(self) -> dict:
        raw = self.runs["manifest"][0]
        return json.loads(raw) if isinstance(raw, str) and raw else {}

    def coords(self) -> pl.DataFrame:
        """rank, dp, pp, cp, tp (from the layout) and host (each rank its own host if unknown)."""
        if "coords" not in self.cache:
            self.cache["coords"] = self._coords()
        return self.cache["coords"]

    def _coords(self) -> pl.DataFrame:
        lay = self.layout
        r = pl.int_range(0, lay.world_size, dtype=pl.Int64)
        ranks = pl.select(r.cast(pl.Int32).alias("rank"),
                          *((r // lay.stride(d) % getattr(lay, d)).alias(d) for d in ("tp", "cp", "pp", "dp")))
        hosts = self.ranks.select(pl.col("rank").cast(pl.Int32), "host")
        ranks = ranks.join(hosts, on="rank", how="left")
        return ranks.with_columns(pl.coalesce("host", pl.format("rank{}", "rank")).alias("host"))


def prefer_profiler(ops: pl.DataFrame) -> pl.DataFrame:
    """THE rule for ops recorded twice: a rank with profiler-derived rows (annotation, kernel,
    gloo spans) keeps only those; its flight-recorder rows (coarse times, no step) are dropped, or
    every instance the two sources share would count each member twice."""
    if "source" not in ops.columns or not ops.height:
        return ops
    profiled = pl.col("source").fill_null("") != "fr"
    return ops.filter(profiled | ~profiled.any().over("rank"))


def with_p2p_peers(p2p: pl.DataFrame, groups: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """Profiler p2p rows with the peer filled in where the record lacks it (NCCL's names the group,
    not the peer; FORMATS.md): from the rank's own flight-recorder entries, which name it. The
    recorder stamps the CPU-side call, the profiler the GPU kernel (later by a launch lag), and the
    recorder's ring may hold more ops than the profiled window: per rank and direction the profiled
    ops are paired in order with the run of recorder entries whose time offset is the steadiest
    (``_align``). Else, from the pipeline group when
    the rank is an end stage (its only neighbour); middle stages without recorder entries stay unknown."""
    if not p2p.height or not p2p["peer"].null_count():
        return p2p
    is_fr = pl.col("source").fill_null("") == "fr"
    p2p = p2p.with_row_index("_i")
    todo = p2p.filter(~is_fr & pl.col("peer").is_null())
    known = p2p.filter(is_fr & pl.col("peer").is_not_null())
    found: list[tuple[int, int]] = []
    if known.height and todo.height:
        fr = {k: g.sort("start_ns") for k, g in known.partition_by("rank", "direction", as_dict=True).items()}
        for key, ops in todo.partition_by("rank", "direction", as_dict=True).items():
            if key in fr:
                ops = ops.sort("start_ns")
                peers = _align(ops["start_ns"].to_numpy(), fr[key]["start_ns"].to_numpy(), fr[key]["peer"].to_numpy())
                found += [(i, int(p)) for i, p in zip(ops["_i"].to_list(), peers) if p is not None]
    if found:
        hit = pl.DataFrame(found, schema={"_i": pl.UInt32, "fr_peer": p2p["peer"].dtype}, orient="row")
        # a step the ring holds only part of keeps no peers: transfers pair a link's sends and
        # receives by their order within the step, which a step entered midway would shift
        whole = pl.col("fr_peer").is_not_null().all().over("rank", "direction", "step")
        p2p = p2p.join(hit, on="_i", how="left").with_columns(
            pl.when(pl.col("peer").is_null() & ~is_fr & pl.col("step").is_not_null() & whole)
            .then(pl.col("fr_peer")).otherwise(pl.col("peer")).alias("peer")).drop("fr_peer")
    members = {n: list(r) for n, r in groups.select("pg_name", "ranks").drop_nulls().iter_rows()}
    ends = {}
    for name, ranks in members.items():
        if len(ranks) >= 2:
            ends[(name, ranks[0])] = ranks[1]
            ends[(name, ranks[-1])] = ranks[-2]
    if ends and p2p["peer"].null_count():
        lut = pl.DataFrame({"pg_name": [k[0] for k in ends], "rank": [k[1] for k in ends],
                            "end_peer": list(ends.values())}, schema={"pg_name": pl.Utf8, "rank": p2p["rank"].dtype,
                                                                      "end_peer": p2p["peer"].dtype})
        p2p = p2p.join(lut, on=["pg_name", "rank"], how="left").with_columns(
            pl.coalesce("peer", "end_peer").alias("peer")).drop("end_peer")
    return p2p.sort("_i").drop("_i")


ALIGN_MARGIN = 0.9  # the chosen offset's cost must be at most this share of any other offset's


def _align(prof_t, fr_t, fr_peer) -> list:
    """Peers for ``prof_t`` (sorted op times) from the recorder's (``fr_t``, ``fr_peer``), None
    where the recorder has no entry or the pairing is in doubt: the shorter list is laid along the
    longer at the offset where the lag between the two is most constant (robust spread of the
    differences, plus a little of the lag itself, which is small and positive).

    The recorder's ring keeps a fixed number of entries (2,000 by default, collectives included),
    so on a long profiled window it holds fewer ops than the profiler (984 of 1,024 receives at 32
    micro-batches x 2 virtual stages): its entries are the job's latest, so they lie along the
    profiled ops' tail. Its times are the watchdog's polls, tens of ms late, and where ops follow
    each other faster than that jitter a shift by one op costs nearly the same: a peer from a
    shifted pairing alternates wrongly on a middle stage and made false slow links (confidence
    0.99), so an offset is taken only when it is clearly the cheapest (ALIGN_MARGIN), and a short
    ring only at the tail."""
    import numpy as np

    n, m = len(prof_t), len(fr_t)
    if n == 0 or m == 0:
        return [None] * n
    short, long_ = (prof_t, fr_t) if n <= m else (fr_t, prof_t)
    k = len(short)
    costs = []
    for o in range(len(long_) - k + 1):
        d = short.astype(np.float64) - long_[o:o + k].astype(np.float64)
        med = float(np.median(d))
        costs.append(float(np.median(np.abs(d - med))) + 0.1 * abs(med))
    order = np.argsort(costs)
    best = int(order[0])
    if len(order) > 1 and costs[best] > ALIGN_MARGIN * costs[int(order[1])]:
        return [None] * n
    if n <= m:
        return [int(p) for p in fr_peer[best:best + n]]
    if best != n - m:
        return [None] * n
    return [None] * best + [int(p) for p in fr_peer]


# Communication seen from the main thread of a CPU trace, beyond what ingest calls communication:
# functional collectives (DTensor, FSDP2) and their waits block there.
_CPU_COMM_PREFIXES = ("_c10d_functional::", "c10d_functional::")


def compute_events(events: pl.DataFrame) -> pl.DataFrame:
    """THE definition of "model compute": forward/backward work, not communication.

    Annotated compute spans (trainer ``tk.compute``, op-table compute ops) carry a phase; GPU
    traces without annotations contribute their non-communication kernels. A rank with neither
    (a CPU trace of a job we did not annotate) contributes its top-level CPU ops: the ``cpu_op``
    spans of its main thread not nested in another, communication excepted, with
    ``nested_comm_ns`` the communication on that thread inside each (its enqueues and waits; the
    gloo worker threads' spans run beside the compute, not inside it). The other rows carry NULL
    there: their nested communication is the rank's collectives and p2p (compute_speed).
    """
    marked = (~pl.col("is_comm").fill_null(False)
              & (pl.col("phase").is_in(["fwd", "bwd"]) | (pl.col("kind") == "kernel") & pl.col("phase").is_null()))
    out = events.filter(marked).with_columns(pl.lit(None, pl.Int64).alias("nested_comm_ns"))
    if "tid" not in events.columns or "rank" not in events.columns:
        return out
    bare = events.filter(~pl.col("rank").is_in(out["rank"].unique().implode()))
    cpu = cpu_compute_spans(bare)
    return pl.concat([out, cpu.select(out.columns)], how="vertical_relaxed") if cpu.height else out


def cpu_comm(name: pl.Expr = pl.col("name")) -> pl.Expr:
    """Is a CPU event communication (ingest's ``is_comm``, or a functional collective or wait)?"""
    starts = pl.lit(False)
    for p in _CPU_COMM_PREFIXES:
        starts = starts | name.str.starts_with(p)
    return pl.col("is_comm").fill_null(False) | starts


def cpu_compute_spans(events: pl.DataFrame) -> pl.DataFrame:
    """Top-level non-communication ``cpu_op`` spans of each rank's main thread (the thread with the
    most ops), with ``nested_comm_ns``: the union of communication events on that thread inside,
    and of its waits on worker-thread collectives there (``_hidden_waits``)."""
    ops = events.filter((pl.col("kind") == "cpu_op") & pl.col("ts_ns").is_not_null())
    if not ops.height:
        return events.head(0).with_columns(pl.lit(None, pl.Int64).alias("nested_comm_ns"))
    main = ops.group_by("rank", "tid").len().sort("len", "tid", descending=[True, False]) \
        .unique("rank", keep="first").select("rank", "tid")
    ops = ops.join(main, on=["rank", "tid"]).with_columns(
        pl.col("ts_ns").cast(pl.Int64), (pl.col("ts_ns") + pl.col("dur_ns")).cast(pl.Int64).alias("_end"))
    ops = ops.sort("rank", "ts_ns", pl.col("dur_ns"), descending=[False, False, True])
    ops = ops.with_columns(pl.col("_end").cum_max().shift(1).over("rank").alias("_outer"))
    top = ops.filter(pl.col("_outer").is_null() | (pl.col("ts_ns") >= pl.col("_outer")))
    comp = top.filter(~cpu_comm()).with_row_index("_sid")
    comm = events.join(main, on=["rank", "tid"]).filter(cpu_comm()).select(
        "rank", pl.col("ts_ns").cast(pl.Int64).alias("s"),
        (pl.col("ts_ns") + pl.col("dur_ns")).cast(pl.Int64).alias("e"))
    # leaves: ops with no op inside (the next op by start begins after their end)
    leaves = ops.filter(pl.col("ts_ns").shift(-1).over("rank").fill_null(pl.col("_end")) >= pl.col("_end"))
    comm = pl.concat([comm, _hidden_waits(comp, leaves, events, main)])
    nested = pl.DataFrame(schema={"_sid": pl.UInt32, "nested_comm_ns": pl.Int64})
    if comm.height and comp.height:
        hit = comm.drop_nulls().sort("rank", "s").join_asof(
            comp.select("rank", "_sid", pl.col("ts_ns").alias("s0"), pl.col("_end").alias("e0")).sort("rank", "s0"),
            left_on="s", right_on="s0", by="rank", strategy="backward", check_sortedness=False)
        hit = hit.filter(pl.col("e0").is_not_null() & (pl.col("s") >= pl.col("s0")) & (pl.col("e") <= pl.col("e0")))
        # nested comm events (an enqueue and the transport span inside it) count once
        hit = hit.sort("_sid", "s").with_columns(pl.col("e").cum_max().shift(1).over("_sid").alias("prev"))
        hit = hit.with_columns((pl.col("e") - pl.max_horizontal("s", pl.col("prev").fill_null(pl.col("s"))))
                               .clip(lower_bound=0).alias("c"))
        nested = hit.group_by("_sid").agg(pl.col("c").sum().cast(pl.Int64).alias("nested_comm_ns"))
    return comp.join(nested, on="_sid", how="left").with_columns(pl.col("nested_comm_ns").fill_null(0)) \
        .drop("_sid", "_end", "_outer")


WAKE_NS = 1_000_000  # a waiting main thread resumes within this of its collective's end


def _hidden_waits(comp: pl.DataFrame, leaves: pl.DataFrame, events: pl.DataFrame, main: pl.DataFrame
                  ) -> pl.DataFrame:
    """(rank, s, e): stretches of a compute span where the main thread ran no leaf op and waited on
    a collective of a gloo worker thread: ``Work.wait()`` (FSDP's reduce-scatter, a blocking
    collective) leaves no event, so the wait would count as the span's compute, and a rank waiting
    on a slow peer would look slow itself. A gap between leaf ops counts when a worker collective
    in flight during it ends at most ``WAKE_NS`` before the main thread's next op."""
    spans = comp.select("rank", "_sid", pl.col("ts_ns").alias("s0"), pl.col("_end").alias("e0")).sort("rank", "s0")
    empty = pl.DataFrame(schema={"rank": comp.schema["rank"], "s": pl.Int64, "e": pl.Int64})
    worker = events.join(main.rename({"tid": "_main"}), on="rank").filter(
        pl.col("name").str.starts_with("gloo:") & (pl.col("tid") != pl.col("_main"))).select(
        "rank", pl.col("ts_ns").cast(pl.Int64).alias("ws"),
        (pl.col("ts_ns") + pl.col("dur_ns")).cast(pl.Int64).alias("we"))
    if not spans.height or not worker.height:
        return empty
    k = leaves.select("rank", pl.col("ts_ns").alias("s"), pl.col("_end").alias("e")).sort("rank", "s").join_asof(
        spans, left_on="s", right_on="s0", by="rank", strategy="backward", check_sortedness=False)
    k = k.filter(pl.col("s") < pl.col("e0")).sort("_sid", "s").with_columns(
        pl.col("e").cum_max().shift(1).over("_sid").fill_null(pl.col("s0")).alias("g0"))
    inner = k.select("rank", "g0", pl.col("s").alias("g1"))
    tail = k.group_by("rank", "_sid").agg(pl.col("e").max().alias("g0"), pl.col("e0").first().alias("g1"))
    bare = spans.join(k.select("_sid").unique(), on="_sid", how="anti").select("rank", pl.col("s0").alias("g0"),
                                                                              pl.col("e0").alias("g1"))
    gaps = pl.concat([inner, tail.select("rank", "g0", "g1"), bare]).filter(pl.col("g1") > pl.col("g0"))
    hit = gaps.sort("rank", "g1").join_asof(worker.sort("rank", "we"), left_on="g1", right_on="we", by="rank",
                                            strategy="backward", check_sortedness=False)
    hit = hit.filter(pl.col("we").is_not_null() & (pl.col("we") > pl.col("g0"))
                     & (pl.col("g1") - pl.col("we") <= WAKE_NS) & (pl.col("ws") < pl.col("g1")))
    return hit.select("rank", pl.max_horizontal("g0", "ws").alias("s"), pl.col("g1").alias("e")).cast(
        {"s": pl.Int64, "e": pl.Int64})
