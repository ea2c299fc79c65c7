"""Fixtures that several test modules read: runs that cost a world each, made once a session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trainer_hang_run(tmp_path_factory) -> Path:
    """A 4-rank gloo trainer run (tp 2 x pp 2) whose rank 2 never joins step 1's PP all-reduce
    (``hang:rank=2,step=1,op=all_reduce,dim=pp``): the world ends in a LaunchError after
    ``timeout_s``, each rank's flight recorder dumped by its watchdog after ``fr_watchdog_s``. Read
    only: test_observability_run checks the dumps (with torch's own torchfrtrace too),
    test_analysis_hangs names the stalled rank from them."""
    from reference_trainer.config import TrainConfig
    from reference_trainer.launch import LaunchError, launch

    out = tmp_path_factory.mktemp("hang") / "run"
    cfg = TrainConfig(tp=2, pp=2, n_layers=2, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64, seq_len=64,
                      micro_batches=2, steps=3, timeout_s=15, fr_watchdog_s=3,
                      faults="hang:rank=2,step=1,op=all_reduce,dim=pp")
    with pytest.raises(LaunchError):
        launch(cfg, out)
    return out
