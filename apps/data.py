"""What each dashboard view shows, queried from the store on demand (one place for the SQL).

Every method answers one view's question for one run and returns polars frames or dicts; nothing
here draws. Queries ask DuckDB for just what a view needs (one step, two ranks, one rank's memory),
so opening a 64-rank store does not load its events. The diagnosis is computed once per run.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import duckdb
import polars as pl

from tracekit.analysis.collectives import match_collectives
from tracekit.analysis.rootcause import Diagnosis, diagnose
from tracekit.analysis.scores import collective_scores, pipeline_scores
from tracekit.analysis.tables import RunTables, compute_events
from tracekit.store import StoreError, connect
from tracekit.topology import Layout

# Most spans a timeline lane ships to the browser; beyond it, neighbouring spans of the same kind
# closer than a pixel's worth of time are merged (the shape stays, the row count drops).
TIMELINE_SPANS_PER_LANE = 2000
MEMORY_POINTS_PER_RANK = 2000


class DashboardData:
    """Read-only queries over one store file for the dashboard's views."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._con = connect(self.path, read_only=True)
        self._lock = threading.Lock()  # one DuckDB connection, several Panel sessions
        self._diagnoses: dict[str, Diagnosis] = {}
        self._tables: dict[str, RunTables] = {}
        present = {r[0] for r in self._con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "runs" not in present:
            raise StoreError(f"{self.path}: not a tracekit store (no 'runs' table)")

    def sql(self, query: str, params: dict | list | None = None) -> pl.DataFrame:
        with self._lock:
            return self._con.sql(query, params=params or {}).pl()

    # --- runs and overview -------------------------------------------------------------------------
    def runs(self) -> pl.DataFrame:
        """Runs, newest ingested first."""
        return self.sql("SELECT run_id, source, world_size, tp, cp, pp, dp, backend, ingested_at FROM runs "
                        "ORDER BY ingested_at DESC, run_id")

    def newest_run(self) -> str:
        runs = self.runs()
        if not runs.height:
            raise StoreError(f"{self.path}: the store holds no runs")
        return runs["run_id"][0]

    def run_info(self, run_id: str) -> dict:
        rows = self.sql("SELECT * FROM runs WHERE run_id = $r", {"r": run_id})
        if not rows.height:
            raise StoreError(f"{self.path}: no run {run_id!r}")
        info = rows.row(0, named=True)
        info["manifest"] = json.loads(info["manifest"]) if info["manifest"] else {}
        return info

    def layout(self, run_id: str) -> Layout:
        i = self.run_info(run_id)
        return Layout(tp=i["tp"] or 1, cp=i["cp"] or 1, pp=i["pp"] or 1, dp=i["dp"] or 1)

    def step_times(self, run_id: str) -> pl.DataFrame:
        """Per step: median and max step time over ranks (ms)."""
        return self.sql("""
            SELECT step, median(end_ns - start_ns) / 1e6 AS median_ms, max(end_ns - start_ns) / 1e6 AS max_ms,
                   count(*) AS ranks
            FROM steps WHERE run_id = $r GROUP BY step ORDER BY step""", {"r": run_id})

    def tables(self, run_id: str) -> RunTables:
        """The run's analysis tables (loaded once; the diagnosis and the blame scores need them)."""
        if run_id not in self._tables:
            with self._lock:
                self._tables[run_id] = RunTables.from_duckdb(self._con, run_id)
        return self._tables[run_id]

    def diagnosis(self, run_id: str) -> Diagnosis:
        if run_id not in self._diagnoses:
            self._diagnoses[run_id] = diagnose(self.tables(run_id))
        return self._diagnoses[run_id]

    def blame(self, run_id: str) -> pl.DataFrame:
        """(rank, step, lateness_ms): how long peers waited on the rank, as the localizer scores
        it (collective levels plus pipeline receives blamed on their producer), summed over levels."""
        tables = self.tables(run_id)
        matched = match_collectives(tables)
        parts = [collective_scores(tables, lv, matched) for lv in ("dp", "cp", "tp")]
        if tables.p2p.height:
            parts.append(pipeline_scores(tables))
        parts = [p.select(pl.col("step").cast(pl.Int32), pl.col("rank").cast(pl.Int32), pl.col("score"))
                 for p in parts if p.height]
        if not parts:
            return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int32, "lateness_ms": pl.Float64})
        return pl.concat(parts).group_by("rank", "step").agg((pl.col("score").sum() / 1e6).alias("lateness_ms"))

    # --- rank x step -------------------------------------------------------------------------------
    def rank_step(self, run_id: str) -> pl.DataFrame:
        """Per (rank, step): step_ms; lateness_ms (``blame``); wait_ms (its own waiting:
        collective time beyond the instance's shortest member, which durations on the rank's own
        clock give without alignment, plus pipeline receives) and wait_share of the step.
        With the rank's dp/pp/cp/tp."""
        df = self.sql("""
            WITH c AS (
              SELECT rank, step, end_ns - start_ns AS d,
                     min(end_ns - start_ns) OVER (PARTITION BY pg_name, seq) AS lo,
                     count(*) OVER (PARTITION BY pg_name, seq) AS n
              FROM collectives WHERE run_id = $r),
            cs AS (SELECT rank, step, sum(d - lo) AS cwait_ns FROM c WHERE n > 1 GROUP BY rank, step),
            ps AS (SELECT rank, step, sum(end_ns - start_ns) AS pwait_ns FROM p2p
                   WHERE run_id = $r AND direction = 'recv' GROUP BY rank, step),
            st AS (SELECT rank, step, end_ns - start_ns AS step_ns FROM steps WHERE run_id = $r)
            SELECT st.rank, st.step, st.step_ns / 1e6 AS step_ms,
                   (coalesce(cs.cwait_ns, 0) + coalesce(ps.pwait_ns, 0)) / 1e6 AS wait_ms
            FROM st LEFT JOIN cs USING (rank, step) LEFT JOIN ps USING (rank, step)
            ORDER BY st.rank, st.step""", {"r": run_id})
        df = df.join(self.blame(run_id), on=["rank", "step"], how="left").with_columns(
            pl.col("lateness_ms").fill_null(0.0))
        lay = self.layout(run_id)
        co = [lay.coords(r) for r in df["rank"].to_list()]
        return df.sort("rank", "step").with_columns(
            (pl.col("wait_ms") / pl.col("step_ms")).clip(0, 1).alias("wait_share"),
            *[pl.Series(d, [getattr(c, d) for c in co], dtype=pl.Int32) for d in ("dp", "pp", "cp", "tp")])

    def healthy_peer(self, run_id: str, rank: int) -> int | None:
        """A rank at the same position in another replica (else another member of its stage)
        with the median step time: the culprit's natural comparison."""
        lay = self.layout(run_id)
        dims = "dp" if lay.dp > 1 else (("cp", "tp") if lay.cp * lay.tp > 1 else "pp")
        peers = [r for r in lay.group(rank, dims) if r != rank]
        if not peers:
            return None
        t = self.sql("SELECT rank, median(end_ns - start_ns) AS s FROM steps WHERE run_id = $r "
                     "AND list_contains($p, rank) GROUP BY rank ORDER BY s", {"r": run_id, "p": peers})
        return int(t["rank"][t.height // 2]) if t.height else peers[0]

    # --- timeline ----------------------------------------------------------------------------------
    def timeline(self, run_id: str, ranks: list[int], step: int) -> pl.DataFrame:
        """Spans of ``ranks`` in ``step`` on a common time axis (ms from the step's first start):
        rank, lane (compute | collective | p2p), kind (compute | wait | transfer | send | recv), name,
        start_ms, end_ms. A collective is split at the last member's arrival into wait and transfer."""
        p = {"r": run_id, "ranks": ranks, "s": step}
        ev = self.sql("""SELECT e.rank, e.ts_ns - coalesce(k.clock_offset_ns, 0) AS ts_ns, e.dur_ns, e.kind, e.name,
                                e.phase, e.is_comm FROM events e LEFT JOIN ranks k USING (run_id, rank)
                         WHERE e.run_id = $r AND e.step = $s AND list_contains($ranks, e.rank)""", p)
        comp = compute_events(ev).select("rank", pl.lit("compute").alias("lane"), pl.lit("compute").alias("kind"),
                                         pl.coalesce("phase", "name").alias("name"), pl.col("ts_ns").alias("s"),
                                         (pl.col("ts_ns") + pl.col("dur_ns")).alias("e"))
        coll = self.sql("""
            WITH c AS (SELECT c.rank, c.pg_name, c.seq, c.op, c.start_ns - coalesce(k.clock_offset_ns, 0) AS s,
                              c.end_ns - coalesce(k.clock_offset_ns, 0) AS e
                       FROM collectives c LEFT JOIN ranks k USING (run_id, rank)
                       WHERE c.run_id = $r AND c.step = $s),
                 m AS (SELECT *, max(s) OVER (PARTITION BY pg_name, seq) AS last FROM c)
            SELECT rank, op || ' ' || pg_name AS name, s, least(greatest(last, s), e) AS last, e FROM m
            WHERE list_contains($ranks, rank)""", p)
        wait = coll.select("rank", pl.lit("collective").alias("lane"), pl.lit("wait").alias("kind"), "name",
                           "s", pl.col("last").alias("e"))
        xfer = coll.select("rank", pl.lit("collective").alias("lane"), pl.lit("transfer").alias("kind"), "name",
                           pl.col("last").alias("s"), "e")
        p2p = self.sql("""SELECT p.rank, p.direction AS kind, p.direction || ' ' || p.peer AS name,
                                 p.start_ns - coalesce(k.clock_offset_ns, 0) AS s, p.end_ns - coalesce(k.clock_offset_ns, 0) AS e
                          FROM p2p p LEFT JOIN ranks k USING (run_id, rank)
                          WHERE p.run_id = $r AND p.step = $s AND list_contains($ranks, p.rank)""", p)
        p2p = p2p.select("rank", pl.lit("p2p").alias("lane"), "kind", "name", "s", "e")
        spans = pl.concat([comp, wait, xfer, p2p], how="vertical_relaxed").filter(pl.col("e") >= pl.col("s"))
        if not spans.height:
            return pl.DataFrame(schema={"rank": pl.Int32, "lane": pl.Utf8, "kind": pl.Utf8, "name": pl.Utf8,
                                        "start_ms": pl.Float64, "end_ms": pl.Float64})
        t0 = spans["s"].min()
        spans = decimate(spans, (spans["e"].max() - t0) / 1500)
        return spans.select(pl.col("rank").cast(pl.Int32), "lane", "kind", "name",
                            ((pl.col("s") - t0) / 1e6).alias("start_ms"), ((pl.col("e") - t0) / 1e6).alias("end_ms"))

    # --- CP waits ----------------------------------------------------------------------------------
    def cp_wait(self, run_id: str, step: int | None = None) -> pl.DataFrame:
        """Per CP-group member: time in CP collectives split into wait (for the last arrival) and
        transfer, and how long the others waited on it when it arrived last (ms, summed)."""
        return self.sql("""
            WITH c AS (SELECT c.rank, c.pg_name, c.seq, c.start_ns - coalesce(k.clock_offset_ns, 0) AS s,
                              c.end_ns - coalesce(k.clock_offset_ns, 0) AS e
                       FROM collectives c JOIN groups g ON g.run_id = c.run_id AND g.pg_name = c.pg_name
                       LEFT JOIN ranks k ON k.run_id = c.run_id AND k.rank = c.rank
                       WHERE c.run_id = $r AND g.dim = 'cp' AND ($s IS NULL OR c.step = $s)),
                 l AS (SELECT *, max(s) OVER w AS last, count(*) OVER w AS n FROM c WINDOW w AS (PARTITION BY pg_name, seq)),
                 m AS (SELECT *, sum(last - s) OVER (PARTITION BY pg_name, seq) AS caused FROM l)
            SELECT rank, sum(last - s) / 1e6 AS wait_ms, sum(greatest(e - last, 0)) / 1e6 AS transfer_ms,
                   sum(CASE WHEN s = last THEN caused ELSE 0 END) / 1e6 AS others_waited_ms, count(*) AS collectives
            FROM m WHERE n > 1 GROUP BY rank ORDER BY rank""", {"r": run_id, "s": step})

    # --- memory ------------------------------------------------------------------------------------
    def memory_ranks(self, run_id: str) -> list[int]:
        return self.sql("SELECT DISTINCT rank FROM memory_events WHERE run_id = $r ORDER BY rank",
                        {"r": run_id})["rank"].to_list()

    def memory_timeline(self, run_id: str, rank: int) -> pl.DataFrame:
        """Allocated bytes over the rank's trace (seq order): allocations minus completed frees,
        thinned to at most MEMORY_POINTS_PER_RANK points keeping each bucket's maximum."""
        return self.sql("""
            WITH d AS (SELECT seq, sum(CASE WHEN action = 'alloc' THEN size WHEN action = 'free_completed'
                                           THEN -size ELSE 0 END) OVER (ORDER BY seq) AS allocated
                       FROM memory_events WHERE run_id = $r AND rank = $k),
                 b AS (SELECT *, ntile($n) OVER (ORDER BY seq) AS bucket FROM d)
            SELECT min(seq) AS seq, max(allocated) / 2^20 AS allocated_mib FROM b GROUP BY bucket ORDER BY seq""",
                        {"r": run_id, "k": rank, "n": MEMORY_POINTS_PER_RANK})

    def memory_estimate_mib(self, run_id: str, rank: int) -> float | None:
        """The estimator's total for this rank from the trainer manifest, when the run has one."""
        from tracekit.memory.llama_dims import EstimateError
        from tracekit.memory.trainer import trainer_estimate

        manifest = self.run_info(run_id)["manifest"]
        if "config" not in manifest:
            return None
        try:
            return trainer_estimate(manifest, rank).total / 2**20
        except (EstimateError, KeyError, TypeError, ValueError):
            return None

    # --- numerics ----------------------------------------------------------------------------------
    def numerics(self, run_id: str) -> pl.DataFrame | None:
        """A numerics report stored with the run: the manifest's ``numerics`` rows, or
        ``numerics.json`` (a list of rows) in the run's directory."""
        info = self.run_info(run_id)
        rows = info["manifest"].get("numerics")
        if rows is None and info.get("root"):
            f = Path(info["root"]) / "numerics.json"
            if f.is_file():
                try:
                    rows = json.loads(f.read_text())
                except json.JSONDecodeError as e:
                    raise StoreError(f"{f}: not valid JSON ({e})") from None
        if not rows:
            return None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise StoreError(f"run {run_id!r}: numerics report must be a list of rows (objects)")
        return pl.DataFrame(rows)

    def close(self) -> None:
        self._con.close()


def decimate(spans: pl.DataFrame, min_gap: float) -> pl.DataFrame:
    """Merge a lane's consecutive spans of one kind that are closer than ``min_gap`` (about a
    pixel) when the lane has more than TIMELINE_SPANS_PER_LANE spans; the merged span keeps the
    first name and reports how many it stands for in its name."""
    key = ["rank", "lane", "kind"]
    counts = spans.group_by(key).len()
    if counts["len"].max() <= TIMELINE_SPANS_PER_LANE:
        return spans
    out = spans.sort(*key, "s").with_columns(
        (pl.col("s") > pl.col("e").cum_max().shift(1).over(key) + min_gap).fill_null(True).cum_sum().over(key)
        .alias("_run"))
    return out.group_by(*key, "_run").agg(
        pl.when(pl.len() > 1).then(pl.format("{} (+{} merged)", pl.col("name").first(), pl.len() - 1))
        .otherwise(pl.col("name").first()).alias("name"),
        pl.col("s").min(), pl.col("e").max()).drop("_run")
