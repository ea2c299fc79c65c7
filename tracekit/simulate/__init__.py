"""A job simulator: what a real NCCL GPU job of a 4D layout records (Kineto traces, flight-recorder
dumps) under an interleaved 1F1B schedule, with faults, noise and skewed host clocks, and a
manifest of the ground truth. ``simulate(SimConfig(...), out_dir)``; CLI ``tracekit simulate``."""

from tracekit.simulate.config import SimConfig, SimError
from tracekit.simulate.run import run_model, simulate

__all__ = ["SimConfig", "SimError", "run_model", "simulate"]
