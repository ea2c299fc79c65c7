"""Wider sweep than the test suite: real gloo collectives vs the reduction-order models, including
sizes exactly at and one element around the 1 MiB segment size, and tensors over 16 MiB where even
8 ranks get a byte-driven segment count (17 -> 24 segments). Prints one row per (n, dtype, numel).

    PYTHONPATH=$PWD python benchmarks/numerics_gloo_sweep.py      # ~1-3 min, ~1.5 GB RAM on 2 cores
"""

import sys
import time

import polars as pl

from numerics.gloo_selftest import DEFAULT_GROUPS, check_gloo_matches_model, run_gloo_selftest

SIZES = {
    "float32": (2, 15, 16, 17, 262_143, 262_144, 262_145, 4_194_305),
    "bfloat16": (3, 524_287, 524_288, 524_289, 8_388_609),
}

if __name__ == "__main__":
    start = time.perf_counter()
    report = run_gloo_selftest(groups=DEFAULT_GROUPS, sizes=SIZES, timeout_s=600)
    seconds = time.perf_counter() - start
    summary = (
        report.table()
        .group_by("n", "dtype", "numel")
        .agg(
            pl.col("num_segments").first(),
            pl.len().alias("rank_results"),
            pl.col("mismatches").sum(),
            pl.col("other_order_mismatches").sum(),
        )
        .sort("n", "dtype", "numel")
    )
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(summary)
    print(f"{len(report.results)} rank results, torch {report.torch_version}, {seconds:.1f} s")
    try:
        check_gloo_matches_model(report)
    except AssertionError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    print("all match the models bit for bit")
