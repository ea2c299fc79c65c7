"""The trainer's failure path prints the rank's real error, markup-like text and all, and exits 3."""

from __future__ import annotations

from click.testing import CliRunner

import reference_trainer.launch as launch_mod
from reference_trainer.cli import train_command


def test_a_failed_run_prints_the_ranks_error_verbatim(monkeypatch, tmp_path):
    message = "rank 1 failed:\n[/opt/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1234"

    def fail(*args, **kwargs):
        raise launch_mod.LaunchError(message)

    monkeypatch.setattr(launch_mod, "launch", fail)
    res = CliRunner().invoke(train_command, ["--out", str(tmp_path / "run"), "--tp", "2", "--steps", "1"])
    assert res.exit_code == 3, res.output
    assert "[/opt/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1234" in res.output
    assert "MarkupError" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
