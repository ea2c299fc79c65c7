"""The reference shares no code with the trainer it checks: neither package imports the other, and
what each writes down separately (the canonical sum, the corpus, the pipeline split, the derived
sizes) agrees. One real mutant run shows why: a trainer whose canonical sum drops the last rank's
term used to pass bit-exact while both sides imported the same function."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from numerics.cli import main
from numerics.corpus import global_batch
from numerics.reduction_order import chained_sum as numerics_chained_sum
from numerics.run_config import RunConfig
from reference_trainer.comm import chained_sum as trainer_chained_sum
from reference_trainer.config import TrainConfig
from reference_trainer.data import Corpus
from reference_trainer.model import stage_layers

ROOT = Path(__file__).resolve().parents[1]
IMPORT = r"^\s*(?:from|import)\s+{}\b|import_module\(\s*['\"]{}"


def _importers(package: str, of: str) -> list[str]:
    pattern = re.compile(IMPORT.format(of, of), re.M)
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / package).rglob("*.py")) if pattern.search(p.read_text())]


def test_neither_package_imports_the_other():
    assert _importers("numerics", "reference_trainer") == []
    assert _importers("reference_trainer", "numerics") == []
    assert _importers("reference_trainer", "tracekit") != []  # the grep does see imports


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_two_canonical_sums_agree_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 7):
        terms = [(torch.randn(1000, generator=gen) * 10 ** (k % 3)).to(dtype) for k in range(n)]
        a, b = trainer_chained_sum(terms), numerics_chained_sum(terms)
        assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("fields", [{}, dict(dp=3, micro_batches=5, seq_len=64, vocab_size=32, eos_id=3, seed=7,
                                             doc_len_sigma=2.0, n_layers=7, pp=3, vstages=2, tp=2)])
def test_derived_values_and_data_agree_with_the_trainer(fields):
    t = TrainConfig(**fields)
    r = RunConfig.coerce(t)
    assert (r.tokens_per_step, r.head_dim, r.n_vstages_total) == (t.tokens_per_step, t.head_dim, t.n_vstages_total)
    for step in range(2):
        assert torch.equal(global_batch(r, step), Corpus(t).global_batch(step))
    for n in range(1, 12):
        for s in range(1, n + 1):
            assert RunConfig(n_layers=n, pp=s).stage_layers() == stage_layers(n, s), (n, s)


def test_an_unexpected_crash_is_exit_3_in_one_line(monkeypatch, tmp_path):
    import numerics.check

    def boom(*_a, **_k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(numerics.check, "check_run", boom)
    result = CliRunner().invoke(main, ["check", "--run", str(tmp_path)])
    assert result.exit_code == 3
    assert result.output.strip() == "internal error: ZeroDivisionError: division by zero"


def test_bad_input_is_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["check", "--run", str(tmp_path)])
    assert result.exit_code == 2 and "manifest.json: cannot read the run's manifest" in result.output
    (tmp_path / "manifest.json").write_text(json.dumps({"config": {"tp": "two"}}))
    result = CliRunner().invoke(main, ["check", "--run", str(tmp_path)])
    assert result.exit_code == 2 and "field 'tp' must be int" in result.output


def test_a_canonical_sum_dropping_the_last_rank_is_caught(tmp_path):
    """The issue's bug, planted in a scratch copy of the trainer: dp 3, canonical order."""
    shutil.copytree(ROOT / "reference_trainer", tmp_path / "reference_trainer")
    comm = tmp_path / "reference_trainer" / "comm.py"
    text = comm.read_text()
    assert text.count("    for t in terms[1:]:\n") == 1
    comm.write_text(text.replace("    for t in terms[1:]:\n", "    for t in terms[1:-1]:\n"))
    # run from the scratch folder: ``python -m reference_trainer`` finds the mutant first
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "numerics", "check", "--json", "--dp", "3", "--reduce-order",
                           "canonical", "--n-layers", "1", "--micro-batches", "1", "--steps", "1", "--seq-len", "32"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "bug" and report["first_bug"]["buffer"] == "loss"
    assert report["first_bug"]["location"].startswith("step 0: the loss on the last stage (pp rank 0)")
    bad_grads = [v for v in report["verdicts"] if v["buffer"].startswith("grad/")]
    assert bad_grads and {v["kind"] for v in bad_grads} == {"bug"}
    assert "dp x cp shard" in bad_grads[0]["location"] and "= rank " in bad_grads[0]["location"]
