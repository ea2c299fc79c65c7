"""Timeline of one step: spans of a few ranks on a common clock, and what of them goes to the browser.

``step_spans`` queries DuckDB for the step's spans of the ranks shown (compute as the library
defines it, collectives split at the last member's arrival into wait and transfer, pipeline sends
and receives). ``lane_glyphs`` decides what to ship for a visible time window: a lane with at most
TIMELINE_SPANS_PER_LANE spans in it goes as its spans; a crowded one as an occupancy raster, one
rectangle per (pixel-wide time bin, kind) whose height is the share of the bin that kind was busy
and whose hover says how many spans it stands for. Zooming in re-asks for the narrower window, so
crowded lanes resolve into their spans once few enough are in view.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from apps.data.heatmap import rank_step
from apps.data.store import DashboardData
from tracekit.analysis.tables import compute_events, prefer_profiler

TIMELINE_SPANS_PER_LANE = 1500  # spans a lane may ship as themselves
TIMELINE_BINS = 800  # time bins of a crowded lane's raster (about one per pixel of the plot)
LANE_KEY = ["rank", "lane"]
GLYPH_SCHEMA = {"rank": pl.Int32, "lane": pl.Utf8, "kind": pl.Utf8, "name": pl.Utf8, "start_ms": pl.Float64,
                "end_ms": pl.Float64, "share": pl.Float64, "spans": pl.Int64, "binned": pl.Boolean}


def healthy_peer(data: DashboardData, run_id: str, rank: int) -> int | None:
    """A rank at the same position in another replica (else another member of its CP x TP group,
    else of its pipeline) with the median step time: the natural comparison for ``rank``."""
    lay = data.layout(run_id)
    dims = "dp" if lay.dp > 1 else (("cp", "tp") if lay.cp * lay.tp > 1 else "pp")
    peers = [r for r in lay.group(rank, dims) if r != rank]
    if not peers:
        return None
    med = (rank_step(data, run_id).filter(pl.col("rank").is_in(peers)).group_by("rank")
           .agg(pl.col("step_ms").median()).sort("step_ms", "rank"))
    return int(med["rank"][med.height // 2]) if med.height else peers[0]


def step_origin_ns(data: DashboardData, run_id: str, rank: int, step: int) -> int | None:
    """When ``rank`` began ``step`` on the run's common clock (``DashboardData.clock_offsets``)."""
    t = data.sql("SELECT rank, start_ns FROM steps WHERE run_id = $r AND rank = $k AND step = $s",
                 {"r": run_id, "k": rank, "s": step})
    t = data.on_common_clock(t, run_id, "start_ns")
    return int(t["start_ns"][0]) if t.height and t["start_ns"][0] is not None else None


def step_spans(data: DashboardData, run_id: str, ranks: list[int], step: int) -> tuple[pl.DataFrame, int | None]:
    """(spans, origin_ns): rank, lane (compute | collective | p2p), kind (compute | wait | transfer |
    send | recv), name, start_ms, end_ms, in ms from ``origin_ns``: when ranks[0] began the step
    (else the first span). Recent answers are kept: a zoom re-bins without querying again."""
    return data.recent(("spans", run_id, tuple(ranks), step), lambda: _query(data, run_id, ranks, step))


def aligned_spans(data: DashboardData, run_id: str, ranks: list[int] | None, step: int | None) -> pl.DataFrame:
    """rank, lane, kind, name, s, e (ns on the run's common clock: ``DashboardData.clock_offsets``) of
    ``ranks`` (None: every rank) in ``step`` (None: every step). Collectives are split at their
    last member's arrival into wait and transfer, so every member of an instance is read."""
    p: dict = {"r": run_id}
    where = "FROM {t} x WHERE x.run_id = $r"
    if step is not None:
        p["s"] = step
        where += " AND x.step = $s"
    mine = ""
    if ranks is not None:
        p["ranks"] = ranks
        mine = " AND list_contains($ranks, x.rank)"
    pr = {k: v for k, v in p.items()}
    pc = {k: v for k, v in p.items() if k != "ranks"}
    ev = data.on_common_clock(data.sql("SELECT x.rank, x.ts_ns, x.dur_ns, x.kind, x.name, x.phase, x.is_comm "
                                       + where.format(t="events") + mine, pr), run_id, "ts_ns")
    comp = compute_events(ev).select("rank", pl.lit("compute").alias("lane"), pl.lit("compute").alias("kind"),
                                     pl.coalesce("phase", "name").alias("name"), pl.col("ts_ns").alias("s"),
                                     (pl.col("ts_ns") + pl.col("dur_ns")).alias("e"))
    # every member of the instances: the last arrival splits each into wait and transfer
    coll = prefer_profiler(data.on_common_clock(data.sql(
        "SELECT x.rank, x.pg_name, x.seq, x.op, x.source, x.start_ns AS s, x.end_ns AS e "
        + where.format(t="collectives"), pc), run_id, "s", "e"))
    coll = coll.with_columns(pl.col("s").max().over("pg_name", "seq").alias("last"))
    if ranks is not None:
        coll = coll.filter(pl.col("rank").is_in(ranks))
    coll = coll.with_columns(pl.min_horizontal(pl.max_horizontal("last", "s"), "e").alias("last"),
                             pl.format("{} {}", "op", "pg_name").alias("name"))
    wait = coll.select("rank", pl.lit("collective").alias("lane"), pl.lit("wait").alias("kind"), "name", "s",
                       pl.col("last").alias("e"))
    xfer = coll.select("rank", pl.lit("collective").alias("lane"), pl.lit("transfer").alias("kind"), "name",
                       pl.col("last").alias("s"), "e")
    p2p = prefer_profiler(data.on_common_clock(data.sql(
        "SELECT x.rank, x.direction AS kind, x.direction || ' ' || x.peer AS name, x.source, x.start_ns AS s, "
        "x.end_ns AS e " + where.format(t="p2p") + mine, pr), run_id, "s", "e"))
    p2p = p2p.select("rank", pl.lit("p2p").alias("lane"), "kind", "name", "s", "e")
    return pl.concat([comp, wait, xfer, p2p], how="vertical_relaxed").filter(pl.col("e") >= pl.col("s"))


def _query(data: DashboardData, run_id: str, ranks: list[int], step: int) -> tuple[pl.DataFrame, int | None]:
    spans = aligned_spans(data, run_id, ranks, step)
    origin = step_origin_ns(data, run_id, ranks[0], step)
    if origin is None and spans.height:
        origin = int(spans["s"].min())
    if not spans.height:
        return pl.DataFrame(schema={k: GLYPH_SCHEMA[k] for k in ("rank", "lane", "kind", "name", "start_ms",
                                                                  "end_ms")}), origin
    return spans.select(pl.col("rank").cast(pl.Int32), "lane", "kind", "name",
                        ((pl.col("s") - origin) / 1e6).alias("start_ms"),
                        ((pl.col("e") - origin) / 1e6).alias("end_ms")).sort("rank", "lane", "start_ms"), origin


def lane_glyphs(spans: pl.DataFrame, window: tuple[float, float] | None = None,
                max_spans: int = TIMELINE_SPANS_PER_LANE, bins: int = TIMELINE_BINS) -> tuple[pl.DataFrame, bool]:
    """(glyphs, rastered): what to draw of ``spans`` in ``window`` (ms; None: all of it). A lane
    whose spans in the window number at most ``max_spans`` keeps its spans (all of them, when
    the whole lane is that small: zooming needs nothing more); a crowded lane becomes ``bins``
    time bins per kind (``binned``), ``share`` the busy fraction (0..1) and ``spans`` the count.
    ``rastered`` says whether any lane was."""
    if not spans.height:
        return pl.DataFrame(schema=GLYPH_SCHEMA), False
    lo, hi = window or (float(spans["start_ms"].min()), float(spans["end_ms"].max()))
    in_view = spans.filter((pl.col("end_ms") >= lo) & (pl.col("start_ms") <= hi))
    per_lane = dict(((r, ln), n) for r, ln, n in in_view.group_by(LANE_KEY).len().iter_rows())
    whole = dict(((r, ln), n) for r, ln, n in spans.group_by(LANE_KEY).len().iter_rows())
    out, rastered = [], False
    for (rank, lane), lane_spans in spans.partition_by(LANE_KEY, as_dict=True).items():
        exact = [pl.lit(1.0).alias("share"), pl.lit(1, pl.Int64).alias("spans"), pl.lit(False).alias("binned")]
        if whole[(rank, lane)] <= max_spans:
            out.append(lane_spans.with_columns(*exact))
        elif per_lane.get((rank, lane), 0) <= max_spans:
            out.append(lane_spans.filter((pl.col("end_ms") >= lo) & (pl.col("start_ms") <= hi)).with_columns(*exact))
        else:
            rastered = True
            out.append(_raster(lane_spans, rank, lane, lo, hi, bins))
    return pl.concat([o.select(list(GLYPH_SCHEMA)).cast(GLYPH_SCHEMA) for o in out]), rastered


def _raster(spans: pl.DataFrame, rank: int, lane: str, lo: float, hi: float, bins: int) -> pl.DataFrame:
    """Busy share and span count per (bin, kind) of one lane over [lo, hi]."""
    edges = np.linspace(lo, hi, bins + 1)
    width = edges[1] - edges[0]
    rows = []
    for kind, part in spans.partition_by("kind", as_dict=True).items():
        s, e = part["start_ms"].to_numpy(), part["end_ms"].to_numpy()
        covered = np.diff(_covered_before(s, e, edges))  # busy time per bin (overlaps count twice)
        ss, es = np.sort(s), np.sort(e)  # spans in bin [a, b): started before b, not ended before a
        count = np.searchsorted(ss, edges[1:], "left") - np.searchsorted(es, edges[:-1], "left")
        keep = covered > 0
        rows.append(pl.DataFrame({"kind": kind[0], "start_ms": edges[:-1][keep], "end_ms": edges[1:][keep],
                                  "share": np.minimum(covered[keep] / width, 1.0), "spans": count[keep]}))
    out = pl.concat(rows) if rows else pl.DataFrame(schema={k: GLYPH_SCHEMA[k] for k in
                                                            ("kind", "start_ms", "end_ms", "share", "spans")})
    return out.with_columns(pl.lit(rank, pl.Int32).alias("rank"), pl.lit(lane).alias("lane"), pl.lit(True).alias("binned"),
                            pl.format("{} spans, {}% busy", "spans", (pl.col("share") * 100).round(0).cast(pl.Int64))
                            .alias("name"))


def _covered_before(s: np.ndarray, e: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Total length of the intervals [s, e] left of each x: sum of clip(x - s, 0, e - s)."""
    ss, es = np.sort(s), np.sort(e)
    cs, ce = np.concatenate([[0.0], np.cumsum(ss)]), np.concatenate([[0.0], np.cumsum(es)])
    i, j = np.searchsorted(ss, x, "right"), np.searchsorted(es, x, "right")
    return (i * x - cs[i]) - (j * x - ce[j])

