"""Config validation, the comm-layer choke point, the data pipeline, the CLI and launch failures."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from reference_trainer.cli import train_command
from reference_trainer.config import ConfigError, TrainConfig
from reference_trainer.data import Corpus, document_ids, document_lengths
from reference_trainer.launch import LaunchError, free_port, run_world, start_method
from reference_trainer.model import stage_layers

PKG = Path(__file__).resolve().parents[1] / "reference_trainer"


@pytest.mark.parametrize("changes,fragment", [
    (dict(tp=2, n_heads=4, n_kv_heads=1), "n_kv_heads 1 not divisible by tp 2"),
    (dict(tp=3), "n_heads 4 not divisible by tp 3"),
    (dict(cp=3), "seq_len 128 not divisible by 2*cp = 6"),
    (dict(cp=2, seq_len=130), "seq_len 130 not divisible by 2*cp = 4"),
    (dict(cp=2, tp=4, seq_len=36, n_kv_heads=4), "not divisible by tp 4 (sequence parallel)"),
    (dict(pp=4, vstages=2, n_layers=4), "n_layers 4 too few for pp*vstages = 8"),
    (dict(dim=60, n_heads=8), "dim 60 not divisible by n_heads 8"),
    (dict(n_heads=4, n_kv_heads=3), "not divisible by n_kv_heads 3"),
    (dict(schedule="gpipe"), "schedule must be one of"),
    (dict(compute_dtype="fp16"), "compute_dtype must be one of"),
    (dict(dp=0), "dp must be a positive integer"),
    (dict(vocab_size=250, tp=4), "vocab_size 250 not divisible by tp 4"),
    (dict(zero_stage=3), "zero_stage must be 1 or 2"),
])
def test_impossible_configs_raise_clear_errors(changes, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TrainConfig(**changes).validate()


def test_valid_configs_pass_and_unknown_fields_are_rejected():
    TrainConfig(tp=2, cp=2, pp=2, dp=2).validate()
    TrainConfig(pp=4, vstages=2, n_layers=8, micro_batches=3, consecutive=6).validate()
    with pytest.raises(ConfigError, match="unknown config fields"):
        TrainConfig.from_dict({"tp": 2, "tensor_parallel": 2})
    assert TrainConfig(dp=2, micro_batches=3).single_process().micro_batches == 6


def test_cli_exits_2_on_impossible_config(tmp_path):
    res = CliRunner().invoke(train_command, ["--tp", "3", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "n_heads 4 not divisible by tp 3" in res.output
    assert not (tmp_path / "x").exists()
    if torch.cuda.device_count() < 2:
        res = CliRunner().invoke(train_command, ["--tp", "2", "--backend", "nccl", "--out", str(tmp_path / "y")])
        assert res.exit_code == 2 and "backend nccl needs one GPU per rank" in res.output


def test_tracekit_train_command_is_registered():
    from tracekit.cli import main

    res = CliRunner().invoke(main, ["train", "--help"])
    assert res.exit_code == 0 and "--cp-sharding" in res.output and "--dump-state" in res.output


def test_no_torch_distributed_outside_comm_layer():
    """The choke point: only comm.py may touch torch.distributed (native_job.py is the torch-native job,
    FSDP2/DTensor/pipelining on a DeviceMesh, which the trainer's comm layer deliberately is not)."""
    pattern = re.compile(r"torch\.distributed|import\s+torch\.distributed|\bdist\.|from torch import distributed")
    offenders = [f"{p.name}:{i}" for p in PKG.glob("*.py") if p.name not in ("comm.py", "native_job.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
    assert "torch.distributed" in (PKG / "comm.py").read_text()  # the grep itself can hit


def test_corpus_is_layout_independent_and_heavy_tailed():
    a = TrainConfig(dp=2, micro_batches=2, micro_batch_size=2)
    b = a.single_process()
    assert torch.equal(Corpus(a).global_batch(3), Corpus(b).global_batch(3))
    assert not torch.equal(Corpus(a).global_batch(3), Corpus(a).global_batch(4))
    mbs = Corpus(a).micro_batches(0, 1)
    assert len(mbs) == 2 and mbs[0].shape == (2, a.seq_len + 1)
    assert torch.equal(torch.cat(mbs), Corpus(a).global_batch(0)[4:8])
    lengths = np.array(document_lengths(np.random.default_rng(0), 200_000, 48.0, 1.0, 4096))
    assert lengths.mean() == pytest.approx(48, rel=0.1)
    assert np.percentile(lengths, 99) > 4 * np.median(lengths)  # heavy right tail
    batch = Corpus(a).global_batch(0)
    assert (batch == a.eos_id).sum() > batch.shape[0]  # several documents per sequence


def test_document_ids_close_documents_at_eos():
    ids = document_ids(torch.tensor([[5, 0, 7, 7, 0, 0, 3]]), 0)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3]]


def test_first_and_last_stage_shed_a_layer():
    assert [len(r) for r in stage_layers(6, 2)] == [3, 3]
    assert [len(r) for r in stage_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in stage_layers(4, 4)] == [1, 1, 1, 1]
    assert [r.start for r in stage_layers(10, 4)] == [0, 2, 5, 8]


def _failing_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one exploded")


def test_gloo_worlds_fork_from_a_forkserver_and_nccl_worlds_spawn():
    assert start_method("nccl") == "spawn"
    assert start_method("gloo") in ("forkserver", "spawn")
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        assert start_method("gloo") == "forkserver"


@pytest.mark.parametrize("backend", ["nccl", "gloo"])  # how either's world starts (spawn, forkserver)
def test_launch_reports_the_failing_rank(backend):
    with pytest.raises(LaunchError, match=r"rank 1 failed(.|\n)*rank one exploded"):
        run_world(_failing_worker, 2, (), timeout_s=300, method=start_method(backend))
    assert free_port() > 0


def _sleeping_worker(rank: int, world: int) -> None:
    import time

    time.sleep(60)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_launch_times_out_and_terminates_the_world(backend):
    import os

    pids: list[int] = []
    with pytest.raises(LaunchError, match="did not finish within 2 s"):
        run_world(_sleeping_worker, 2, (), timeout_s=2, on_start=pids.extend, method=start_method(backend))
    assert len(pids) == 2
    for pid in pids:  # terminated and reaped, not left sleeping
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
