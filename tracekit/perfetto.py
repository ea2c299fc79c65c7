"""One Chrome-JSON trace (what ui.perfetto.dev and chrome://tracing open) of a stored run: the chosen
ranks' spans on the run's common clock, with the diagnosis' findings annotated.

Each rank is a process (named by its rank and 4D coordinates, the culprits' names saying so),
each of its recorded threads or GPU streams a thread; every ``events`` row of the rank is one
complete ("X") event, its start shifted by the rank's clock offset (stored, else estimated from
the collectives by ``align_clocks``) so that ranks on different hosts line up. The findings are global instant events at the start of the first step
they show in, listed again under ``otherData`` with the headline (a hang: the hang's headline and
its culprits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import polars as pl

from tracekit.store import Store, StoreError


def chrome_trace(store: Store, run_id: str | None = None, ranks: Sequence[int] | None = None,
                 steps: Sequence[int] | None = None) -> tuple[pl.DataFrame, dict]:
    """(events, header): ``events`` one row per trace event with its JSON in ``json`` (and rank,
    kind, span: whether it is a span rather than metadata or a finding); ``header`` the trace's top-level fields other than ``traceEvents``. Ranks and steps
    default to all of the run's; an unknown rank or step raises StoreError."""
    run = store._run(run_id)
    known = store.sql("SELECT rank, dp, pp, cp, tp FROM ranks WHERE run_id = ? ORDER BY rank", [run])
    offsets = clock_offsets(store, run)
    if ranks is not None:
        bad = sorted(set(ranks) - set(known["rank"].to_list()))
        if bad:
            raise StoreError(f"{store.path}: run {run!r} has no rank {bad[0]} (ranks 0..{known['rank'].max()})")
        known = known.filter(pl.col("rank").is_in(list(ranks)))
    where, params = "e.run_id = ? AND list_contains(?, e.rank)", [run, known["rank"].to_list()]
    if steps is not None:
        have = set(store.sql("SELECT DISTINCT step FROM steps WHERE run_id = ?", [run])["step"].to_list())
        bad = sorted(set(steps) - have)
        if bad:
            raise StoreError(f"{store.path}: run {run!r} has no step {bad[0]}")
        where += " AND list_contains(?, e.step)"
        params.append(list(steps))
    ev = store.sql(f"""SELECT e.rank, e.ts_ns, e.dur_ns, e.kind, e.name, coalesce(e.tid, '?') AS tid, e.step,
                              e.phase FROM events e WHERE {where}""", params)
    ev = ev.join(offsets, on="rank", how="left").with_columns(
        (pl.col("ts_ns") - pl.col("offset_ns").fill_null(0)).alias("t"))
    origin = int(ev["t"].min()) if ev.height else 0
    # Chrome JSON wants integer thread ids: each rank's threads and streams numbered, and named
    ev = ev.with_columns(pl.col("tid").rank("dense").over("rank").cast(pl.Int64).alias("tid_id"))
    threads = ev.select("rank", "tid", "tid_id").unique().sort("rank", "tid_id")
    spans = ev.select(
        "rank", "kind",
        pl.struct(pl.col("name").fill_null("?").alias("name"), pl.col("kind").fill_null("?").alias("cat"),
                  pl.lit("X").alias("ph"), ((pl.col("t") - origin) / 1e3).alias("ts"),
                  (pl.col("dur_ns").fill_null(0) / 1e3).alias("dur"), pl.col("rank").alias("pid"),
                  pl.col("tid_id").alias("tid"),
                  pl.struct("step", "phase").alias("args")).struct.json_encode().alias("json"))
    diagnosis = store.diagnose(run)
    culprits = {r for f in diagnosis.findings for r in f.ranks}
    if diagnosis.localization.verdict == "hang":
        culprits |= set(store.hangs(run).culprits)
    names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} (dp {d} pp {p} cp {c} tp {t})"
                                                                   + (" CULPRIT" if r in culprits else "")}}
             for r, d, p, c, t in known.iter_rows()]
    names += [{"name": "thread_name", "ph": "M", "pid": r, "tid": i, "args": {"name": str(t)}}
              for r, t, i in threads.iter_rows()]
    names += [{"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}} for r in known["rank"]]
    first = store.sql("SELECT rank, step, start_ns FROM steps WHERE run_id = ?", [run]).join(
        offsets, on="rank", how="left").group_by("step").agg(
        (pl.col("start_ns") - pl.col("offset_ns").fill_null(0)).min().alias("t"))
    at = dict(first.iter_rows())
    notes = []
    for f in diagnosis.findings:
        t = min((at[s] for s in f.steps if s in at), default=origin)
        notes.append({"name": f"finding: {f.summary}", "cat": "tracekit", "ph": "i", "s": "g",
                      "ts": max(t - origin, 0) / 1e3, "pid": f.ranks[0] if f.ranks else 0, "tid": 0,
                      "args": {"kind": f.kind, "ranks": list(f.ranks), "where": f.where, "cause": f.cause,
                               "cost_ms_per_step": f.cost_ns / 1e6, "next_step": f.next_step}})
    if diagnosis.localization.verdict == "hang":
        notes.append({"name": f"hang: {store.hangs(run).headline}", "cat": "tracekit", "ph": "i", "s": "g",
                      "ts": (int(ev["t"].max()) - origin) / 1e3 if ev.height else 0, "pid": 0, "tid": 0})
    extra = pl.DataFrame({"rank": [n["pid"] for n in names + notes], "kind": ["metadata"] * len(names)
                          + ["finding"] * len(notes), "json": [json.dumps(n) for n in names + notes]},
                         schema={"rank": pl.Int32, "kind": pl.Utf8, "json": pl.Utf8}).with_columns(
        pl.lit(False).alias("span"))
    header = {"displayTimeUnit": "ms",
              "otherData": {"run_id": run, "origin_ns": origin, "headline": diagnosis.headline,
                            "findings": [f.to_dict() for f in diagnosis.findings],
                            "ranks": known["rank"].to_list(), "steps": list(steps) if steps is not None else "all"}}
    return pl.concat([extra, spans.with_columns(pl.col("rank").cast(pl.Int32), pl.lit(True).alias("span"))]), header


def clock_offsets(store: Store, run: str) -> pl.DataFrame:
    """rank, offset_ns of the run (``tracekit.analysis.collectives.clock_offsets``: stored, else
    estimated from the collectives; the dashboard aligns its views with the same function)."""
    from tracekit.analysis.collectives import clock_offsets as run_clock_offsets

    return run_clock_offsets(store.run_tables(run))


def write_chrome_trace(store: Store, out: str | Path, run_id: str | None = None,
                       ranks: Sequence[int] | None = None, steps: Sequence[int] | None = None) -> dict:
    """Write the trace to ``out`` (gzip when it ends in .gz); returns spans per rank."""
    import gzip

    events, header = chrome_trace(store, run_id, ranks, steps)
    out = Path(out)
    body = '{"traceEvents":[' + ",".join(events["json"].to_list()) + "]," + json.dumps(header)[1:]
    opener = gzip.open if out.suffix == ".gz" else open
    with opener(out, "wt", encoding="utf-8") as fh:
        fh.write(body)
    spans = events.filter(pl.col("span"))
    return dict(spans.group_by("rank").len().sort("rank").iter_rows())
