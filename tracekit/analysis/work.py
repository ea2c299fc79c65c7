"""How compute follows work: the attention work each rank held (sum of len^2 over its documents,
WLB-LLM) and how much of a late rank's, group's or moving member's extra compute that work
predicts. rootcause.py uses these to tell data imbalance (more work) from a slow device."""

from __future__ import annotations

import numpy as np
import polars as pl

from tracekit.analysis.tables import RunTables
from tracekit.analysis.tunables import Tunables


def per_cell(work: pl.DataFrame) -> pl.DataFrame:
    """Work per (rank, step)."""
    return work.group_by("rank", "step").agg(pl.col("work").sum())


def _flat(x: np.ndarray) -> bool:
    """The work hardly varies (under 5% of its mean): nothing to learn a relation from."""
    return bool(x.std() < 0.05 * max(abs(x.mean()), 1e-9))


def attention_work(doc_lengths: list[int]) -> int:
    """Causal attention work of a packed sequence: sum over documents of len^2 (WLB-LLM)."""
    return int(sum(n * n for n in doc_lengths))


def work_from_manifest(manifest: dict) -> pl.DataFrame | None:
    """Attention work per (rank, step) from a manifest's ``attention_work`` ({step: {rank: work}},
    e.g. ``attention_work`` of the documents each rank held); None when the manifest has none."""
    raw = manifest.get("attention_work") if isinstance(manifest, dict) else None
    if not isinstance(raw, dict) or not raw:
        return None
    try:
        rows = [(int(r), int(s), float(w)) for s, per in raw.items() for r, w in per.items()]
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"manifest: malformed attention_work ({e})") from None
    return pl.DataFrame(rows, schema={"rank": pl.Int32, "step": pl.Int64, "work": pl.Float64}, orient="row")


def work_fit(x: np.ndarray, y: np.ndarray, tun: Tunables) -> tuple[float, float] | None:
    """Least-squares compute = icept + slope * work, when compute demonstrably follows work: the
    work varies (by 5% of its mean at least) and the slope is positive beyond ``work_fit_t_min``
    standard errors. None otherwise: noise correlated with work by chance explains nothing."""
    if x.size < 3 or _flat(x):
        return None
    slope, icept = np.polyfit(x, y, 1)
    resid = y - (icept + slope * x)
    dof = x.size - 2
    if dof <= 0:
        return None
    se = float(np.sqrt((resid @ resid) / dof / ((x - x.mean()) @ (x - x.mean()))))
    if slope <= 0 or (se > 0 and slope / se < tun.work_fit_t_min):
        return None
    return float(slope), float(icept)


def _cells_fit(cells: pl.DataFrame, tun: Tunables
               ) -> tuple[np.ndarray, np.ndarray, tuple[float, float]] | float | None:
    """Work (x), compute (y) and the fit over (rank, step) ``cells``; when compute does not follow
    work, the share to report instead: None if the work hardly varies (nothing to learn from),
    else 0.0 (the work explains nothing)."""
    x, y = cells["work"].to_numpy().astype(float), cells["compute_ns"].to_numpy().astype(float)
    fit = work_fit(x, y, tun)
    if fit is None:
        return None if _flat(x) else 0.0
    return x, y, fit


def explained_share(work: pl.DataFrame, metrics: pl.DataFrame, rank: int, peers: list[int],
                   tun: Tunables) -> float | None:
    """How much of the rank's extra compute its extra attention work predicts, from how compute
    follows work over its peers' (rank, step) cells (least squares). A kernel whose cost ignores
    the mask (dense attention) gives a flat fit and explains nothing, however uneven the documents.
    None when the peers' work hardly varies (nothing to learn the relation from)."""
    w = per_cell(work)
    cells = w.join(metrics.select("rank", "step", "compute_ns"), on=["rank", "step"])
    peer = cells.filter(pl.col("rank").is_in(peers))
    own = cells.filter(pl.col("rank") == rank)
    if peer.height < 3 or not own.height:
        return None
    fitted = _cells_fit(peer, tun)
    if not isinstance(fitted, tuple):
        return fitted
    _, y, (slope, icept) = fitted
    base = float(np.median(y))
    actual = float(own["compute_ns"].median()) - base
    predicted = float(np.median(icept + slope * own["work"].to_numpy().astype(float))) - base
    return max(0.0, predicted / actual) if actual > 0 else None


def group_share(work: pl.DataFrame, metrics: pl.DataFrame, tables: RunTables, group: set[int],
                tun: Tunables) -> float | None:
    """How much of a late group's extra compute (over the rest of its stages' ranks) its extra
    attention work predicts, compute following work as fitted over every rank of those stages and
    every step. None without a compute excess or without work variation to fit."""
    lay = tables.layout
    stages = {lay.coords(r).pp for r in group}
    ranks = [r for r in range(lay.world_size) if lay.coords(r).pp in stages]
    cells = per_cell(work).join(
        metrics.select("rank", "step", "compute_ns"), on=["rank", "step"]).filter(pl.col("rank").is_in(ranks))
    if cells.height < 3 or not (~cells["rank"].is_in(list(group))).any():
        return None
    fitted = _cells_fit(cells, tun)
    if not isinstance(fitted, tuple):
        return fitted
    x, y, (slope, _) = fitted
    inside = cells["rank"].is_in(list(group)).to_numpy()
    actual = float(np.median(y[inside]) - np.median(y[~inside]))
    predicted = float(slope * (np.median(x[inside]) - np.median(x[~inside])))
    return max(0.0, predicted / actual) if actual > 0 else None


def moving_share(work: pl.DataFrame, m: pl.DataFrame, hits: pl.DataFrame, level: str,
                 tun: Tunables) -> float | None:
    """Median over the standout steps of how much of the late member's extra compute (over its
    step's mean) its extra work predicts, compute following work as fitted over all (rank, step)."""
    cells = per_cell(work).join(m, on=["rank", "step"])
    if cells.height < 3:
        return None
    fitted = _cells_fit(cells, tun)
    if not isinstance(fitted, tuple):
        return fitted
    _, _, (slope, _) = fitted
    cells = cells.with_columns((pl.col("work") * float(slope)).alias("pred"))
    shares = []
    for step, member in hits.select("step", level).iter_rows():
        at = cells.filter(pl.col("step") == step)
        late = at.filter(pl.col(level) == member)
        actual = float(late["compute_ns"].mean() - at["compute_ns"].mean()) if late.height else 0.0
        if actual > 0:
            shares.append(max(0.0, float(late["pred"].mean() - at["pred"].mean())) / actual)
    return float(np.median(shares)) if shares else None


def work_ratio(work: pl.DataFrame, rank: int, peers: list[int], steps) -> float | None:
    w = per_cell(work)
    if steps is not None:
        w = w.filter(pl.col("step").is_in(steps))
    own = w.filter(pl.col("rank") == rank).select("step", pl.col("work").alias("own"))
    ref = w.filter(pl.col("rank").is_in(peers)).group_by("step").agg(pl.col("work").median().alias("ref"))
    j = own.join(ref, on="step").filter(pl.col("ref") > 0)
    return float((j["own"] / j["ref"]).median()) if j.height else None
