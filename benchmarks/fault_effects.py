"""The measured effect of the trainer's injected faults (reference_trainer/faults.py) on 4 gloo ranks
(tp 2 x pp 2), without an emulated device: what tests/test_observability_run.py used to assert on
wall-clock time (tests never assert times), printed as a table instead.

    PYTHONPATH=. python benchmarks/fault_effects.py [--factor 3] [--delay-ms 150]

- slow: the slow rank's exclusive compute (tk.compute spans minus their nested tk.comm spans) over
  the median of its peers' (expect about ``--factor``; less when 4 ranks share fewer cores);
- link: flight-recorder durations of ops whose group holds both link ranks, in the faulted step vs
  the unfaulted step 0 and vs a group off the link (expect >= delay on the link only);
- moving: the rank with the most compute in each profiled step vs the manifest's rank_by_step.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _trainer_trace import exclusive_compute_ms  # noqa: E402
from reference_trainer.config import TrainConfig  # noqa: E402
from reference_trainer.flight_recorder import fr_path, load_dump  # noqa: E402
from reference_trainer.launch import launch_many  # noqa: E402
from reference_trainer.profiling import read_trace, trace_path  # noqa: E402

WORLD = 4
BASE = TrainConfig(tp=2, pp=2, n_layers=2, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, seq_len=64,
                   micro_batches=2, steps=3, timeout_s=120)


def _step_compute_ms(out: Path, rank: int, step: int) -> float:
    t = read_trace(trace_path(out, rank))
    (span,) = [e for e in t["traceEvents"] if e["name"] == f"ProfilerStep#{step}"]
    lo, hi = span["ts"], span["ts"] + span["dur"]
    return exclusive_compute_ms({"traceEvents": [e for e in t["traceEvents"]
                                                 if e.get("ph") == "X" and lo <= e["ts"] <= hi]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--delay-ms", type=float, default=150.0)
    ap.add_argument("--slow-rank", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fault-effects-"))
    jobs = [(BASE.replace(profile_steps="1-2", faults=f"slow:rank={args.slow_rank},factor={args.factor}"),
             root / "slow"),
            (BASE.replace(steps=2, faults=f"link:a=0,b=1,delay_ms={args.delay_ms},steps=1"), root / "link"),
            (BASE.replace(profile_steps="1-2", faults="moving:ranks=1+2+3,factor=4"), root / "moving")]
    slow, link, moving = launch_many(jobs)

    print("| fault | measure | value | expected |\n|---|---|---|---|")
    ms = {r: exclusive_compute_ms(read_trace(trace_path(slow.out, r))) for r in range(WORLD)}
    peers = median(v for r, v in ms.items() if r != args.slow_rank)
    print(f"| slow rank {args.slow_rank} x{args.factor} | compute / median of peers | "
          f"{ms[args.slow_rank] / peers:.2f} | ~{args.factor} |")

    dur = collections.defaultdict(list)  # (rank, step, on the link) -> durations
    for r in range(WORLD):
        dump = load_dump(fr_path(link.out, r))
        for e in dump["entries"]:
            members = set(json.loads(dump["pg_config"][e["process_group"][0]]["ranks"]))
            dur[(r, e["step"], {0, 1} <= members)].append(e["duration_ms"])
    for key, what in (((0, 1, True), "rank 0, step 1, on the link: min ms"),
                      ((1, 1, True), "rank 1, step 1, on the link: min ms")):
        print(f"| link 0-1 +{args.delay_ms:g} ms | {what} | {min(dur[key]):.1f} | >= {args.delay_ms:g} |")
    for key, what in (((0, 0, True), "rank 0, step 0 (unfaulted), on the link: median ms"),
                      ((2, 1, False), "rank 2, step 1, off the link: median ms")):
        print(f"| link 0-1 +{args.delay_ms:g} ms | {what} | {median(dur[key]):.1f} | < {args.delay_ms:g} |")

    by_step = moving.manifest["faults"][0]["rank_by_step"]
    for step in (1, 2):
        per_rank = {r: _step_compute_ms(moving.out, r, step) for r in range(WORLD)}
        slowest = max(per_rank, key=per_rank.get)
        print(f"| moving x4 | step {step}: slowest rank (compute ms) | {slowest} ({per_rank[slowest]:.0f}) | "
              f"{by_step[str(step)]} |")
    print(f"\nruns in {root}")


if __name__ == "__main__":
    main()
