"""Bit-exact check of the reference trainer against the sequential reference over all 16 layouts
tp, cp, pp, dp in {1, 2}, in four numerics modes (bf16 or fp32 gradient buffers and reductions, each
with native gloo-ring or canonical reduction order; ``--modes`` picks), forward activations included,
then the precision table of a tiny model's real gradient buffers with 8 and 32 micro-batches.

    PYTHONPATH=$PWD python benchmarks/numerics_all_layouts.py [--steps 2] [--out DIR]

Configs of one world size share one spawned world (launch_many). Prints one row per (layout, mode).
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import polars as pl

from numerics.check import check_run
from numerics.model_precision import model_precision
from reference_trainer.config import TrainConfig
from reference_trainer.launch import launch_many

MODES = {
    "bf16buf+native": dict(grad_accum_dtype="bf16", reduce_dtype="bf16", reduce_order="native"),
    "bf16buf+canonical": dict(grad_accum_dtype="bf16", reduce_dtype="bf16", reduce_order="canonical"),
    "fp32buf+native": dict(grad_accum_dtype="fp32", reduce_dtype="fp32", reduce_order="native"),
    "fp32buf+canonical": dict(grad_accum_dtype="fp32", reduce_dtype="fp32", reduce_order="canonical"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--no-activations", action="store_true", help="compare only loss, gradients and parameters")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    base = TrainConfig(n_layers=4, dim=64, seq_len=128, micro_batches=args.micro_batches, steps=args.steps,
                       dump_state=True, record_activations=not args.no_activations, timeout_s=600)
    root = args.out or Path(tempfile.mkdtemp(prefix="numerics-all-layouts-"))
    jobs = []
    for tp, cp, pp, dp in itertools.product((1, 2), repeat=4):
        for mode in args.modes:
            changes = MODES[mode]
            cfg = base.replace(tp=tp, cp=cp, pp=pp, dp=dp, **changes)
            jobs.append((mode, cfg, root / f"tp{tp}_cp{cp}_pp{pp}_dp{dp}_{mode}"))
    rows = []
    for world in sorted({c.world_size for _, c, _ in jobs}):
        batch = [(m, c, o) for m, c, o in jobs if c.world_size == world]
        t0 = time.perf_counter()
        launch_many([(c, o) for _, c, o in batch])
        run_s = (time.perf_counter() - t0) / len(batch)
        for mode, cfg, out in batch:
            t1 = time.perf_counter()
            report = check_run(out, cfg)
            table = report.table()
            first = report.first_divergent
            rows.append({"layout": f"tp{cfg.tp} cp{cfg.cp} pp{cfg.pp} dp{cfg.dp}", "ranks": world, "mode": mode,
                         "bit_exact": report.bit_exact, "buffers": table.height,
                         "activations": int(table["buffer"].str.starts_with("act/").sum()),
                         "mismatching_elements": int(table["mismatches"].sum()), "max_ulp": int(table["max_ulp"].max()),
                         "first_divergent": "" if first is None else f"step {first[0]} {first[1]}",
                         "run_s": round(run_s, 1), "emulate_s": round(time.perf_counter() - t1, 1)})
        print(f"world of {world}: {len(batch)} configs done", flush=True)
    result = pl.DataFrame(rows)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True):
        print(result)
        print(f"bit-exact: {int(result['bit_exact'].sum())}/{result.height} (layout, mode) pairs, "
              f"{args.steps} steps each: {'' if args.no_activations else 'every forward activation, '}"
              "loss, every gradient, every updated parameter")
        tiny = base.replace(n_layers=2, steps=1)
        for m in (8, 32):
            t0 = time.perf_counter()
            prec = model_precision(tiny.replace(micro_batches=m))
            print(f"\nprecision, tiny model (dim {tiny.dim}, {tiny.n_layers} layers), {m} micro-batches x dp 1, "
                  f"gloo ring ({time.perf_counter() - t0:.1f} s); rule: needs FP32 iff bf16 error > 2 x bf16 storage floor")
            print(prec.select("buffer", "numel", "terms", "err_bf16", "err_fp32", "storage_floor", "ratio",
                              "absorbed", "needs_fp32"))
            print(f"needs FP32: {int(prec['needs_fp32'].sum())}/{prec.height} buffers")


if __name__ == "__main__":
    main()
