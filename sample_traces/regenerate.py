"""Regenerate the bundled sample runs (made by the reference trainer on gloo, CPU):

- ``slow_rank_8``: 8 ranks, tp 2 x cp 2 x pp 2 x dp 1, rank 5's compute 2x slower; steps 1-4 profiled.
- ``cp_imbalance_8``: 8 ranks, tp 1 x cp 2 x pp 2 x dp 2, long documents on CP rank 1 (sequence
  sharding); steps 1-4 profiled.
- ``slow_rank_16`` (``--with-16``, not bundled by default: the 16-rank check of issue 3):
  16 ranks 2x2x2x2, rank 11 slow from step 1.

Each run directory holds manifest.json (ground truth under ``faults``), traces/, fr/, memory/.
After writing, every run is checked: torch's ``torchfrtrace`` on fr/ (no mismatch), torch's
``_memory_viz stats`` on one snapshot; sizes per rank per profiled step are printed.

    PYTHONPATH=. python sample_traces/regenerate.py [--out sample_traces] [--with-16] [--only NAME]

``--memory-only`` rebuilds each run's memory/rank<R>.pickle from its own traces, leaving traces, fr and
manifest as they are (used when the snapshot builder gained allocation frames): the state buffers'
addresses and categories are read back from the snapshot being replaced (the trainer is gone, so the
state buffers are named by category only), and the rebuilt snapshot must equal it but for frames.
"""

from __future__ import annotations

import argparse
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_trainer.config import TrainConfig  # noqa: E402
from reference_trainer.launch import launch  # noqa: E402
from reference_trainer.profiling import (StateBuffer, memory_path, parse_steps, read_trace,  # noqa: E402
                                         snapshot_from_trace, trace_path)
from tracekit.demo_run import DEVICE  # noqa: E402

# Every rank gets the demo's emulated device (reference_trainer/device.py): compute time follows
# the work done, as on a GPU, instead of whatever 8 ranks sharing a few CPU cores get. Without it a
# sample's load imbalance reads as one slow worker. Four profiled steps let the analysis tell a
# persistent cause from noise.
TINY = dict(n_layers=4, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, seq_len=64, micro_batches=2,
            steps=5, profile_steps="1-4", timeout_s=300, **DEVICE)
RUNS = {
    "slow_rank_8": TrainConfig(tp=2, cp=2, pp=2, dp=1, faults="slow:rank=5,factor=2", **TINY),
    "cp_imbalance_8": TrainConfig(tp=1, cp=2, pp=2, dp=2, faults="cp_imbalance:ranks=1,weight=1.0", **TINY),
    "slow_rank_16": TrainConfig(tp=2, cp=2, pp=2, dp=2, faults="slow:rank=11,factor=2,steps=1-2", **TINY),
}


def sizes(run: Path, world: int, profiled: int) -> dict[str, float]:
    kib = {}
    for part, pattern in (("trace", "traces/rank{}.json.gz"), ("fr", "fr/rank{}"), ("memory", "memory/rank{}.pickle")):
        total = sum((run / pattern.format(r)).stat().st_size for r in range(world))
        kib[part] = total / world / 1024 / (profiled if part != "fr" else 1)
    return kib


def check(run: Path) -> None:
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(run / "fr")],
                        capture_output=True, text=True)
    text = fr.stdout + fr.stderr
    if fr.returncode != 0 or "Not all ranks" in text or "mismatch" in text.lower():
        raise SystemExit(f"torchfrtrace on {run}/fr failed:\n{text}")
    mv = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(run / "memory/rank0.pickle")],
                        capture_output=True, text=True)
    if mv.returncode != 0:
        raise SystemExit(f"_memory_viz stats failed on {run}: {mv.stderr}")


STATE_CATEGORIES = ("parameter", "gradient", "optimizer_state")


def _without_frames(x):
    if isinstance(x, dict):
        return {k: _without_frames(v) for k, v in x.items() if k != "frames"}
    if isinstance(x, list):
        return [_without_frames(v) for v in x]
    return x


def rebuild_memory(run: Path, world: int) -> None:
    """Each rank's snapshot again from its trace, with frames; see the module's docstring."""
    for r in range(world):
        old = pickle.loads(memory_path(run, r).read_bytes())
        after = {b["address"]: StateBuffer(b["size"], b["category"])
                 for seg in old["segments"] for b in seg["blocks"] if b.get("category") in STATE_CATEGORIES}
        # a state buffer from before the trace has a free entry with its category where it went away
        before = {e["addr"]: StateBuffer(e["size"], e["category"]) for e in old["device_traces"][0]
                  if e["action"] == "free_completed" and e.get("category") in STATE_CATEGORIES}
        new = snapshot_from_trace(read_trace(trace_path(run, r)), after, before)
        if _without_frames(new) != _without_frames(old):  # (dicts compare without their key order)
            raise SystemExit(f"{memory_path(run, r)}: the rebuilt snapshot differs from the old one beyond frames")
        with open(memory_path(run, r), "wb") as f:
            pickle.dump(new, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--with-16", action="store_true")
    ap.add_argument("--only")
    ap.add_argument("--memory-only", action="store_true", help="rebuild memory/ from the runs' own traces")
    args = ap.parse_args()
    names = [n for n in RUNS if (args.with_16 or not n.endswith("_16")) and (not args.only or n == args.only)]
    for name in names:
        cfg, run = RUNS[name], args.out / name
        if args.memory_only:
            rebuild_memory(run, cfg.world_size)
            check(run)
            print(f"{name}: memory/ rebuilt from traces/, equal to the old snapshots but for frames")
            continue
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        launch(cfg, run)
        (run / "steps.jsonl").unlink(missing_ok=True)
        check(run)
        first, last = parse_steps(cfg.profile_steps, cfg.steps)
        kib = sizes(run, cfg.world_size, last - first + 1)
        print(f"{name}: {cfg.world_size} ranks in {time.perf_counter() - t0:.0f} s; per rank per profiled step: "
              f"trace {kib['trace']:.0f} KiB (gz), memory {kib['memory']:.0f} KiB; FR dump (all "
              f"{cfg.steps} steps) {kib['fr']:.0f} KiB; torchfrtrace ok, _memory_viz stats ok")


if __name__ == "__main__":
    main()
