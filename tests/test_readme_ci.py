"""The path a new user follows is the path CI tests: .ci/run runs the README's own commands."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_quickstart_has_install_run_and_test():
    cmds = quickstart_commands()
    assert len(cmds) == 3
    assert cmds[0].startswith("pip install torch==2.13.0 ")
    assert "pytest" in cmds[2]


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    install, _, test = quickstart_commands()
    assert install in [line.strip() for line in ci]
    assert any(line.strip() == test for line in ci)
