"""Step time of the reference trainer with the flight recorder on vs off (and the profiler on), in
ONE spawned world: the jobs alternate off/on/off/on so machine load drifts hit both alike.

    PYTHONPATH=. python benchmarks/recording_overhead.py [--world 4] [--steps 8] [--repeats 2]

Prints the median step time (step 0 excluded) of each mode and the ratios on/off. The flight
recorder costs one dict per comm op (plus a watchdog thread that wakes once a second); the
profiler (with memory events) is shown for scale, without and with Python stacks (``profile_stack``,
torch.profiler ``with_stack``), with its trace and memory-snapshot sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_trainer.config import TrainConfig  # noqa: E402
from reference_trainer.comm import CommRecord, Group  # noqa: E402
from reference_trainer.flight_recorder import FlightRecorder, fr_path, load_dump  # noqa: E402
from reference_trainer.launch import launch_many  # noqa: E402
from tracekit.conventions import CommAnnotation  # noqa: E402


def recorder_us_per_op(n: int = 20000) -> float:
    """The recorder's own cost per op (before + after), in this process: on a loaded machine the
    step-time ratio is noisy, this is not."""
    import time

    g = Group("1", "tp", (0, 1), 0)
    fr = FlightRecorder(0, [g], None)
    recs = [CommRecord(CommAnnotation("all_reduce", "1", "tp", i, (0, 1), 64, "float32"), g, [[16]], [[16]],
                       "float32") for i in range(n)]
    t0 = time.perf_counter()
    for r in recs:
        fr.before(r)
        fr.after(r)
    return (time.perf_counter() - t0) / n * 1e6

LAYOUTS = {4: dict(tp=2, pp=2), 8: dict(tp=2, cp=2, pp=2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4, choices=sorted(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    base = TrainConfig(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=128,
                       micro_batches=4, steps=args.steps, **LAYOUTS[args.world])
    modes = {"off": base.replace(flight_recorder=False), "fr": base,
             "fr+profiler": base.replace(profile_steps=f"1-{args.steps - 1}"),
             "fr+profiler+stack": base.replace(profile_steps=f"1-{args.steps - 1}", profile_stack=True)}
    order = [m for _ in range(args.repeats) for m in ("off", "fr")] + ["fr+profiler", "fr+profiler+stack"]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(modes[m], Path(tmp) / f"{i}_{m}") for i, m in enumerate(order)]
        results = launch_many(jobs)
        fr_run = next(r for m, r in zip(order, results) if m == "fr")
        ops_per_step = max(len(load_dump(fr_path(fr_run.out, k))["entries"]) for k in range(args.world)) / args.steps
        kib = {m: {part: sum(f.stat().st_size for f in (r.out / part).iterdir()) / 1024 / args.world / (args.steps - 1)
                   for part in ("traces", "memory")} for m, r in zip(order, results) if m.startswith("fr+profiler")}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m, r in zip(order, results):
        times[m] += [s["seconds"] for s in r.metrics["steps"][1:]]
    med = {m: median(v) for m, v in times.items()}
    us = recorder_us_per_op()
    out = {"world": args.world, "fr_us_per_op": us, "fr_ops_per_step_max_rank": ops_per_step,
           "fr_cost_fraction_of_off_step": us * 1e-6 * ops_per_step / med["off"], "steps_per_job": args.steps, "median_step_s": med,
           "ratio_fr_vs_off": med["fr"] / med["off"], "ratio_profiler_vs_off": med["fr+profiler"] / med["off"],
           "ratio_profiler_stack_vs_off": med["fr+profiler+stack"] / med["off"], "kib_per_rank_per_step": kib}
    for m, v in med.items():
        print(f"{m:12s} median step {v * 1000:8.1f} ms  ({len(times[m])} steps)")
    print(f"flight recorder on / off: {out['ratio_fr_vs_off']:.3f} (step times, noisy on a loaded machine)")
    print(f"flight recorder cost: {us:.1f} us/op x {ops_per_step:.0f} ops/step = "
          f"{100 * out['fr_cost_fraction_of_off_step']:.2f}% of a step")
    print(f"profiler (+memory) on / off: {out['ratio_profiler_vs_off']:.3f}")
    print(f"profiler (+memory, with_stack) on / off: {out['ratio_profiler_stack_vs_off']:.3f}")
    for m, k in kib.items():
        print(f"{m:18s} per rank per profiled step: trace {k['traces']:.0f} KiB (gz), memory snapshot {k['memory']:.0f} KiB")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
