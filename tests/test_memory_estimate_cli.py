"""`tracekit estimate`: human output, --json, --sweep, and bad input (exit code 2)."""

import json

import pytest
from click.testing import CliRunner

from tracekit.cli import main
from tracekit.memory.estimate import GIB, StateBytes, estimate_rank, paper_estimate, preset
from tracekit.topology import Layout


def run(*args: str):
    return CliRunner().invoke(main, ["estimate", *args])


def test_estimate_prints_components_and_verdict():
    r = run("--model", "llama3-8b", "--tp", "4", "--cp", "1", "--pp", "2", "--mbs", "1",
            "--gpus", "8", "--seq", "8192")
    assert r.exit_code == 0, r.output
    e = paper_estimate(preset("llama3-8b"), Layout(tp=4, pp=2, dp=1), 8192, 1)
    for label in ("bf16 weights", "fp32 gradients", "optimizer state + master weights",
                  "activations", "total"):
        assert label in r.output
    assert f"{e.activations / GIB:.2f}" == "10.38" and "10.38" in r.output
    assert f"{e.total / GIB:.2f}" in r.output  # 27.20
    assert "fits: 34% of a 80 GiB device" in r.output
    assert "parameters on this GPU: 1,003,880,448" in r.output


def test_json_matches_the_library_and_the_device_size():
    r = run("--model", "llama3-70b", "--tp", "8", "--pp", "4", "--gpus", "64", "--json",
            "--device-gib", "60")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    e = paper_estimate(preset("llama3-70b"), Layout(tp=8, pp=4, dp=2), 8192, 1)
    assert (d["tp"], d["cp"], d["pp"], d["dp"]) == (8, 1, 4, 2)
    assert d["total"] == e.total and d["optimizer"] == e.optimizer
    assert d["fraction_of_device"] == pytest.approx(e.total / (60 * GIB))
    # 4.23 + 8.46 + 12.69 + 25.56 = 50.94 GiB: 85% of 60 GiB
    assert e.total / GIB == pytest.approx(50.94, abs=0.005)
    assert d["verdict"] == e.verdict(60) == "may-not-fit"
    assert d["gib"]["total"] == pytest.approx(e.total / GIB)


def test_exact_formula_and_custom_dims():
    args = ["--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--layers", "4",
            "--vocab", "255", "--tp", "2", "--pp", "2", "--dp", "2", "--seq", "128", "--json"]
    paper = json.loads(run(*args).output)
    exact = json.loads(run(*args, "--formula", "exact").output)
    assert paper["model"] == exact["model"] == "custom"
    assert paper["formula"] == "paper" and exact["formula"] == "exact"
    # vocab 255 over tp 2: the paper counts 255/2 rows, the exact count 128 (padded)
    assert exact["params"] - paper["params"] == 64 * (128 - 255 / 2)
    m = preset("llama3-8b")
    over = json.loads(run("--model", "llama3-8b", "--layers", "16", "--json").output)
    assert over["model"] == "llama3-8b*"  # a preset with overridden dimensions says so
    assert over["params"] < json.loads(run("--model", "llama3-8b", "--json").output)["params"]
    x = estimate_rank(m, Layout(tp=8), 8192, 1)
    assert json.loads(run("--model", "llama3-8b", "--tp", "8", "--formula", "exact",
                          "--json").output)["params"] == x.params


def test_exact_formula_stage_and_zero_stage():
    base = ["--model", "llama3-70b", "--tp", "8", "--pp", "4", "--dp", "2", "--formula", "exact", "--json"]
    last = json.loads(run(*base, "--stage", "3").output)
    z3 = json.loads(run(*base, "--zero-stage", "3").output)
    m = preset("llama3-70b")
    assert last["stage"] == 3
    assert last["total"] == estimate_rank(m, Layout(tp=8, pp=4, dp=2), 8192, 1, stage=3).total
    assert z3["weights"] == estimate_rank(m, Layout(tp=8, pp=4, dp=2), 8192, 1,
                                          state=StateBytes(zero_stage=3)).weights
    assert z3["weights"] < json.loads(run(*base).output)["weights"]
    bad = run("--model", "llama3-8b", "--stage", "1")
    assert bad.exit_code == 2 and "--stage and --zero-stage need --formula exact" in bad.output
    bad = run(*base, "--stage", "4")
    assert bad.exit_code == 2 and "stage 4 outside 0..3" in bad.output


def test_sweep_table_and_json():
    r = run("--model", "llama3-8b", "--sweep", "--gpus", "8", "--mbs-values", "1,2")
    assert r.exit_code == 0, r.output
    assert "valid configs" in r.output and "will-not-fit" in r.output and "fits" in r.output
    j = run("--model", "llama3-8b", "--sweep", "--gpus", "8", "--mbs-values", "1,2", "--json")
    d = json.loads(j.output)
    totals = [c["total_gib"] for c in d["configs"]]
    assert totals == sorted(totals) and len(totals) > 10
    assert all(c["tp"] * c["cp"] * c["pp"] * c["dp"] == 8 for c in d["configs"])
    assert {c["mbs"] for c in d["configs"]} == {1, 2}
    best = d["configs"][0]
    assert (best["tp"], best["cp"], best["pp"], best["mbs"]) == (8, 1, 1, 1)
    empty = run("--hidden", "64", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--layers", "3",
                "--vocab", "10", "--seq", "7", "--sweep", "--gpus", "2")
    assert empty.exit_code == 0 and "no valid (tp, cp, pp, mbs)" in empty.output


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt2"], "unknown model preset 'gpt2'"),
    (["--hidden", "64"], "missing --ffn --heads --kv-heads --layers --vocab"),
    (["--model", "llama3-8b", "--tp", "3"], "tp 3 does not divide heads 32"),
    (["--model", "llama3-8b", "--tp", "4", "--gpus", "6"], "--gpus 6 is not a multiple of tp*cp*pp = 4"),
    (["--model", "llama3-8b", "--tp", "4", "--dp", "2", "--gpus", "16"], "--gpus 16 != tp*cp*pp*dp = 8"),
    (["--model", "llama3-8b", "--tp", "0"], "tp must be a positive integer"),
    (["--model", "llama3-8b", "--sweep"], "--sweep needs --gpus"),
    (["--model", "llama3-8b", "--sweep", "--gpus", "8", "--mbs-values", "1,x"], "comma-separated"),
    (["--model", "llama3-8b", "--device-gib", "0"], "--device-gib must be positive"),
    (["--model", "llama3-8b", "--heads", "5"], "hidden 4096 not divisible by heads 5"),
    (["--model", "llama3-8b", "--formula", "magic"], "Invalid value for '--formula'"),
])
def test_bad_input_exits_2_with_a_clear_message(args, message):
    r = run(*args)
    assert r.exit_code == 2
    assert message in r.output
