"""`numerics precision`: human table, --json rows, bad input exit code (the selftest command is
tested beside the real gloo run in test_numerics_selftest.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from numerics.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_precision_json_rows_carry_errors_and_verdicts():
    result = CliRunner().invoke(main, ["precision", "-m", "1", "-m", "16", "--dp", "2", "-n", "8192", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["micro_batches"], r["dp"], r["terms"]) for r in rows] == [(1, 2, 2), (16, 2, 32)]
    assert [r["needs_fp32"] for r in rows] == [False, True]
    for r in rows:
        assert 1.4e-3 < r["storage_floor"] < 2.0e-3 and 1.4e-3 < r["err_fp32"] < 2.0e-3
        assert r["ratio"] == r["err_bf16"] / r["storage_floor"]
        assert r["order"] == "gloo_ring" and r["reason"].startswith("bf16 accumulation error")


def test_precision_table_is_human_readable():
    result = CliRunner().invoke(main, ["precision", "-m", "2", "-m", "64", "-n", "4096", "--order", "canonical"])
    assert result.exit_code == 0, result.output
    assert "order=canonical" in result.output
    assert "bf16 ok" in result.output and "needs FP32" in result.output
    assert "rule: needs FP32 iff bf16 buffer error > 2 x floor" in result.output


def test_precision_rejects_bad_input_with_exit_code_2():
    cases = {("-m", "0"): "Invalid value for '-m' / '--micro-batches': 0 is not in the range x>=1.",
             ("--threshold", "0"): "Invalid value for '--threshold': 0.0 is not in the range x>0.",
             ("--order", "tree"): "Invalid value for '--order': 'tree' is not one of 'canonical', 'gloo_ring'.",
             ("-n", "-5"): "Invalid value for '-n' / '--numel': -5 is not in the range x>=1."}
    for args, message in cases.items():
        result = CliRunner().invoke(main, ["precision", *args])
        assert result.exit_code == 2, (args, result.output)
        errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
        assert errors == [f"Error: {message}"], (args, result.output)  # one line: the option and what is wrong


def test_python_dash_m_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "numerics", "precision", "-m", "4", "-n", "256", "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert json.loads(out.stdout)[0]["terms"] == 4
