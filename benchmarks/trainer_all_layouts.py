"""Run all 16 layouts of tp, cp, pp, dp in {1, 2} and compare each with a single-process run.

    PYTHONPATH=$PWD python benchmarks/trainer_all_layouts.py [--steps 3] [--out runs/all_layouts]

Layouts of the same world size share one spawned world (reference_trainer.launch.launch_many).
Prints, per layout: the loss difference and the largest per-tensor gradient difference (relative to
the tensor's largest element) after step 0 against the single-process run (fp32), and the median
step time of steps >= 1 measured on rank 0 (step 0 includes warm-up).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from reference_trainer.compare import diff_states
from reference_trainer.config import TrainConfig
from reference_trainer.launch import launch_many
from reference_trainer.train import run_single_process


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/all_layouts"))
    args = ap.parse_args()
    base = TrainConfig(compute_dtype="fp32", steps=args.steps, dump_state=True, timeout_s=300)
    layouts = [dict(tp=t, cp=c, pp=p, dp=d) for d, p, c, t in itertools.product((1, 2), repeat=4)]
    by_world: dict[int, list[dict]] = {}
    for lay in layouts:
        by_world.setdefault(lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"], []).append(lay)
    refs = {dp: run_single_process(base.replace(dp=dp).single_process())[1][0] for dp in (1, 2)}
    rows = []
    for world, lays in sorted(by_world.items()):
        t0 = time.perf_counter()
        jobs = [(base.replace(**lay), args.out / "tp{tp}_cp{cp}_pp{pp}_dp{dp}".format(**lay)) for lay in lays]
        results = launch_many(jobs)
        wall = time.perf_counter() - t0
        for lay, (cfg, out), res in zip(lays, jobs, results):
            d = diff_states(torch.load(out / "state" / "step0.pt"), refs[lay["dp"]])
            g = d.worst("grads")
            times = [s["seconds"] for s in res.metrics["steps"]][1:] or [res.metrics["steps"][0]["seconds"]]
            rows.append((str(cfg.layout), world, d.loss_diff, g.rel_to_max, g.name,
                         statistics.median(times), wall / len(lays)))
    print(f"{'layout':<22}{'ranks':>6}{'loss diff':>12}{'max grad diff':>15}  {'(worst tensor)':<24}"
          f"{'step s':>8}{'wall s/run':>11}")
    for lay, world, ld, gd, gname, st, wall in rows:
        print(f"{lay:<22}{world:>6}{ld:>12.2e}{gd:>15.2e}  {gname:<24}{st:>8.3f}{wall:>11.1f}")
    print(f"model: dim {base.dim}, layers {base.n_layers}, heads {base.n_heads}/{base.n_kv_heads} kv, "
          f"seq {base.seq_len}, {base.micro_batches} micro-batches per DP replica, fp32, "
          f"torch {torch.__version__}, gloo, {torch.get_num_threads()} thread(s) per rank")


if __name__ == "__main__":
    main()
