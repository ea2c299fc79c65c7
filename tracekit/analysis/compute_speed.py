"""Compute speed: each rank's own compute against the ranks that do the same work.

Waits (``scores.py``) say who held the others up; they carry every source of timing noise at once
(a preempted process, a late launch, a busy link), so a small but persistent slowdown can drown in
them. A slow device, though, is slow in *every* compute span. So the same spans are compared across
ranks: a span's own compute is its duration minus the communication nested in it (a TP peer that
waits inside a span is not computing), and spans are matched by (step, phase, virtual stage,
micro-batch, occurrence) among the ranks of the same pipeline stage (same layers, same shapes).
Each rank's per-step speed is the median over its spans of log(own / peers' median), so one
preempted span moves nothing; a culprit must then stand out over the steps, the step being the unit
of independent evidence (spans within a step share the machine's state).

Kernels of GPU traces without annotations, and the top-level CPU ops of CPU traces without them
(``tables.compute_events``), are matched by (step, name, occurrence) instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl

from tracekit.analysis.standout import spread
from tracekit.analysis.tables import RunTables, compute_events, prefer_profiler, per_tables
from tracekit.analysis.tunables import Tunables

_SCHEMA = {"step": pl.Int64, "rank": pl.Int32, "pp": pl.Int32, "log_ratio": pl.Float64, "log_total": pl.Float64,
           "excess_ns": pl.Float64, "ref_ns": pl.Float64, "spans": pl.UInt32}


@dataclass(frozen=True)
class ComputeFinding:
    verdict: str  # culprit | none | no_data
    rank: int | None  # the culprit (or the slowest rank, for the record, when verdict is none)
    ratio: float  # its compute over its peers' (exp of the mean per-step log ratio difference)
    margin: float  # effect in noise units
    bar: float  # the margin it had to reach
    steps_total: int
    steps_slower: int  # steps in which it computed slower than its peers' median
    ratios: dict[int, float] = field(default_factory=dict)  # every rank's compute over its peers'

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratios"] = {str(k): v for k, v in self.ratios.items()}
        return d


@per_tables
def own_compute_spans(tables: RunTables) -> pl.DataFrame:
    """(rank, step, key, own_ns): compute spans with the communication nested in them removed."""
    comp = compute_events(tables.events).filter(pl.col("step").is_not_null())
    if not comp.height:
        return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "key": pl.Utf8, "own_ns": pl.Float64})
    comp = comp.with_columns(pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64)).sort("rank", "ts_ns")
    comp = comp.with_row_index("sid").with_columns(
        pl.col("ts_ns").cast(pl.Int64).alias("s0"), (pl.col("ts_ns") + pl.col("dur_ns")).cast(pl.Int64).alias("e0"))
    comm = pl.concat([prefer_profiler(tables.collectives).select("rank", "start_ns", "end_ns"),
                      tables.p2p.select("rank", "start_ns", "end_ns")], how="vertical_relaxed")
    ops = comm.select(pl.col("rank").cast(pl.Int32), pl.col("start_ns").cast(pl.Int64).alias("s"),
                      pl.col("end_ns").cast(pl.Int64).alias("e")).drop_nulls().sort("rank", "s")
    nested = pl.DataFrame(schema={"sid": pl.UInt32, "nested": pl.Int64})
    if ops.height:
        hit = ops.join_asof(comp.select("rank", "sid", "s0", "e0", pl.col("nested_comm_ns").is_not_null().alias("own"))
                            .sort("rank", "s0"), left_on="s", right_on="s0",
                            by="rank", strategy="backward", check_sortedness=False)
        hit = hit.filter(pl.col("e0").is_not_null() & (pl.col("s") >= pl.col("s0")) & (pl.col("e") <= pl.col("e0"))
                         & pl.col("own").not_())
        # overlapping ops (a comm span and its nested transport op) count once: merge per span
        hit = hit.sort("sid", "s").with_columns(pl.col("e").cum_max().shift(1).over("sid").alias("prev"))
        hit = hit.with_columns((pl.col("e") - pl.max_horizontal("s", pl.col("prev").fill_null(pl.col("s"))))
                               .clip(lower_bound=0).alias("c"))
        nested = hit.group_by("sid").agg(pl.col("c").sum().cast(pl.Int64).alias("nested"))
    annotated = pl.col("phase").is_not_null()
    base = pl.when(annotated).then(pl.format("{}|{}|{}", pl.col("phase"), pl.col("vstage").fill_null(-1),
                                             pl.col("microbatch").fill_null(-1))).otherwise(pl.col("name"))
    # CPU op spans come with their nested communication (same thread) already measured
    comp = comp.join(nested, on="sid", how="left").with_columns(
        pl.coalesce("nested_comm_ns", "nested").alias("nested"), base.alias("base"))
    comp = comp.with_columns(pl.int_range(pl.len()).over("rank", "step", "base").alias("occ"))
    return comp.select("rank", "step", pl.format("{}#{}", "base", "occ").alias("key"),
                       (pl.col("dur_ns") - pl.col("nested").fill_null(0)).clip(lower_bound=0)
                       .cast(pl.Float64).alias("own_ns"))


SPIKE_CAP = 3.0  # a span longer than this many times its own median over the steps was descheduled


@per_tables
def steady_compute(tables: RunTables) -> pl.DataFrame:
    """(rank, step, compute_ns): each rank's own compute per step with every span capped at
    ``SPIKE_CAP`` x the same span's median over the rank's steps. Kernel noise is 2-15%; a span
    descheduled 5-30x is time lost, not work: in a stage of two ranks beside a culprit, one such span
    in 6 of 8 steps of the other rank made the stage read 1.16x the median stage (a false stage
    finding on a grid draw). More work (more layers, longer documents) lengthens every span and
    every step alike, and stays."""
    spans = own_compute_spans(tables)
    if not spans.height:
        return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "compute_ns": pl.Float64})
    cap = pl.col("own_ns").median().over("rank", "key") * SPIKE_CAP
    return (spans.with_columns(pl.min_horizontal("own_ns", cap).alias("own_ns"))
            .group_by("rank", "step").agg(pl.col("own_ns").sum().alias("compute_ns")).sort("rank", "step"))


@per_tables
def compute_speed(tables: RunTables, culprits: frozenset[int] = frozenset(), device_only: bool = False) -> pl.DataFrame:
    """(step, rank, log_ratio, log_total, excess_ns, spans): per step, the 20%-trimmed mean over the rank's compute
    spans of log(own compute / mean of the same span on the other ranks of its pipeline stage), which a
    slow device moves and a few preempted spans do not; and log(its total own compute / those
    references summed), which more work (long documents in some micro-batches) moves as well; and
    that excess in ns (own total minus the references summed), and the references summed (ref_ns).

    ``culprits``: ranks known to be slow (a first look's persistent culprits), left out of every
    other rank's reference, where the stage keeps another rank to compare with.

    ``device_only``: the attention kernels left out (``data_heavy``: where ranks get unequal
    attention work, those kernels measure the data, and with CP = 2 half a stage is heavy, so the
    ranks' speeds split in two and no device stands out against that spread)."""
    spans = own_compute_spans(tables)
    if device_only:
        spans = spans.filter(~is_attention(pl.col("key")))
    if not spans.height:
        return pl.DataFrame(schema=_SCHEMA)
    spans = spans.join(tables.coords().select("rank", "pp"), on="rank")
    peers = ["pp", "step", "key"]
    own = pl.col("own_ns")
    # each span's peers summarized once and joined back (a group-by: window expressions over the
    # same keys took 1.7x as long on a 16,384-rank job's 336-rank scope)
    healthy = ~pl.col("rank").is_in(list(culprits))
    mine = pl.when(healthy).then(own).otherwise(0.0)  # a culprit's own time is no reference
    spans = spans.join(spans.group_by(peers).agg(
        pl.len().alias("n"), own.sum().alias("peers_sum"), own.max().alias("top"),
        own.top_k(2).min().alias("second"), healthy.sum().alias("healthy_n"), mine.sum().alias("healthy_sum")),
        on=peers, how="left", maintain_order="left")
    n = pl.col("n")
    rest = pl.col("peers_sum") - own
    if culprits:
        # each span against the mean of the same span on the stage's other ranks that are not
        # culprits (all its other ranks where none is left): leaving out only the largest other
        # rank, as a first look must, leaves a second culprit in its stage's references (beside two
        # 1.5x ranks of 8 the culprits read 1.58-1.62x; two of a stage's four, 1.36x); with them
        # out, every reference is a plain mean of healthy ranks and needs no rescale below
        others = pl.col("healthy_n") - healthy.cast(pl.UInt32)
        ref = pl.when(others >= 1).then((pl.col("healthy_sum") - mine) / others).otherwise(rest / (n - 1))
    else:
        # the reference is the mean of the *other* ranks' same span: with two ranks per stage, a
        # median that includes the rank itself would halve its own slowdown and mirror it onto its
        # peer. With three others or more, the largest of them is left out: a slow rank would
        # otherwise lift every peer's reference and make its whole stage look fast (and, beside
        # it, every other stage slow)
        top, second = pl.col("top"), pl.col("second")
        top_other = pl.when(own >= top).then(second).otherwise(top)  # the largest of the others
        ref = pl.when(n >= 4).then((rest - top_other) / (n - 2)).otherwise(rest / (n - 1))
    spans = spans.with_columns(ref.alias("ref"), n.alias("n"))
    spans = spans.filter((pl.col("n") > 1) & (pl.col("own_ns") > 0) & (pl.col("ref") > 0))
    lr = (pl.col("own_ns") / pl.col("ref")).log()
    middle = middle_mean(lr)
    speed = spans.group_by("step", "rank").agg(
        pl.col("pp").first(), middle.alias("log_ratio"),
        (pl.col("own_ns").sum() / pl.col("ref").sum()).log().alias("log_total"),
        pl.col("own_ns").sum().alias("own_ns"), pl.col("ref").sum().alias("ref_ns"), pl.len().alias("spans")
    ).sort("step", "rank")  # the means below sum in this order: the same bits from any store
    # Leaving out the largest peer lowers the reference in a stage without a culprit (there the
    # largest is noise) and not in the culprit's stage (there it is the culprit): every rank of the
    # other stages then read 1-3% slow (at 10-15% kernel noise), and beside a strong culprit the
    # fastest-looking of them was named too (2 of 24 slow ranks of a schedule-drawn grid). Each
    # stage's references are rescaled so that its typical rank's ratio is 1, where the largest was
    # left out (stages of 4 ranks or more); the median over the stage's ranks, so a culprit in it
    # moves nothing.
    per_rank = speed.group_by("pp", "rank").agg(pl.col("log_ratio").mean())
    typical = pl.lit(0.0) if culprits else pl.when(pl.len() >= 4).then(pl.col("log_ratio").median()).otherwise(0.0)
    offset = per_rank.group_by("pp").agg(typical.alias("offset"))
    speed = speed.join(offset, on="pp").with_columns(pl.col("ref_ns") * pl.col("offset").exp())
    return speed.select(
        "step", "rank", "pp", pl.col("log_ratio") - pl.col("offset"), pl.col("log_total") - pl.col("offset"),
        (pl.col("own_ns") - pl.col("ref_ns")).alias("excess_ns"), "ref_ns", "spans"
    ).sort("step", "rank").cast(_SCHEMA)


def middle_mean(lr: pl.Expr) -> pl.Expr:
    """The mean of the middle 60% of span log ratios: as robust to a few preempted spans as a median,
    with a smaller spread (more of the spans count), which a 3% slowdown needs."""
    return lr.filter((lr >= lr.quantile(0.2)) & (lr <= lr.quantile(0.8))).mean()


def step_scatter(mat: np.ndarray) -> float:
    """Step-to-step scatter of a (step x rank) log-ratio matrix pooled over every rank (two-way
    residuals: rank and step effects removed), as a robust standard deviation."""
    resid = mat - np.nanmedian(mat, axis=0, keepdims=True)
    resid = resid - np.nanmedian(resid, axis=1, keepdims=True)
    return spread(resid[np.isfinite(resid)])


@functools.lru_cache(maxsize=256)
def scatter_bias(steps: int, ranks: int) -> float:
    """``step_scatter``'s expected value on a (steps x ranks) table of unit normal noise: a MAD of
    median-polish residuals reads low on small tables (0.72 at 8 x 8, 0.79 at 8 x 16, 0.87 at 20 x
    16), as the row and column medians take part of the noise out. From 400 seeded tables (fewer
    for large ones, whose scatter varies less: 83 at 20 x 240), so the same shape always gets the
    same factor."""
    if steps < 2 or ranks < 2:
        return 1.0
    tables = 400 if steps * ranks <= 1000 else max(50, 400_000 // (steps * ranks))
    x = np.random.default_rng(steps * 10_007 + ranks).standard_normal((tables, steps, ranks))
    r = x - np.median(x, axis=1, keepdims=True)  # step_scatter's residuals, for every table at once
    r = (r - np.median(r, axis=2, keepdims=True)).reshape(tables, -1)
    return float(np.mean(1.4826 * np.median(np.abs(r - np.median(r, axis=1, keepdims=True)), axis=1)))


def compute_excess(speed: pl.DataFrame, tunables: Tunables = Tunables()) -> tuple[pl.DataFrame, float]:
    """(step, rank, excess): each rank's log compute ratio minus its stage peers' median that step;
    and the bar a single step's excess must clear to stand out: ``compute_margin_min`` step
    scatters, and at least ``compute_effect_min_ratio``."""
    tun = tunables
    wide = speed.pivot(on="rank", index="step", values="log_ratio").sort("step")
    ranks = [int(c) for c in wide.columns[1:]]
    mat = wide.drop("step").to_numpy().astype(float)
    bar = max(tun.compute_margin_min * max(step_scatter(mat), tun.compute_noise_floor),
              math.log(tun.compute_effect_min_ratio))
    rows = []
    for i, t in enumerate(wide["step"].to_list()):
        for j, r in enumerate(ranks):
            others = np.delete(mat[i], j)
            if np.isfinite(mat[i, j]) and np.isfinite(others).any():
                rows.append({"step": t, "rank": r, "excess": float(mat[i, j] - np.nanmedian(others))})
    return pl.DataFrame(rows, schema={"step": pl.Int64, "rank": pl.Int64, "excess": pl.Float64}), bar


def compute_outlier(speed: pl.DataFrame, tunables: Tunables = Tunables()) -> ComputeFinding:
    """The rank whose compute is persistently slower than its peers', if any stands out.

    Per step, the top rank's log ratio minus the median of the others' is one sample of its effect;
    the noise unit is the larger of its standard error (pooled step-to-step scatter / sqrt(steps)) and the
    spread of the other ranks' own means (ranks differ a little for reasons that are not a fault),
    leaving out the candidate's own stage: their reference includes the candidate, so a slow rank
    makes them look fast (with two ranks per stage, its exact mirror image) and would inflate it.
    The bar rises with the number of ranks competing for the top (``compute_margin_*``)."""
    tun = tunables
    if not speed.height or speed["rank"].n_unique() < 2:
        return ComputeFinding("no_data", None, 1.0, 0.0, 0.0, 0, 0)
    wide = speed.pivot(on="rank", index="step", values="log_ratio").sort("step")
    ranks = [int(c) for c in wide.columns if c != "step"]
    mat = wide.select([str(r) for r in ranks]).to_numpy().astype(float)
    mat = mat[np.isfinite(mat).sum(axis=1) >= 2]
    T, n = mat.shape
    means = np.nanmedian(mat, axis=0)  # robust: a step of heavy preemption moves nothing
    ratios = {r: float(math.exp(m)) for r, m in zip(ranks, means) if np.isfinite(m)}
    bar = tun.compute_margin_min + tun.compute_margin_per_log * math.log(max(1.0, n / 2))
    if T < tun.compute_min_steps:
        return ComputeFinding("none", None, 1.0, 0.0, bar, T, 0, ratios)
    top = int(np.nanargmax(means))
    others = np.delete(mat, top, axis=1)
    diffs = mat[:, top] - np.nanmedian(others, axis=1)
    diffs = diffs[np.isfinite(diffs)]
    effect = float(np.median(diffs))
    # pooled over every rank: the top rank's own few differences would estimate it too low by chance
    scatter = step_scatter(mat)
    sem = 1.2533 * scatter / math.sqrt(diffs.size)  # standard error of a median
    stage_of = dict(speed.select("rank", "pp").unique().iter_rows())
    unaffected = [i for i, r in enumerate(ranks) if i != top and stage_of.get(r) != stage_of.get(ranks[top])]
    others_means = means[unaffected] if len(unaffected) >= 2 else np.delete(means, top)
    noise = max(sem, spread(others_means[np.isfinite(others_means)]), tun.compute_noise_floor)
    margin = effect / noise
    slower = int((diffs > 0).sum())
    ok = (margin >= bar and effect >= math.log(tun.compute_effect_min_ratio)
          and slower / diffs.size >= tun.persist_min)
    return ComputeFinding("culprit" if ok else "none", ranks[top], float(math.exp(effect)), float(margin), float(bar),
                          int(diffs.size), slower, ratios)


ATTENTION = ("flash", "attn", "attention", "sdpa", "softmax", "fmha")


def is_attention(key: pl.Expr) -> pl.Expr:
    """Whether a span's key (kernel name) is an attention kernel, whose cost follows the data."""
    return key.str.to_lowercase().str.contains("|".join(ATTENTION))


@per_tables
def classed_spans(tables: RunTables) -> pl.DataFrame:
    """(rank, step, key, own_ns, ref, attn, lr): each compute span against the mean of the same span
    on its stage's other ranks (lr: log of the ratio), and whether it is an attention kernel (whose
    cost follows the data): what ``attention_split`` and ``data_heavy`` read."""
    spans = own_compute_spans(tables).join(tables.coords().select("rank", "pp"), on="rank")
    peers = ["pp", "step", "key"]
    n = pl.len().over(peers)
    spans = spans.with_columns(((pl.col("own_ns").sum().over(peers) - pl.col("own_ns")) / (n - 1)).alias("ref"),
                               is_attention(pl.col("key")).alias("attn"))
    spans = spans.filter((n > 1) & (pl.col("own_ns") > 0) & (pl.col("ref") > 0))
    return spans.with_columns((pl.col("own_ns") / pl.col("ref")).log().alias("lr"))


def attention_split(tables: RunTables, rank: int, steps: list[int] | None = None) -> tuple[float, float] | None:
    """(attention kernels' ratio, other kernels' ratio): the rank's own compute over its stage
    peers' mean, per class the 20%-trimmed mean over the matched spans of log(own / peers' mean),
    as ``compute_speed``'s. A slow device slows both alike; more attention work (document-mask
    imbalance, Llama 3 sec. 7.3.2) only the first. Trimmed, not summed: one descheduled kernel (5-30x)
    in a sum over a few steps lifted the other class by 9-38% and made a CP rank with more documents a
    "slow worker" (2 of 12 CP-imbalance cases of a hold-out grid draw). None when the spans carry no
    kernel names of both classes."""
    own = classed_spans(tables).filter(pl.col("rank") == rank)
    if steps is not None:
        own = own.filter(pl.col("step").is_in(steps))
    per = own.group_by("attn").agg(middle_mean(pl.col("lr")).exp())
    got = {a: r for a, r in per.iter_rows() if r is not None}
    return (got[True], got[False]) if True in got and False in got else None
