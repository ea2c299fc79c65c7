"""Every planted bug (reference_trainer/bugs.py) on the layouts it lives in: what the numerics check
names as the first diverging buffer or layer, where, and its diagnosis (activations recorded).

    PYTHONPATH=$PWD python benchmarks/numerics_planted_bugs.py [--out DIR]

One spawned world of 4 ranks runs every config (launch_many). Prints one row per (bug, layout).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import polars as pl

from numerics.check import check_run
from reference_trainer.config import TrainConfig
from reference_trainer.launch import launch_many

LAYOUTS = {
    "cp-chunk": ({"cp": 2, "dp": 2}, {"cp": 2, "tp": 2}),
    "doc-mask-off-by-one": ({"cp": 2, "dp": 2}, {"tp": 2, "pp": 2}),
    "tp-bwd-reduce": ({"tp": 2, "dp": 2}, {"tp": 2, "cp": 2}),
    "dp-double-scale": ({"tp": 2, "dp": 2}, {"cp": 2, "pp": 2}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="keep the run directories here")
    args = ap.parse_args()
    base = TrainConfig(n_layers=4, dim=64, seq_len=128, micro_batches=3, steps=1, dump_state=True,
                       record_activations=True, timeout_s=600)
    root = args.out or Path(tempfile.mkdtemp(prefix="numerics-bugs-"))
    jobs = []
    for bug, layouts in LAYOUTS.items():
        for sizes in layouts:
            name = "_".join(f"{k}{v}" for k, v in sizes.items())
            jobs.append((bug, name, base.replace(plant_bug=bug, **sizes), root / f"{bug}_{name}"))
    t0 = time.perf_counter()
    launch_many([(c, o) for _, _, c, o in jobs])
    print(f"{len(jobs)} runs on 4 ranks: {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for bug, name, cfg, out in jobs:
        report = check_run(out, cfg)
        first = report.first_divergent
        assert first is not None, f"{bug} on {name} was not detected"
        step = report.steps[first[0]]
        d = step.divergence.get(first[1])
        rows.append({"bug": bug, "layout": name, "first diverging": first[1],
                     "where": "" if d is None else f"mb {d.micro_batch} dp {d.dp} seq {d.sequence}: "
                                                   f"{len(d.tokens)} tokens from {d.tokens[0]}",
                     "sharding differs": bool(step.sharding), "diagnosis": report.diagnosis.split(":")[0]})
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=220, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True, fmt_str_lengths=80):
        print(pl.DataFrame(rows))
    for bug, name, cfg, out in jobs:
        if bug in ("cp-chunk", "doc-mask-off-by-one"):
            print(f"\n{bug} on {name}:\n{check_run(out, cfg).diagnosis}")


if __name__ == "__main__":
    main()
