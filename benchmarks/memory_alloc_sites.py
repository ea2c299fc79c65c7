"""How much of the reference trainer's memory has an allocation site: the share of bytes that
``tracekit memory --by frame`` and "allocated by" name, against ``<unknown>``.

    PYTHONPATH=. python benchmarks/memory_alloc_sites.py                 # a tiny 4-rank run (tp 2 x pp 2)
    PYTHONPATH=. python benchmarks/memory_alloc_sites.py --stack         # the same, profiled with_stack
    PYTHONPATH=. python benchmarks/memory_alloc_sites.py --run sample_traces/slow_rank_8

Per rank: the bytes of every allocation in the profiled steps, and the bytes live at the rank's peak,
split by what names them: 'trainer span' (a profiler op inside a trainer annotation, tk.module,
tk.comm or tk.compute: 'aten::linear in layers.0.attention', 'MmBackward0 in bwd vstage=0'), 'op' (a profiler op or a torch annotation alone:
'aten::eq', 'aten::empty in gloo:all_gather'), 'state' (the trainer's name for a persistent buffer),
'source' (a Python frame), 'unknown' (no frames); and the peak's own site.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_trainer.config import TrainConfig  # noqa: E402
from reference_trainer.launch import launch  # noqa: E402
from tracekit.analysis.memory import analyse  # noqa: E402
from tracekit.analysis.memory_tables import load_tables  # noqa: E402
from tracekit.ingest.pipeline import ingest  # noqa: E402

TINY = TrainConfig(tp=2, pp=2, n_layers=4, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, seq_len=64,
                   micro_batches=2, steps=3, profile_steps="1-2", flight_recorder=False, timeout_s=300)


def kind(frame: pl.Expr) -> pl.Expr:
    """What names a site: its file part and, for an op, whether a trainer annotation says where."""
    return (pl.when(frame.is_null() | (frame == "<unknown>")).then(pl.lit("unknown"))
            .when(frame.str.starts_with("<trainer state>")).then(pl.lit("state"))
            .when(frame.str.contains(r":(.* in )?((fwd|bwd|opt)\b|\w+ (dp|pp|cp|tp|dp_cp|world|other)$"
                                     r"|layers\.\d+\.\w+$|embed$|head$)")).then(pl.lit("trainer span"))
            .when(frame.str.starts_with("<profiler op>") | frame.str.starts_with("<annotation>")).then(pl.lit("op"))
            .otherwise(pl.lit("source")))


def shares(df: pl.DataFrame, what: str) -> pl.DataFrame:
    out = (df.with_columns(kind(pl.col("frame").cast(pl.Utf8)).alias("kind"))
           .group_by("rank", "kind").agg(pl.col("bytes").sum())
           .pivot(on="kind", index="rank", values="bytes").fill_null(0).sort("rank"))
    kinds = [k for k in ("trainer span", "op", "state", "source", "unknown") if k in out.columns]
    total = pl.sum_horizontal(kinds)
    return out.select(pl.col("rank").cast(pl.Int64), pl.lit(what).alias("bytes of"), total.alias("total"),
                      *[(pl.col(k) / total).round(4).alias(k) for k in kinds])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, help="an existing run directory (default: a fresh tiny run)")
    ap.add_argument("--stack", action="store_true", help="the fresh run profiles with Python stacks (profile_stack)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            launch(TINY.replace(profile_stack=args.stack), run)
        ingest([run], Path(tmp) / "s.duckdb")
        _, tables, _, _ = load_tables(Path(tmp) / "s.duckdb", None)
    ev = tables["memory_events"]
    result = analyse(ev, segments=tables.get("memory_segments"), blocks=tables.get("memory_blocks"))
    allocated = ev.filter(pl.col("action") == "alloc").select("rank", "frame", pl.col("size").alias("bytes"))
    live = result.live_at_peak(by="frame")
    table = pl.concat([shares(allocated, "allocated"), shares(live, "live at peak")], how="diagonal_relaxed")
    table = table.with_columns(pl.col(pl.Float64).fill_null(0.0))
    pl.Config.set_tbl_rows(100)
    pl.Config.set_tbl_cols(20)
    pl.Config.set_fmt_str_lengths(80)
    print(f"run {run}: share of bytes by what names their allocation site")
    print(table)
    named = 1 - table["unknown"].mean() if "unknown" in table.columns else 1.0
    print(f"mean share with a site (not <unknown>): {named:.2%}")
    print(result.peaks.select("rank", "peak_allocated", "peak_frame"))


if __name__ == "__main__":
    main()
