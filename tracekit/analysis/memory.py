"""Per-rank memory from allocator trace rows (the store's ``memory_events`` table).

Input: a polars DataFrame with the ``memory_events`` columns (tracekit.schema): at least rank, seq,
action, addr, size; run_id, ts_ns, category, frame are used when present. Every computation is
columnar (polars), so a rank with millions of trace entries is never turned into Python objects.

Allocator semantics (CUDA caching allocator trace, FORMATS.md section 3): ``alloc`` makes a block
live; it stops counting as allocated at ``free_completed`` (``free_requested`` only marks it as
pending while other streams still use it). A ``free_completed`` with no earlier ``alloc`` of that
address in the trace is a block allocated before recording started: it counts as live from the
start (the "baseline"). Blocks allocated before recording and never freed in it appear only in the
snapshot's end state (``memory_blocks``): an active block at an address the trace never touches was
live all along, and counts in the baseline with its category (the model state, typically).
Reserved memory follows segment events: ``segment_alloc``/``segment_map`` add,
``segment_free``/``segment_unmap`` subtract.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from tracekit.topology import Layout

REQUIRED = ("rank", "seq", "action", "addr", "size")
KEY = ["run_id", "rank"]  # a rank's identity in every output
G = "g"  # internal integer id of (run_id, rank): sorts and windows on one int, not a string + int
RESERVE_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


class MemoryDataError(ValueError):
    """memory_events rows that cannot be analysed (missing columns, bad values)."""


def _same_as(step: int, cols: list[str]) -> pl.Expr:
    """The row ``step`` away has the same values in ``cols`` (for frames sorted by them)."""
    return pl.all_horizontal(pl.col(c) == pl.col(c).shift(step) for c in cols).fill_null(False)


def _normalize(events: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(events sorted by rank and seq with defaults filled and an integer rank id G, the ranks:
    G -> run_id, rank). Sorting is skipped when the rows already come in order (as ingest writes)."""
    missing = [c for c in REQUIRED if c not in events.columns]
    if missing:
        raise MemoryDataError(f"memory_events rows lack columns {missing}; have {events.columns}")
    defaults = {"run_id": pl.lit(""), "ts_ns": pl.lit(None, pl.Int64),
                "category": pl.lit(None, pl.Utf8), "frame": pl.lit(None, pl.Utf8)}
    ev = events.with_columns([v.alias(k) for k, v in defaults.items() if k not in events.columns])
    bad = ev.filter(pl.col("size").is_null() | (pl.col("size") < 0)
                    | pl.col("rank").is_null() | pl.col("seq").is_null())
    if bad.height:
        raise MemoryDataError(f"{bad.height} memory_events rows have a null rank/seq or a null or "
                              f"negative size (first: {bad.row(0, named=True)})")
    ev = ev.with_columns(
        pl.col("size").cast(pl.Int64), pl.col("seq").cast(pl.Int64), pl.col("ts_ns").cast(pl.Int64),
        pl.col("run_id").cast(pl.Utf8).fill_null(""), pl.col("action").cast(pl.Categorical),
        # a few distinct strings repeated millions of times: categories, 4 bytes a row
        pl.col("category").cast(pl.Utf8).fill_null("unknown").cast(pl.Categorical),
        pl.col("frame").cast(pl.Utf8).fill_null("<unknown>").cast(pl.Categorical),
    )
    in_order = ev.select(
        ((pl.col("run_id") > pl.col("run_id").shift(1))
         | ((pl.col("run_id") == pl.col("run_id").shift(1))
            & ((pl.col("rank") > pl.col("rank").shift(1))
               | ((pl.col("rank") == pl.col("rank").shift(1)) & (pl.col("seq") > pl.col("seq").shift(1))))))
        .fill_null(True).all()).item()
    if not in_order:
        ev = ev.sort(KEY + ["seq"])
    # sorted, a duplicate is a repeat of the previous row's key (hash group-bys over millions of
    # distinct keys are what makes large traces slow; sorts and shifts are not)
    dup = ev.filter(_same_as(-1, KEY + ["seq"]))
    if dup.height:
        raise MemoryDataError(f"seq is not unique within a rank: {dup.row(0, named=True)}")
    ev = ev.with_columns((~_same_as(1, KEY)).cum_sum().cast(pl.Int64).alias(G))
    ranks = ev.filter(~_same_as(1, KEY)).select(G, *KEY)
    return ev.select(G, "seq", "ts_ns", "action", "addr", "size", "category", "frame"), ranks


def _lifetimes(ev: pl.DataFrame) -> pl.DataFrame:
    # Sort narrow rows by (rank, address); ev is in seq order, so a stable sort keeps each address's
    # events in seq order. Neighbours at the same address come from plain shifts (a window over
    # millions of addresses is slow), and the string columns are gathered only for the blocks kept.
    narrow = (ev.select(pl.int_range(pl.len(), dtype=pl.Int64).alias("row"), G, "addr", "seq", "ts_ns",
                        "size", "action")
              .filter(pl.col("action").is_in(["alloc", "free_completed"]))
              .sort([G, "addr"], maintain_order=True))
    block = [G, "addr"]
    narrow = narrow.with_columns(
        pl.when(_same_as(-1, block)).then(pl.col("seq").shift(-1)).alias("next_seq"),
        pl.when(_same_as(-1, block)).then(pl.col("ts_ns").shift(-1)).alias("next_ts_ns"),
        pl.when(_same_as(1, block)).then(pl.col("action").shift(1)).alias("prev_action"),
    )
    allocated = narrow.filter(pl.col("action") == "alloc").select(
        "row", G, "addr", "size",
        pl.col("seq").alias("alloc_seq"), pl.col("ts_ns").alias("alloc_ts_ns"),
        # the next event at this address ends the block (a free, or an alloc if a free went unrecorded)
        pl.col("next_seq").alias("free_seq"), pl.col("next_ts_ns").alias("free_ts_ns"),
    )
    before = narrow.filter((pl.col("action") == "free_completed")
                           & (pl.col("prev_action").is_null() | (pl.col("prev_action") != "alloc"))).select(
        "row", G, "addr", "size",
        pl.lit(None, pl.Int64).alias("alloc_seq"), pl.lit(None, pl.Int64).alias("alloc_ts_ns"),
        pl.col("seq").alias("free_seq"), pl.col("ts_ns").alias("free_ts_ns"),
    )
    life = pl.concat([allocated, before])
    return life.with_columns(ev["category"].gather(life["row"]), ev["frame"].gather(life["row"])).select(
        G, "addr", "size", "category", "frame", "alloc_seq", "alloc_ts_ns", "free_seq", "free_ts_ns")


def _resident(life: pl.DataFrame, blocks: pl.DataFrame | None, ranks: pl.DataFrame) -> pl.DataFrame:
    """Lifetimes plus the blocks live through the whole trace: active in the snapshot's end state
    (``memory_blocks``) at an address with no trace event. (An active block at an address whose
    last event is a free contradicts the trace and is left out.)"""
    if blocks is None or blocks.height == 0:
        return life
    missing = [c for c in ("rank", "address", "size", "state") if c not in blocks.columns]
    if missing:
        raise MemoryDataError(f"memory_blocks rows lack columns {missing}; have {blocks.columns}")
    b = blocks if "run_id" in blocks.columns else blocks.with_columns(pl.lit("").alias("run_id"))
    for col in ("category", "frame"):
        if col not in b.columns:
            b = b.with_columns(pl.lit(None, pl.Utf8).alias(col))
    b = (b.filter(pl.col("state").str.starts_with("active"))
         .with_columns(pl.col("run_id").cast(pl.Utf8).fill_null(""), pl.col("rank").cast(ranks.schema["rank"]))
         .join(ranks, on=KEY)
         .select(G, pl.col("address").cast(pl.Int64).alias("addr"), pl.col("size").cast(pl.Int64),
                 pl.col("category").cast(pl.Utf8).fill_null("unknown").cast(pl.Categorical),
                 pl.col("frame").cast(pl.Utf8).fill_null("<unknown>").cast(pl.Categorical)))
    if b.filter(pl.col("size").is_null() | (pl.col("size") < 0)).height:
        raise MemoryDataError("memory_blocks rows with a null or negative size")
    before = b.join(life.select(G, "addr").unique(), on=[G, "addr"], how="anti").with_columns(
        pl.lit(None, pl.Int64).alias("alloc_seq"), pl.lit(None, pl.Int64).alias("alloc_ts_ns"),
        pl.lit(None, pl.Int64).alias("free_seq"), pl.lit(None, pl.Int64).alias("free_ts_ns"))
    return pl.concat([life, before.select(life.columns)], how="vertical_relaxed")


def _timeline(life: pl.DataFrame) -> pl.DataFrame:
    # blocks from before the trace start the running sum (a row at seq -1, dropped afterwards)
    baseline = life.filter(pl.col("alloc_seq").is_null()).group_by(G).agg(
        pl.lit(-1, pl.Int64).alias("seq"), pl.lit(None, pl.Int64).alias("ts_ns"),
        pl.col("size").sum().alias("delta"))
    deltas = pl.concat([
        baseline.select(G, "seq", "ts_ns", "delta"),
        life.filter(pl.col("alloc_seq").is_not_null()).select(
            G, pl.col("alloc_seq").alias("seq"), pl.col("alloc_ts_ns").alias("ts_ns"),
            pl.col("size").alias("delta")),
        life.filter(pl.col("free_seq").is_not_null()).select(
            G, pl.col("free_seq").alias("seq"), pl.col("free_ts_ns").alias("ts_ns"),
            (-pl.col("size")).alias("delta")),
    ]).sort([G, "seq", "delta"])  # at one seq (an alloc ending an unfreed block) frees go first
    out = deltas.with_columns(pl.col("delta").cum_sum().over(G).alias("allocated"))
    # one row per seq: the state after all of its changes
    return (out.filter(~_same_as(-1, [G, "seq"]) & (pl.col("seq") >= 0))
            .select(G, "seq", "ts_ns", "allocated"))


def _reserved(ev: pl.DataFrame, ranks: pl.DataFrame, segments: pl.DataFrame | None) -> pl.DataFrame:
    ev = ev.filter(pl.col("action").is_in(list(RESERVE_SIGN)))
    ev = ev.with_columns((pl.col("action").cast(pl.Utf8).replace_strict(RESERVE_SIGN, return_dtype=pl.Int64)
                          * pl.col("size")).alias("delta"))
    net = ev.group_by(G).agg(pl.col("delta").sum().alias("net"))
    start = net.select(G, pl.lit(0, pl.Int64).alias("start"))
    if segments is not None and segments.height:
        seg = segments if "run_id" in segments.columns else segments.with_columns(pl.lit("").alias("run_id"))
        end = (seg.with_columns(pl.col("rank").cast(ranks.schema["rank"]))
               .join(ranks, on=KEY).group_by(G).agg(pl.col("total_size").sum().cast(pl.Int64).alias("end")))
        start = end.join(net, on=G, how="full", coalesce=True).select(
            G, (pl.col("end").fill_null(0) - pl.col("net").fill_null(0)).alias("start"))
    rows = pl.concat([
        start.select(G, pl.lit(-1, pl.Int64).alias("seq"), pl.col("start").alias("delta")),
        ev.select(G, "seq", "delta"),
    ]).sort([G, "seq"])
    return rows.with_columns(pl.col("delta").cum_sum().over(G).alias("reserved")).select(G, "seq", "reserved")


def _with_run_id(df: pl.DataFrame, peak: pl.DataFrame) -> pl.DataFrame:
    df = df if "run_id" in df.columns else df.with_columns(pl.lit("").alias("run_id"))
    return df.with_columns(pl.col("rank").cast(peak.schema["rank"]))


def _with_step(peak: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    st = _with_run_id(steps, peak)
    hit = (peak.select(*KEY, "peak_ts_ns").join(st.select(*KEY, "step", "start_ns", "end_ns"), on=KEY)
           .filter((pl.col("peak_ts_ns") >= pl.col("start_ns")) & (pl.col("peak_ts_ns") < pl.col("end_ns")))
           .group_by(KEY).agg(pl.col("step").min().alias("peak_step")))
    return peak.join(hit, on=KEY, how="left")


def _with_phase(peak: pl.DataFrame, spans: pl.DataFrame) -> pl.DataFrame:
    """The innermost (latest-starting) span with a phase that contains the peak's time: its phase,
    micro-batch, virtual stage and name (``events`` rows; the trainer's tk.compute spans)."""
    sp = _with_run_id(spans, peak).filter(pl.col("phase").is_not_null())
    for col, dtype in (("microbatch", pl.Int64), ("vstage", pl.Int64), ("name", pl.Utf8)):
        if col not in sp.columns:
            sp = sp.with_columns(pl.lit(None, dtype).alias(col))
    hit = (peak.select(*KEY, "peak_ts_ns")
           .join(sp.select(*KEY, "ts_ns", "dur_ns", "phase", "microbatch", "vstage", "name"), on=KEY)
           .filter((pl.col("peak_ts_ns") >= pl.col("ts_ns"))
                   & (pl.col("peak_ts_ns") < pl.col("ts_ns") + pl.col("dur_ns")))
           .sort("ts_ns").group_by(KEY).agg(
               pl.col("phase").last().alias("peak_phase"),
               pl.col("microbatch").last().alias("peak_microbatch"),
               pl.col("vstage").last().alias("peak_vstage"),
               pl.col("name").last().alias("peak_span")))
    return peak.join(hit, on=KEY, how="left")


@dataclass(frozen=True)
class MemoryAnalysis:
    """One pass over the trace: block lifetimes and per-rank peaks, reused by every question."""

    ranks: pl.DataFrame  # G, run_id, rank
    lifetimes: pl.DataFrame  # G, addr, size, category, frame, alloc/free seq and ts_ns
    timeline: pl.DataFrame  # G, seq, ts_ns, allocated
    reserved: pl.DataFrame  # G, seq, reserved
    peaks: pl.DataFrame  # run_id, rank, peak_allocated, peak_seq, ... (see ``peaks``)

    def _named(self, df: pl.DataFrame) -> pl.DataFrame:
        return self.ranks.join(df, on=G).drop(G)

    def live_at_peak(self, by: str = "category") -> pl.DataFrame:
        """What was live at each rank's peak, grouped by ``by`` ('category' or 'frame'):
        run_id, rank, <by>, bytes, blocks, share (of the peak), largest first."""
        if by not in ("category", "frame"):
            raise MemoryDataError(f"group live memory by 'category' or 'frame', not {by!r}")
        peak = self.ranks.join(self.peaks.select(*KEY, "peak_seq", "peak_allocated"), on=KEY)
        live = self.lifetimes.join(peak.select(G, "peak_seq", "peak_allocated"), on=G).filter(
            (pl.col("alloc_seq").is_null() | (pl.col("alloc_seq") <= pl.col("peak_seq")))
            & (pl.col("free_seq").is_null() | (pl.col("free_seq") > pl.col("peak_seq"))))
        out = (live.group_by([G, by]).agg(pl.col("size").sum().alias("bytes"), pl.len().alias("blocks"),
                                          pl.col("peak_allocated").first())
               .with_columns((pl.col("bytes") / pl.col("peak_allocated")).alias("share"))
               .drop("peak_allocated"))
        return (self._named(out).with_columns(pl.col(by).cast(pl.Utf8))
                .sort(KEY + ["bytes", by], descending=[False, False, True, False]))


def analyse(events: pl.DataFrame, segments: pl.DataFrame | None = None,
            steps: pl.DataFrame | None = None, spans: pl.DataFrame | None = None,
            blocks: pl.DataFrame | None = None) -> MemoryAnalysis:
    """Everything at once; ``blocks`` (memory_blocks rows) add what was allocated all along.
    ``peaks`` per rank: peak allocated bytes, when (seq, ts_ns; the step
    when ``steps`` rows are given, the phase, micro-batch and virtual stage of the innermost
    ``spans`` row (the store's ``events`` with a phase) around it, when times are known), the
    allocation that reached it (frame, category),
    baseline and final allocated, the reserve at the peak and its maximum, and fragmentation at the
    peak = 1 - allocated / reserved (null when the reserve is unknown or below the allocation)."""
    ev, ranks = _normalize(events)
    life = _resident(_lifetimes(ev), blocks, ranks)
    tl = _timeline(life)
    if tl.height == 0:
        raise MemoryDataError("memory_events rows hold no alloc or free_completed entries")
    at_peak = tl.group_by(G, maintain_order=True).agg(  # tl is sorted by G, seq
        pl.col("allocated").max().alias("peak_allocated"),
        pl.col("seq").get(pl.col("allocated").arg_max()).alias("peak_seq"),
        pl.col("ts_ns").get(pl.col("allocated").arg_max()).alias("peak_ts_ns"),
        pl.col("allocated").last().alias("final_allocated"),
    )
    base = life.filter(pl.col("alloc_seq").is_null()).group_by(G).agg(
        pl.col("size").sum().alias("baseline_allocated"))
    # the few rows at a peak seq first (an integer set test), then a small join
    trigger = ev.filter(pl.col("seq").is_in(at_peak["peak_seq"].implode())).select(
        G, pl.col("seq").alias("peak_seq"), pl.col("frame").cast(pl.Utf8).alias("peak_frame"),
        pl.col("category").cast(pl.Utf8).alias("peak_category"))
    out = (at_peak.join(trigger, on=[G, "peak_seq"], how="left")
           .join(base, on=G, how="left")
           .with_columns(pl.col("baseline_allocated").fill_null(0)))
    res = _reserved(ev, ranks, segments)
    res_at = out.select(G, "peak_seq").join(res, on=G).filter(
        pl.col("seq") <= pl.col("peak_seq")).group_by(G).agg(
        pl.col("reserved").sort_by("seq").last().alias("reserved_at_peak"))
    res_max = res.group_by(G).agg(pl.col("reserved").max().alias("peak_reserved"))
    # a reserve below what is allocated is no caching allocator's (CPU-derived snapshots make one
    # segment per live block at the end): unknown rather than a negative fragmentation
    known = pl.col("reserved_at_peak") >= pl.col("peak_allocated")
    out = (out.join(res_at, on=G, how="left").join(res_max, on=G, how="left")
           .with_columns(pl.when(known).then(pl.col(c)).alias(c) for c in ("reserved_at_peak", "peak_reserved"))
           .with_columns((1 - pl.col("peak_allocated") / pl.col("reserved_at_peak"))
                         .alias("fragmentation_at_peak")))
    out = ranks.join(out, on=G).drop(G).sort(KEY)
    if steps is not None:
        out = _with_step(out, steps)
    if spans is not None:
        out = _with_phase(out, spans)
    return MemoryAnalysis(ranks=ranks, lifetimes=life, timeline=tl, reserved=res, peaks=out)


def peaks(events: pl.DataFrame, segments: pl.DataFrame | None = None,
          steps: pl.DataFrame | None = None, spans: pl.DataFrame | None = None,
          blocks: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per-rank peaks (see ``analyse``)."""
    return analyse(events, segments, steps, spans, blocks).peaks


def live_at_peak(events: pl.DataFrame, by: str = "category", blocks: pl.DataFrame | None = None) -> pl.DataFrame:
    """What was live at each rank's peak (see ``MemoryAnalysis.live_at_peak``)."""
    return analyse(events, blocks=blocks).live_at_peak(by)


def block_lifetimes(events: pl.DataFrame, blocks: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per block: run_id, rank, addr, size, category, frame, alloc_seq, alloc_ts_ns,
    free_seq, free_ts_ns. alloc_seq is null for a block live before the trace began; free_seq is
    null for a block still live at its end. A block's interval is [alloc_seq, free_seq)."""
    ev, ranks = _normalize(events)
    life = _resident(_lifetimes(ev), blocks, ranks).with_columns(pl.col("category", "frame").cast(pl.Utf8))
    return ranks.join(life, on=G).drop(G).sort(KEY + ["alloc_seq", "addr"], nulls_last=False)


def timeline(events: pl.DataFrame, blocks: pl.DataFrame | None = None) -> pl.DataFrame:
    """Allocated bytes per rank after every event that changed it: run_id, rank, seq, ts_ns, allocated."""
    ev, ranks = _normalize(events)
    return ranks.join(_timeline(_resident(_lifetimes(ev), blocks, ranks)), on=G).drop(G).sort(KEY + ["seq"])


def reserved_timeline(events: pl.DataFrame, segments: pl.DataFrame | None = None) -> pl.DataFrame:
    """Reserved bytes per rank: run_id, rank, seq, reserved; a row at seq -1 is the state before
    the first event.

    ``segments`` are memory_segments rows (the allocator's state when the snapshot was taken, after
    the trace): with them the starting reserve is the end state minus the trace's net change;
    without them it is taken as 0 (recording began with the process), and a rank with neither
    segment events nor segments has no rows (unknown)."""
    ev, ranks = _normalize(events)
    return ranks.join(_reserved(ev, ranks, segments), on=G).drop(G).sort(KEY + ["seq"])


def imbalance(peak: pl.DataFrame, layout: Layout) -> pl.DataFrame:
    """Peaks with each rank's 4D coordinates and its ratio to the mean peak of its run, and to the
    mean of its pipeline stage (1F1B's first stage holds the most warm-up activations)."""
    if peak.height and int(peak["rank"].max()) >= layout.world_size:
        raise MemoryDataError(f"rank {int(peak['rank'].max())} outside layout {layout}")
    coords = pl.DataFrame([{"rank": r, **layout.coords(r).as_dict()} for r in range(layout.world_size)],
                          schema={"rank": peak.schema["rank"], "dp": pl.Int64, "pp": pl.Int64,
                                  "cp": pl.Int64, "tp": pl.Int64})
    return peak.join(coords, on="rank", how="left").with_columns(
        (pl.col("peak_allocated") / pl.col("peak_allocated").mean().over("run_id")).alias("vs_run_mean"),
        (pl.col("peak_allocated").mean().over(["run_id", "pp"])
         / pl.col("peak_allocated").mean().over("run_id")).alias("stage_vs_run_mean"),
    ).sort(KEY)

