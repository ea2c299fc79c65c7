"""The emulated device (reference_trainer/device.py): what it counts, how long it makes spans last
(on a fake clock: no wall-clock assertion), and that it changes no bit of the computation."""

from __future__ import annotations

import pytest
import torch

from reference_trainer.comm import Comm
from reference_trainer.config import ConfigError, TrainConfig
from reference_trainer.device import EmulatedDevice, WorkCounter
from reference_trainer.train import Trainer
from tracekit.conventions import ComputeAnnotation

TINY = dict(n_layers=2, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, seq_len=32, micro_batches=2, steps=2)


def test_counter_counts_matmul_flops_and_bytes_written_but_not_views() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with WorkCounter() as wc:
        c = a @ b  # 2*8*16*4 flops
        d = c.t()  # a view: no work
        e = torch.relu(d)  # 32 fp32 elements written
        e.add_(1.0)  # in place: written again
    assert wc.take() == (2 * 8 * 16 * 4, 2 * 32 * 4, 3)
    assert wc.take() == (0, 0, 0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def device(clock: FakeClock, factor: float = 1.0, jitter: float = 0.0, step: int = 0) -> EmulatedDevice:
    # 1 GFLOP/s, 1 GB/s, 10 us per kernel
    return EmulatedDevice(0, 1.0, 1.0, 10.0, jitter, 7, lambda ann: factor, lambda: step, clock, clock.sleep)


def run_span(dev: EmulatedDevice, clock: FakeClock, ann: ComputeAnnotation, cpu_s: float = 0.0) -> None:
    dev.compute_hook.before(ann)
    a = torch.randn(64, 64)
    _ = a @ a  # 2*64^3 = 524288 flops, 1 kernel
    clock.t += cpu_s
    dev.compute_hook.after(ann)


def test_a_span_lasts_its_counted_work_times_the_fault_factor() -> None:
    ann = ComputeAnnotation("fwd", 0, 0)
    clock = FakeClock()
    dev = device(clock)
    run_span(dev, clock, ann)  # first occurrence: counted as it runs
    flops, nbytes, kernels = dev.stats.work["fwd|0"][0]
    assert flops == 2 * 64 ** 3
    expected = flops / 1e9 + nbytes / 1e9 + kernels * 10e-6
    assert clock.slept[-1] == pytest.approx(expected)
    run_span(dev, clock, ComputeAnnotation("fwd", 0, 1), cpu_s=0.0002)  # the CPU work counts toward it
    assert clock.slept[-1] == pytest.approx(expected - 0.0002)
    slow = device(FakeClock(), factor=1.5)
    run_span(slow, slow.clock, ann)
    assert slow.clock.slept[-1] == pytest.approx(1.5 * expected)


def test_cpu_work_longer_than_the_device_is_an_overrun_not_a_sleep() -> None:
    clock = FakeClock()
    dev = device(clock)
    run_span(dev, clock, ComputeAnnotation("bwd", 1, 0), cpu_s=1.0)
    assert clock.slept == [] and dev.stats.overruns == 1


def test_jitter_is_seeded_per_rank_step_and_span() -> None:
    def slept(step: int, mb: int) -> float:
        clock = FakeClock()
        dev = device(clock, jitter=0.05, step=step)
        run_span(dev, clock, ComputeAnnotation("fwd", 0, mb))
        return clock.slept[-1]

    assert slept(3, 1) == slept(3, 1)
    assert len({slept(s, m) for s in range(3) for m in range(3)}) == 9
    base = device(FakeClock())
    run_span(base, base.clock, ComputeAnnotation("fwd", 0, 0))
    assert all(abs(slept(s, 0) / base.clock.slept[-1] - 1) < 0.3 for s in range(5))


def test_comm_inside_a_span_splits_it_and_is_not_compute() -> None:
    clock = FakeClock()
    dev = device(clock)
    ann = ComputeAnnotation("fwd", 0, 0)

    class Record:
        is_async = False

    dev.compute_hook.before(ann)
    _ = torch.randn(32, 32) @ torch.randn(32, 32)
    dev.comm_hook.before(Record())  # the device finishes the first segment before the op is issued
    first = clock.slept[-1]
    dev.comm_hook.during(Record())
    clock.t += 0.5  # half a second inside the op (waiting for a peer): not compute
    dev.comm_hook.after(Record())
    _ = torch.randn(16, 16) @ torch.randn(16, 16)  # other work than the first segment's
    dev.compute_hook.after(ann)
    work = dev.stats.work["fwd|0"]
    assert len(work) == 2 and (work[0][0], work[1][0]) == (2 * 32 ** 3, 2 * 16 ** 3)
    # 1 GFLOP/s, 1 GB/s, 10 us per kernel (device() above); the fake clock moved only by the sleeps
    # and the op, so each sleep is exactly its segment's own work: the 0.5 s in the op counts for none.
    seconds = [f / 1e9 + b / 1e9 + k * 10e-6 for f, b, k in work]
    assert first == pytest.approx(seconds[0], rel=1e-12)
    assert len(clock.slept) == 2 and clock.slept[1] == pytest.approx(seconds[1], rel=1e-12)


def test_the_device_changes_no_bit_of_the_step() -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(**TINY)

    def step(with_device: bool) -> tuple[float, dict[str, torch.Tensor]]:
        t = Trainer(cfg, Comm.single())
        if with_device:
            dev = EmulatedDevice(0, 1e6, 1e6, 0.0, 0.02, 1, lambda a: 1.0, lambda: t.step_index)
            t.spans.add_hook(dev.compute_hook)
            t.ctx.comm.add_hook(dev.comm_hook)
        loss = t.train_step().loss
        grads, params = t.optimizer.local_state()
        return loss, params

    loss_a, params_a = step(False)
    loss_b, params_b = step(True)
    assert loss_a == loss_b
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)


def test_config_rejects_impossible_devices() -> None:
    with pytest.raises(ConfigError, match="device_gbps"):
        TrainConfig(**TINY, device_gflops=1.0, device_gbps=0.0).validate()
    with pytest.raises(ConfigError, match="device_jitter"):
        TrainConfig(**TINY, device_gflops=1.0, device_jitter=0.9).validate()
