"""Run topology without a manifest: inferred from the recorded process groups."""

from __future__ import annotations

import sys
from pathlib import Path

import tracekit
from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
from _traces import nccl_trace, write_trace  # noqa: E402


def test_layout_inferred_from_pg_config(tmp_path: Path) -> None:
    world = 8  # tp=2, pp=2, dp=2 as torch would record it: one entry per group the rank is in
    for r in range(world):
        t = nccl_trace(r, world=world)
        tp = [r - r % 2, r - r % 2 + 1]
        pp = [r % 2 + 4 * (r // 4), r % 2 + 4 * (r // 4) + 2]
        dp = [r % 4, r % 4 + 4]
        t["distributedInfo"]["pg_config"] = [
            {"pg_name": "0", "pg_desc": "default_pg", "ranks": list(range(world))},
            {"pg_name": f"tp{tp[0]}", "pg_desc": "tp", "ranks": tp},
            {"pg_name": f"pp{pp[0]}", "pg_desc": "pp", "ranks": pp},
            {"pg_name": f"dp{dp[0]}", "pg_desc": "dp", "ranks": dp}]
        write_trace(tmp_path / "job" / f"rank{r}.json.gz", t)
    rep = ingest([tmp_path / "job"], tmp_path / "s.duckdb")
    assert len(rep.ok) == world and not rep.missing
    with tracekit.open(tmp_path / "s.duckdb") as s:
        run = s.table("runs").row(0, named=True)
        assert (run["layout_source"], run["tp"], run["cp"], run["pp"], run["dp"]) == ("group-names", 2, 1, 2, 2)
        dims = dict(s.sql("SELECT dim, count(*) FROM groups GROUP BY dim").rows())
        assert dims == {"tp": 4, "pp": 4, "dp": 4, "dp_pp_tp": 1}  # topology names the world group by its dims
        coords = s.sql("SELECT rank, dp, pp, tp FROM ranks WHERE rank IN (0, 5, 7) ORDER BY rank").rows()
        assert coords == [(0, 0, 0, 0), (5, 1, 0, 1), (7, 1, 1, 1)]


def test_a_group_described_differently_keeps_one_description_whatever_the_order(tmp_path: Path) -> None:
    """Files may name one group differently (an FR dump's 'default_pg', a trace's 'world'). The
    first file committed used to decide, so the store depended on which parse finished first."""
    descs = {0: "world", 1: "default_pg", 2: "dp", 3: None}
    files = []
    for r, desc in descs.items():
        t = nccl_trace(r, world=4)
        t["distributedInfo"]["pg_config"] = [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3]},
                                             {"pg_name": "7", "pg_desc": desc, "ranks": [0, 2]}]
        files.append(write_trace(tmp_path / "job" / f"rank{r}.json.gz", t))

    def described(order: list[int], name: str) -> list[tuple]:
        db = tmp_path / f"{name}.duckdb"
        rep = ingest([files[i] for i in order], db, run_id="job", workers=1)
        assert len(rep.ok) == len(order)
        with tracekit.open(db) as s:
            return s.sql("SELECT pg_name, pg_desc, ranks FROM groups ORDER BY pg_name").rows()

    assert described([0, 1], "a") == described([1, 0], "b") == [("0", "default_pg", [0, 1, 2, 3]),
                                                                 ("7", "default_pg", [0, 2])]
    # a dimension's name wins over any other (it tells the layout); no description loses to any
    assert described([0, 3, 1, 2], "c") == described([2, 1, 3, 0], "d") == [("0", "default_pg", [0, 1, 2, 3]),
                                                                           ("7", "dp", [0, 2])]
    # a later ingest into the same run settles the stored description with the new files'
    db = tmp_path / "e.duckdb"
    ingest([files[0]], db, run_id="job")
    ingest([files[2]], db, run_id="job")
    with tracekit.open(db) as s:
        assert s.sql("SELECT pg_desc FROM groups WHERE pg_name = '7'").item() == "dp"


def test_a_pure_dp_job_without_a_layout_is_compared_across_its_world_group(tmp_path: Path) -> None:
    """Eight replicas on one group that names no dimension (gloo's 'undefined'; seed 2 of the plain
    names): no layout is inferred, the ranks are compared as DP replicas, and their group is the
    one that holds every rank. A clean run read "not enough cross-rank records: no collectives
    across ranks" over 128 recorded collectives."""
    from tracekit.simulate.config import SimConfig
    from tracekit.simulate.run import simulate

    found = {}
    for name, faults in (("clean", ()), ("slow", ("slow:rank=3,factor=1.2",))):
        run = simulate(SimConfig(dp=8, steps=8, seed=2, names="plain", noise=0.05, faults=faults), tmp_path / name)
        (run / "manifest.json").unlink()
        ingest([run], tmp_path / f"{name}.duckdb", workers=1)
        with tracekit.open(tmp_path / f"{name}.duckdb") as s:
            assert s.layout_source() == "assumed-dp"
            assert set(s.sql("SELECT DISTINCT pg_desc FROM groups")["pg_desc"]) == {"default_pg", "undefined"}
            found[name] = s.diagnose()
    clean, slow = found["clean"], found["slow"]
    assert clean.localization.verdict == "no_straggler" and not clean.findings, clean.headline
    assert [(f.kind, f.ranks) for f in slow.findings] == [("straggler", (3,))], slow.headline
    dp = [lv for lv in slow.localization.levels if lv.level == "dp"][0]
    assert dp.verdict == "culprit" and dp.chosen == 3  # the waits in the world group name it too


def test_a_pure_pipeline_without_a_layout_is_taken_as_one_pipeline(tmp_path: Path) -> None:
    """Two ranks on one 'undefined' group whose p2p ops chain them: a pipeline, not two replicas.
    Taken as replicas, stage 0 (made 1.3x heavier) read "rank 0 (dp 0) computes 1.31x its 1 peer
    at the same position: a slow worker" at 0.99, against a stage whose work differs by design."""
    from tracekit.simulate.config import SimConfig
    from tracekit.simulate.run import simulate

    run = simulate(SimConfig(pp=2, steps=8, seed=2, names="plain", faults=("stage:pp=0,factor=1.3",)), tmp_path / "r")
    (run / "manifest.json").unlink()
    ingest([run], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.layout_source() == "assumed-pp"
        t = s.run_tables()
        assert (t.layout.pp, t.layout.dp) == (2, 1) and set(t.groups["dim"]) == {"pp"}
        d = s.diagnose()
    assert not [f for f in d.findings if f.confidence >= 0.9 and f.kind == "straggler"], d.headline
    assert "dp 0" not in d.headline
