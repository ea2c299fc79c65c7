"""The `tracekit` command group: its listing matches the commands, and stays light."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from tracekit.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_listed_summary_is_the_commands_first_line(name: str) -> None:
    cmd = main.get_command(click.Context(main), name)
    assert cmd is not None
    assert COMMANDS[name][2] == (cmd.help or "").strip().splitlines()[0].strip()


def test_help_lists_every_command_without_importing_any() -> None:
    code = ("import sys; from click.testing import CliRunner; from tracekit.cli import main, COMMANDS; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output; print(r.output); "
            "heavy = [m for m in ('torch', 'duckdb', 'pyarrow', 'polars', 'panel') if m in sys.modules]; "
            "loaded = [m for m, _, _ in COMMANDS.values() if m in sys.modules]; print('LOADED', heavy + loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "LOADED []"
    listing = out[out.index("Commands:"):]
    for name, (_, _, summary) in COMMANDS.items():
        line = next(ln for ln in listing.splitlines() if ln.split()[:1] == [name])
        shown = line.split(None, 1)[1].removesuffix("...")
        assert summary.startswith(shown.rstrip(".")), (name, shown)


def test_unknown_command_is_an_error() -> None:
    out = subprocess.run([sys.executable, "-c", "from tracekit.cli import main; main()", "no-such"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "No such command 'no-such'" in out.stderr
