"""One run's store tables as polars frames: the input every analysis takes.

The Store facade loads these from DuckDB (``WHERE run_id = ?``); ingest modules such as
``tracekit.ingest.optable`` return the same mapping, so analyses run on either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import polars as pl

from tracekit import schema
from tracekit.topology import Layout

TABLE_NAMES = ("runs", "ranks", "groups", "events", "collectives", "p2p", "steps")
POLARS_TYPES = {"INTEGER": pl.Int32, "BIGINT": pl.Int64, "VARCHAR": pl.Utf8, "BOOLEAN": pl.Boolean,
                "DOUBLE": pl.Float64, "JSON": pl.Utf8, "TIMESTAMP": pl.Datetime("us"),
                "INTEGER[]": pl.List(pl.Int32)}


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

    @classmethod
    def from_mapping(cls, tables: Mapping[str, pl.DataFrame], run_id: str | None = None) -> "RunTables":
        """Check that every table is present with the schema's columns and holds one run."""
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
        return cls(run_id=run_id, **frames)

    @classmethod
    def from_duckdb(cls, con, run_id: str) -> "RunTables":
        """Load one run from an open DuckDB connection holding the store's tables."""
        frames = {}
        for t in TABLE_NAMES:
            try:
                rel = con.sql(f"SELECT * FROM {t} WHERE run_id = $run_id", params={"run_id": run_id})
                frames[t] = pl.from_arrow(rel.to_arrow_table())
            except Exception as e:  # noqa: BLE001 - duckdb raises CatalogException and friends
                raise TablesError(f"cannot read table {t!r} from the store: {e}") from None
        return cls.from_mapping(frames, run_id)

    @property
    def layout(self) -> Layout:
        row = self.runs.row(0, named=True)
        sizes = {d: row[d] for d in ("tp", "cp", "pp", "dp")}
        if any(v is None for v in sizes.values()):
            raise TablesError(f"run {self.run_id!r} has no layout (tp/cp/pp/dp NULL)")
        return Layout(**{k: int(v) for k, v in sizes.items()})

    @property
    def manifest(self) -> dict:
        raw = self.runs["manifest"][0]
        return json.loads(raw) if isinstance(raw, str) and raw else {}

    def coords(self) -> pl.DataFrame:
        """rank, dp, pp, cp, tp (from the layout) and host (each rank its own host if unknown)."""
        lay = self.layout
        coords = [lay.coords(r) for r in range(lay.world_size)]
        ranks = pl.DataFrame({"rank": list(range(lay.world_size)), **{d: [getattr(c, d) for c in coords]
                                                                       for d in ("tp", "cp", "pp", "dp")}},
                             schema={"rank": pl.Int32, "tp": pl.Int64, "cp": pl.Int64, "pp": pl.Int64, "dp": pl.Int64})
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
                if peers is not None:
                    found += list(zip(ops["_i"].to_list(), peers.tolist()))
    if found:
        hit = pl.DataFrame(found, schema={"_i": pl.UInt32, "fr_peer": p2p["peer"].dtype}, orient="row")
        p2p = p2p.join(hit, on="_i", how="left").with_columns(pl.coalesce("peer", "fr_peer").alias("peer")).drop("fr_peer")
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


def _align(prof_t, fr_t, fr_peer):
    """Peers for ``prof_t`` (sorted op times) from the recorder's (``fr_t``, ``fr_peer``): the
    offset into the recorder's list at which the lag between the two is most constant (robust
    spread of the differences, plus a little of the lag itself, which is small and positive)."""
    import numpy as np

    n, m = len(prof_t), len(fr_t)
    if n == 0 or m < n:
        return None
    best, best_cost = None, None
    for o in range(m - n + 1):
        d = prof_t.astype(np.float64) - fr_t[o:o + n].astype(np.float64)
        med = float(np.median(d))
        cost = float(np.median(np.abs(d - med))) + 0.1 * abs(med)
        if best_cost is None or cost < best_cost:
            best, best_cost = o, cost
    return fr_peer[best:best + n]


def compute_events(events: pl.DataFrame) -> pl.DataFrame:
    """THE definition of "model compute": forward/backward work, not communication.

    Annotated compute spans (trainer ``tk.compute``, op-table compute ops) carry a phase; GPU
    traces without annotations contribute their non-communication kernels.
    """
    return events.filter(
        ~pl.col("is_comm").fill_null(False)
        & (pl.col("phase").is_in(["fwd", "bwd"]) | (pl.col("kind") == "kernel") & pl.col("phase").is_null())
    )
