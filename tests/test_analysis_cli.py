"""`tracekit stragglers | steps | cp-wait | hangs | report`: exit codes, --json shape, run-directory
sources and bad input; the Store facade behind them; the analyses' numbers on modelled jobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

import tracekit
from tracekit import store as store_mod
from tracekit.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from _traces import nccl_trace, write_trace  # noqa: E402
from synthetic_job import Faults, make_job  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real"
HTA = FIXTURES / "hta" / "two_rank_train"


def _write_store(path: Path, frames: dict[str, pl.DataFrame]) -> Path:
    con = store_mod.connect(path)
    for name, df in frames.items():
        con.register("frame", df.to_arrow())
        con.execute(f"INSERT INTO {name} SELECT * FROM frame")
        con.unregister("frame")
    con.close()
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("stores")
    return {
        "slow": _write_store(d / "slow.duckdb", make_job(faults=Faults(slow_rank=5, slow_factor=1.3), run_id="slow")),
        "clean": _write_store(d / "clean.duckdb", make_job(run_id="clean")),
        "cp": _write_store(d / "cp.duckdb", make_job(faults=Faults(uneven_rank=8, uneven_factor=2.0), run_id="cp")),
        "blip": _write_store(d / "blip.duckdb", make_job(faults=Faults(slow_rank=6, slow_factor=1.6, slow_steps=(5,)),
                                                         run_id="blip")),
    }


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.output


def test_stragglers_json_names_the_culprit_and_check_exits_1(stores) -> None:
    code, out = _cli("stragglers", str(stores["slow"]), "--json")
    assert code == 0
    blob = json.loads(out)
    assert set(blob) >= {"run_id", "finding", "stragglers", "skipped", "layout_source"}
    loc, cause = blob["stragglers"]["localization"], blob["stragglers"]["cause"]
    assert loc["verdict"] == "straggler" and loc["culprit_rank"] == 5
    assert cause["kind"] == "slow_compute" and blob["finding"] is True
    assert _cli("stragglers", str(stores["slow"]), "--check")[0] == 1
    code, out = _cli("stragglers", str(stores["slow"]))
    assert code == 0 and "rank 5" in out and "slow_compute" in out


def test_clean_run_is_no_straggler_and_check_passes(stores) -> None:
    code, out = _cli("report", str(stores["clean"]), "--check", "--json")
    assert code == 0, out
    blob = json.loads(out)
    assert blob["stragglers"]["localization"]["verdict"] == "no_straggler"
    assert blob["steps"]["slow_steps"] == [] and blob["hangs"]["hung"] is False


def test_steps_finds_the_one_slow_step_and_its_rank(stores) -> None:
    code, out = _cli("steps", str(stores["blip"]), "--json", "--check")
    assert code == 1
    slow = json.loads(out)["steps"]["slow_steps"]
    assert [s["step"] for s in slow] == [5]
    assert slow[0]["cause"] == "slow_compute" and slow[0]["ranks"] == [6]
    with tracekit.open(stores["blip"]) as s:
        rep = s.steps()
    per = rep.per_step.filter(pl.col("step") == 5)
    assert per["slow"][0] and per["step_ns"][0] > 1.10 * rep.median_step_ns


def test_cp_wait_attributes_waiting_to_the_heavier_cp_rank(stores) -> None:
    with tracekit.open(stores["cp"]) as s:
        cp = s.cp_wait()
    with tracekit.open(stores["clean"]) as s:
        clean = s.cp_wait()
    assert cp.cause == "compute_imbalance" and cp.compute_ratio > 1.05
    assert 0 < cp.wait_frac < 1 and cp.explained_frac >= 0.5
    assert cp.wait_ns > 3 * clean.wait_ns and clean.cause == "none"
    # rank 8's CP partner (rank 10) is the one that waits
    per = dict(cp.per_rank.select("rank", "wait_ns").iter_rows())
    assert per[10] > 3 * per[8]
    code, out = _cli("cp-wait", str(stores["cp"]), "--json")
    assert code == 0 and json.loads(out)["cp_wait"]["cause"] == "compute_imbalance"


def test_report_markdown_and_terminal(stores) -> None:
    code, out = _cli("report", str(stores["slow"]), "--format", "markdown")
    assert code == 0 and out.startswith("# tracekit report: slow")
    for section in ("## Stragglers", "## Steps", "## CP wait", "## Hangs"):
        assert section in out
    code, out = _cli("report", str(stores["slow"]))
    assert code == 0 and "top-down localization" in out


def test_bad_input_exits_2(tmp_path: Path, stores) -> None:
    code, out = _cli("stragglers", str(tmp_path / "missing.duckdb"))
    assert code == 2 and "no such file" in out
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"not a database" * 50)
    code, out = _cli("report", str(junk))
    assert code == 2 and "junk.duckdb" in out
    code, out = _cli("steps", str(stores["slow"]), "--run-id", "nope")
    assert code == 2 and "no run 'nope'" in out
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "notes.txt").write_text("no traces here")
    code, out = _cli("stragglers", str(empty))
    assert code == 2 and "empty_run" in out
    assert _cli("stragglers", "--bogus", str(stores["slow"]))[0] == 2  # click usage error


def test_run_directory_is_ingested_into_a_sibling_store(tmp_path: Path) -> None:
    run = tmp_path / "runA"
    for r in range(2):
        write_trace(run / f"rank{r}.json.gz", nccl_trace(r))
    code, out = _cli("steps", str(run), "--json")
    assert code == 0, out
    assert (tmp_path / "runA.tracekit.duckdb").exists()
    blob = json.loads(out)
    assert blob["run_id"] == "runA" and len(blob["steps"]["per_step"]) == 2
    assert _cli("steps", str(run), "--json")[1] == out  # second call reuses the store (files skipped)


def test_a_run_directory_that_lost_a_file_is_not_read_from_its_old_rows(tmp_path: Path) -> None:
    """An ingest adds and replaces files, never drops one: the directory's own store kept a removed
    rank's rows, and the analyses went on reading them (and, truncated, its older good version)."""
    run = tmp_path / "runC"
    for r in range(3):
        write_trace(run / f"rank{r}.json.gz", nccl_trace(r))
    assert {r["rank"] for r in json.loads(_cli("steps", str(run), "--json")[1])["steps"]["per_rank"]} == {0, 1, 2}
    (run / "rank2.json.gz").unlink()
    code, out = _cli("steps", str(run), "--json")
    assert code == 0, out
    assert "making runC.tracekit.duckdb again" in out
    blob = json.loads(out[out.index("{"):])
    assert {r["rank"] for r in blob["steps"]["per_rank"]} == {0, 1}
    (run / "rank1.json.gz").write_bytes((run / "rank1.json.gz").read_bytes()[:200])  # cut short
    blob = json.loads((out := _cli("stragglers", str(run), "--json")[1])[out.index("{"):])
    assert set(blob["damaged"]) == {"1"}, blob["damaged"]


def test_store_flag_and_the_one_place_a_run_directory_is_stored(tmp_path: Path, monkeypatch) -> None:
    from tracekit.ingest.cached import store_for

    run = tmp_path / "runB"
    for r in range(2):
        write_trace(run / f"rank{r}.json.gz", nccl_trace(r))
    chosen = tmp_path / "elsewhere" / "mine.duckdb"
    chosen.parent.mkdir()
    code, out = _cli("hangs", str(run), "--store", str(chosen), "--json")
    assert code == 0, out
    assert chosen.is_file()
    assert not (tmp_path / "runB.tracekit.duckdb").exists() and not (run / "tracekit.duckdb").exists()
    assert store_for(run) == tmp_path / "runB.tracekit.duckdb" and store_for(run, chosen) == chosen
    monkeypatch.chdir(run)  # "." is named by its absolute path, not stored as a hidden ".tracekit.duckdb"
    assert store_for(Path(".")) == tmp_path / "runB.tracekit.duckdb"


def test_store_facade_newest_run_and_saved_clock_offsets(tmp_path: Path) -> None:
    db = tmp_path / "two.duckdb"
    frames = make_job(faults=Faults(host_skew_ns={1: 3_000_000}), run_id="skewed")
    _write_store(db, frames)
    with tracekit.open(db) as s:
        assert s.newest_run() == "skewed"
        align = s.align_clocks()
        offs = dict(s.table("ranks", "skewed").select("rank", "clock_offset_ns").iter_rows())
    host_of = dict(align.offsets.select("rank", "offset_ns").iter_rows())
    assert offs == host_of
    assert abs(offs[4] - offs[0] - 3_000_000) < 200_000  # ranks 4-7 live on host 1
    with pytest.raises(store_mod.StoreError, match="no run 'x'"):
        tracekit.open(db).diagnose("x")


def test_hta_sample_reports_what_it_can(tmp_path: Path) -> None:
    from tracekit.ingest import ingest

    db = tmp_path / "hta.duckdb"
    assert not ingest([HTA], db).failed
    code, out = _cli("report", str(db), "--json")
    assert code == 0, out
    blob = json.loads(out)
    assert blob["layout_source"] == "assumed-dp"  # the samples carry no process-group layout
    assert len(blob["steps"]["per_step"]) >= 1 and blob["steps"]["median_step_ns"] > 0
    assert blob["hangs"]["hung"] is False
    assert blob["stragglers"]["localization"]["verdict"] in ("no_data", "no_straggler", "straggler", "moving")


@pytest.mark.parametrize("command", ["cp-wait", "hangs"])
def test_cp_wait_and_hangs_bad_input_is_one_line_naming_the_file(tmp_path: Path, stores, command: str) -> None:
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"not a database" * 50)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "notes.txt").write_text("no traces here")
    cases = [((str(tmp_path / "missing.duckdb"),), f"error: {tmp_path / 'missing.duckdb'}: no such file or directory"),
             ((str(junk),), f"error: {junk}: cannot open store"),
             ((str(empty),), f"error: {empty}: nothing could be ingested (no traces, dumps or snapshots found)"),
             ((str(stores["cp"]), "--run-id", "nope"), "no run 'nope'")]
    for args, message in cases:
        code, out = _cli(command, *args)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, out)


def test_demo_without_a_bundled_sample_is_bad_input(tmp_path: Path, monkeypatch) -> None:
    from tracekit.cli import analysis as analysis_cli

    missing = tmp_path / "no_such_sample"
    monkeypatch.setattr(analysis_cli, "BUNDLED_SAMPLE", missing)
    code, out = _cli("demo", "--no-train", "--out", str(tmp_path / "out"))
    assert code == 2
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(missing) in lines[0] and "no bundled sample run" in lines[0], out


def test_demo_on_the_bundled_sample_names_rank_5_slow_compute(tmp_path: Path) -> None:
    """The happy path of `tracekit demo --no-train` on sample_traces/slow_rank_8 (rank 5 computes 2x,
    sample_traces/README.md); its store goes to --out, not beside the sample."""
    from tracekit.cli import analysis as analysis_cli

    before = sorted(p.name for p in analysis_cli.BUNDLED_SAMPLE.parent.iterdir())
    code, out = _cli("demo", "--no-train", "--json", "--out", str(tmp_path))
    assert code == 0, out
    blob = json.loads(out[out.index("{"):])
    assert blob["injected"][0]["spec"] == "slow:rank=5,factor=2"
    loc, cause = blob["stragglers"]["localization"], blob["stragglers"]["cause"]
    assert loc["verdict"] == "straggler" and loc["culprit_ranks"] == [5]
    assert loc["coords"] == {"dp": 0, "pp": 1, "cp": 0, "tp": 1}
    assert cause["kind"] == "slow_compute"
    assert 0.5 < loc["confidence"] < 1.0
    assert blob["hangs"]["hung"] is False
    assert (tmp_path / "slow_rank_8.tracekit.duckdb").is_file()
    assert sorted(p.name for p in analysis_cli.BUNDLED_SAMPLE.parent.iterdir()) == before
