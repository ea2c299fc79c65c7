"""Per-step, per-rank straggler scores and their candidate matrices (used by ``localize``).

Scores say how long a rank's peers waited on it:
- collective levels (dp, cp, tp): in every instance of a group of that dimension, a member's score
  is the group's median duration minus its own. Everyone waits for the last arrival, so the late
  member has the shortest collective; durations are within-rank, so no clock alignment is needed.
- the pipeline level (pp) is producer/consumer: a receive's duration is the consumer waiting on its
  producer (forward: stage s-1, backward: s+1). The producer's own wait on *its* producer for the
  same micro-batch and direction is inherited, not caused, so only the excess is blamed on it.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tracekit.analysis.collectives import match_collectives
from tracekit.analysis.tables import RunTables
from tracekit.topology import Layout


def collective_scores(tables: RunTables, level: str, matched: pl.DataFrame | None = None) -> pl.DataFrame:
    """(step, rank, score) at a collective level: median member duration minus the rank's own."""
    m = match_collectives(tables) if matched is None else matched
    exact = m.filter(pl.col("dim") == level)
    if not exact.height:  # e.g. ZeRO over dp x cp: use combined groups that include the level
        exact = m.filter(pl.col("dim").str.split("_").list.contains(level) & (pl.col("dim") != "other"))
    return exact.with_columns(
        (pl.col("duration_ns").median().over("pg_name", "seq") - pl.col("duration_ns")).alias("score")
    ).group_by(pl.col("step").fill_null(-1), "rank").agg(pl.col("score").sum().cast(pl.Float64))


def pipeline_scores(tables: RunTables) -> pl.DataFrame:
    """(step, rank, score): receive waits blamed on the producing rank, minus inherited waits,
    per direction in which the rank's stage can hold others up."""
    lay = tables.layout
    co = tables.coords().select("rank", "pp")
    recv = tables.p2p.filter(pl.col("direction") == "recv").select(
        pl.col("rank").cast(pl.Int32), pl.col("peer").cast(pl.Int32), pl.col("step").fill_null(-1),
        pl.coalesce("microbatch", "seq").alias("mb"), (pl.col("end_ns") - pl.col("start_ns")).alias("wait"))
    if not recv.height or lay.pp == 1:
        return pl.DataFrame(schema={"step": pl.Int64, "rank": pl.Int32, "score": pl.Float64})
    recv = recv.join(co, on="rank").join(co.rename({"rank": "peer", "pp": "peer_pp"}), on="peer")
    recv = recv.with_columns((pl.col("peer_pp") - pl.col("pp")).sign().alias("dir"))
    upstream = recv.select(pl.col("rank").alias("peer"), "step", "mb", "dir", pl.col("wait").alias("inherited"))
    upstream = upstream.group_by("peer", "step", "mb", "dir").agg(pl.col("inherited").max())
    blamed = recv.join(upstream, on=["peer", "step", "mb", "dir"], how="left").with_columns(
        (pl.col("wait") - pl.col("inherited").fill_null(0)).clip(lower_bound=0).alias("excess"))
    # A middle stage can hold up both neighbours (forward and backward), an end stage only one:
    # per direction, so that a balanced pipeline scores its stages alike.
    n_dirs = (pl.col("peer_pp") > 0).cast(pl.Float64) + (pl.col("peer_pp") < lay.pp - 1).cast(pl.Float64)
    return blamed.group_by("step", pl.col("peer").alias("rank")).agg(
        (pl.col("excess").sum() / n_dirs.first()).cast(pl.Float64).alias("score"))


def _cell_sums(scores: pl.DataFrame, coords: pl.DataFrame, rng: dict[str, int], keys: tuple[str, ...]):
    """(steps, key values per row, score sums per row, counts per key value): the scores of the
    ranks within ``rng`` summed per (step, key values), in numpy. The localizer asks for one such
    matrix per group it searches (148 on a 16,384-rank job's scope), and polars' fixed cost per
    operation made them 0.4 s; the sums are of whole and half nanoseconds, exact in any order."""
    mask = np.ones(coords.height, dtype=bool)
    for dim, v in rng.items():
        mask &= coords[dim].to_numpy() == v
    ranks = coords["rank"].to_numpy()[mask].astype(np.int64)
    vals = np.stack([coords[k].to_numpy()[mask].astype(np.int64) for k in keys], axis=1) if ranks.size else \
        np.zeros((0, len(keys)), dtype=np.int64)
    sr = scores["rank"].to_numpy().astype(np.int64)
    keep = scores["score"].is_not_null().to_numpy()
    row_of = np.full(max(int(ranks.max(initial=-1)), int(sr.max(initial=-1))) + 2, -1, dtype=np.int64)
    row_of[ranks] = np.arange(ranks.size)
    hit = keep & (sr >= 0) & (row_of[np.clip(sr, 0, None)] >= 0)
    at = row_of[sr[hit]]
    steps_of = scores["step"].to_numpy()[hit]
    steps, step_pos = np.unique(steps_of, return_inverse=True)
    return steps, step_pos, vals[at], scores["score"].to_numpy()[hit].astype(np.float64), vals


def score_matrix(scores: pl.DataFrame, coords: pl.DataFrame, rng: dict[str, int], level: str, size: int):
    """Steps x candidates matrix: per step, the mean score of the ranks within the range that have
    each coordinate value (a rank without a score row counts 0)."""
    steps, pos, cell, v, members = _cell_sums(scores, coords, rng, (level,))
    if not steps.size:
        return [], np.zeros((0, size))
    mat = np.zeros((steps.size, size))
    np.add.at(mat, (pos, cell[:, 0]), v)
    counts = np.bincount(members[:, 0], minlength=size)
    return [int(t) for t in steps], np.divide(mat, counts, out=np.zeros_like(mat), where=counts > 0)


def level_matrix(scores: pl.DataFrame, coords: pl.DataFrame, rng: dict[str, int], level: str, lay: Layout):
    """Like ``score_matrix``; at the pipeline level within one replica, each stage's blame is taken
    relative to the same stage in the other replicas (the median), which removes the bubbles and
    the first/last-stage asymmetry that every replica shares."""
    size = getattr(lay, level)
    if level != "pp" or "dp" not in rng or lay.dp == 1:
        return score_matrix(scores, coords, rng, level, size)
    steps, pos, cell, v, members = _cell_sums(scores, coords, {d: x for d, x in rng.items() if d != "dp"}, ("dp", "pp"))
    if not (cell[:, 0] == rng["dp"]).any():
        return [], np.zeros((0, size))
    cube = np.zeros((steps.size, lay.dp, size))
    np.add.at(cube, (pos, cell[:, 0], cell[:, 1]), v)
    counts = np.zeros((lay.dp, size))
    np.add.at(counts, (members[:, 0], members[:, 1]), 1.0)
    # a (replica, stage) cell without a score row stays 0, as its missing row did before
    cube = np.divide(cube, counts, out=np.zeros_like(cube), where=counts > 0)
    others = np.delete(cube, rng["dp"], axis=1)
    return [int(t) for t in steps], cube[:, rng["dp"], :] - np.median(others, axis=1)
