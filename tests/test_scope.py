"""The scoped diagnosis of large jobs (tracekit/analysis/scope.py) on small ones, where the whole job
can be read too: it reads a fraction of the ranks and reaches the same verdicts as reading all.

Jobs come from the simulator's tables (tests/test_simulate_tables.py shows they are what an
ingest of its traces gives), with skewed, drifting clocks and noise. The scope is forced on with
``Tunables(scope_above_ranks=1)``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tracekit
from tracekit.analysis.hangs import rank_list
from tracekit.analysis.links import median_without
from tracekit.analysis.tunables import Tunables
from tracekit.simulate.config import SimConfig
from tracekit.simulate.tables import write_duckdb

SCOPED = Tunables(scope_above_ranks=1)
BASE = dict(tp=2, cp=2, pp=4, dp=8, steps=8, noise=0.05, skew_ms=1500, drift_ppm=20, layers=2)
CASES = {  # name: (faults, what the verdict must name)
    "slow": (("slow:rank=77,factor=1.15",), {"straggler": [(77,)]}),
    "two": (("slow:rank=9,factor=1.3", "slow:rank=100,factor=1.3"), {"straggler": [(9,), (100,)]}),
    "transient": (("slow:rank=50,factor=1.8,steps=2+5",), {"transient": [(50,)]}),
    "p2p_link": (("link:a=36,b=40,delay_ms=20",), {"slow_link": [(36, 40)]}),
    "clean": ((), {}),
    "hang": (("hang:rank=45,step=4",), {}),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = {}
    for i, (name, (faults, _)) in enumerate(sorted(CASES.items())):
        path = tmp_path_factory.mktemp("scope") / f"{name}.duckdb"
        write_duckdb(SimConfig(**BASE, seed=11 + i, faults=faults), path, name)
        with tracekit.open(path) as s:
            full = s.diagnose(tunables=Tunables(scope_above_ranks=10**9))
            scoped = s.diagnose(tunables=SCOPED)
            tables = s.run_tables(ranks=scoped.scope.ranges())
        out[name] = (full, scoped, tables)
    return out


def _named(d) -> dict[str, list[tuple[int, ...]]]:
    found: dict[str, list[tuple[int, ...]]] = {}
    for f in d.findings:
        found.setdefault(f.kind, []).append(tuple(sorted(f.ranks)))
    return {k: sorted(v) for k, v in found.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scoped_verdict_is_the_full_verdict_and_the_truth(verdicts, name):
    full, scoped, _ = verdicts[name]
    want = CASES[name][1]
    assert full.scope is None and scoped.scope is not None
    if name == "hang":  # no performance verdict; the one rank that never joined, from a few groups' entries
        for d in (full, scoped):
            assert d.localization.verdict == "hang" and not d.findings, d.headline
            assert d.cause.ranks == (45,), d.headline
    assert _named(full) == want, full.headline
    assert _named(scoped) == want, scoped.headline


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_scope_reads_a_fraction_of_the_job_and_only_its_ranks(verdicts, name):
    _, scoped, tables = verdicts[name]
    world = scoped.scope.world_size
    assert world == 2 * 2 * 4 * 8
    assert len(scoped.scope.ranks) <= world // 2, scoped.scope.summary
    in_scope = set(scoped.scope.ranks)
    for t in ("events", "collectives", "p2p", "steps"):
        assert set(getattr(tables, t)["rank"].unique().to_list()) <= in_scope, t
    levels = [lv["level"] for lv in scoped.scope.levels]
    assert levels[:2] == ["compute", "dp"]  # top-down: every rank's aggregates first
    for f in scoped.findings:
        assert set(f.ranks) <= in_scope  # it names only what it read
    assert f"of {world:,} ranks" in scoped.scope.summary


def test_a_scoped_culprit_clears_the_bar_of_the_whole_job(verdicts):
    """The candidates are the most extreme of every rank: judged among the scope's few ranks they
    would clear a bar meant for few comparisons (a false alarm per large clean job)."""
    _, scoped, _ = verdicts["slow"]
    full, _, _ = verdicts["slow"]
    assert scoped.compute.cell_bar == pytest.approx(full.compute.cell_bar, rel=0.25)
    assert scoped.compute.ranks_compared < full.compute.ranks_compared


def test_median_without_is_the_median_of_the_rest():
    rng = np.random.default_rng(0)
    for _ in range(500):
        values = np.round(rng.normal(size=int(rng.integers(2, 30))), 1)  # rounded: ties
        idx = rng.choice(values.size, int(rng.integers(1, values.size)), replace=False)
        assert median_without(np.sort(values), values[idx]) == pytest.approx(float(np.median(np.delete(values, idx))))


def test_a_dataset_store_gives_the_same_scoped_verdict_reading_only_its_rank_blocks(tmp_path, monkeypatch):
    """The same job as a Parquet dataset (what `tracekit simulate --format parquet` writes for large
    worlds): the scoped verdict is the DuckDB file's, and the scoped reads open only the partitions
    (rank blocks) of the ranks in scope."""
    from tracekit import schema
    from tracekit.analysis.tables import ranked_source
    from tracekit.simulate.tables import write_dataset

    monkeypatch.setattr(schema, "RANK_BLOCK", 16)  # 128 ranks in 8 blocks, as 16,384 are in 64
    cfg = SimConfig(**BASE, seed=31, faults=("slow:rank=77,factor=1.15",))
    write_duckdb(cfg, tmp_path / "s.duckdb", "run")
    write_dataset(cfg, tmp_path / "ds", "run")
    with tracekit.open(tmp_path / "s.duckdb") as a, tracekit.open(tmp_path / "ds") as b:
        da, db = a.diagnose(tunables=SCOPED), b.diagnose(tunables=SCOPED)
        assert b.is_dataset and _named(da) == _named(db) == {"straggler": [(77,)]}, (da.headline, db.headline)
        assert da.scope.ranks == db.scope.ranks
        source, where = ranked_source(b._con, "events", db.scope.ranges())
        assert source == "events_parts" and "rank_block IN" in where
        def files_read(query: str) -> int:
            plan = "\n".join(str(r[-1]) for r in b._con.sql(f"EXPLAIN ANALYZE {query}").fetchall())
            return sum(int(n) for n in re.findall(r"Total Files Read: (\d+)", plan))

        scoped = files_read(f"SELECT count(*) FROM {source} WHERE run_id = 'run'{where}")
        whole = files_read("SELECT count(*) FROM events_parts WHERE run_id = 'run'")
        assert 0 < scoped < whole and len({r // 16 for r in db.scope.ranks}) < 8, (scoped, whole)


def test_long_rank_lists_read_as_a_count_with_ranges_or_a_stride():
    # a DP group of a 16,384-rank job has 64 members, one in every 256: a headline names it so
    assert rank_list(range(100, 16384, 256)) == "64 ranks [100, 356, ..., 16228] (stride 256)"
    assert rank_list([*range(40), 50]) == "41 ranks [0-39, 50]"
    assert rank_list([*range(0, 40, 2), 41]) == "21 ranks [0, 2, 4, 6, 8, 10, 12, 14, ... (13 more ranges)]"
    assert rank_list([3, 1]) == "[1, 3]"


def test_deschedule_spikes_make_no_candidate_but_a_slow_step_does(tmp_path):
    """The compute level sums each rank-step where the data lies; a deschedule spike is one span
    many times its length. Two spikes in one rank-step (rank 20) move nothing, nor does one step 3%
    slower (rank 40: many noise units, but too little for the diagnosis to call an episode); one rank computing
    1.3x in two steps (rank 70, a transient) and one 1.1x throughout (rank 101) are the candidates.
    Eight layers: a real step has hundreds of spans or more, so its longest normal spans (which the
    trim leaves in a spiked step) weigh little."""
    from tracekit.analysis.scope import narrow
    from tracekit.topology import Layout

    path = tmp_path / "spikes.duckdb"
    write_duckdb(SimConfig(**{**BASE, "layers": 8}, seed=3), path, "spikes")
    con = __import__("duckdb").connect(str(path))
    compute = "kind = 'kernel' AND NOT is_comm"  # the simulator's compute spans
    spiked = con.sql(f"SELECT rowid FROM events WHERE rank = 20 AND step = 3 AND {compute} ORDER BY ts_ns LIMIT 2"
                     ).fetchall()
    con.execute(f"UPDATE events SET dur_ns = dur_ns * 25 WHERE rowid IN ({', '.join(str(r) for r, in spiked)})")
    con.execute(f"UPDATE events SET dur_ns = dur_ns * 1.03 WHERE rank = 40 AND step = 4 AND {compute}")
    con.execute(f"UPDATE events SET dur_ns = dur_ns * 1.3 WHERE rank = 70 AND step IN (2, 5) AND {compute}")
    con.execute(f"UPDATE events SET dur_ns = dur_ns * 1.1 WHERE rank = 101 AND {compute}")
    con.close()
    with tracekit.open(path) as s:
        scope = narrow(s._con, s._run(None), Layout(tp=2, cp=2, pp=4, dp=8), SCOPED)
    assert scope.levels[0]["candidates"] == [70, 101], scope.levels[0]


@pytest.mark.parametrize("layout, fault, group", [
    # two replicas: the later one has no spread to be judged by; a TP link of replica 1
    (dict(tp=2, cp=1, pp=4, dp=2), "link:a=12,b=13,delay_ms=20", (12, 13)),
    # two DP groups (cp 2, pp 1): the slower DP group by its ratio to the other
    (dict(tp=1, cp=2, pp=1, dp=8), "link:a=0,b=6,delay_ms=10", (0, 2, 4, 6, 8, 10, 12, 14)),
])
def test_a_slow_link_is_in_the_scope_where_only_two_replicas_or_groups_compare(tmp_path, layout, fault, group):
    path = tmp_path / "two.duckdb"
    write_duckdb(SimConfig(**{**BASE, **layout}, seed=5, faults=(fault,)), path, "two")
    with tracekit.open(path) as s:
        scoped = s.diagnose(tunables=SCOPED)
    assert scoped.scope is not None  # (two DP groups: the slow one and its peer are the whole job)
    assert _named(scoped) == {"slow_link": [group]}, scoped.headline


def test_a_slow_p2p_link_is_in_the_scope_when_the_p2p_records_name_no_peer(tmp_path):
    """NCCL's p2p records name the pipeline group, not the peer (FORMATS.md): the diagnosis takes the
    peers from the flight recorder's entries; the scope, which cannot align those in SQL, reads the
    stages around the rank whose sends grew most in the late replica. Kineto traces and recorder
    dumps, through the real ingest."""
    from tracekit.ingest import ingest
    from tracekit.simulate.run import simulate

    run = simulate(SimConfig(tp=1, cp=1, pp=4, dp=4, steps=8, seed=7, noise=0.05, skew_ms=500, drift_ppm=20, layers=4,
                             faults=("link:a=9,b=10,delay_ms=20",)), tmp_path / "run")
    store = tmp_path / "s.duckdb"
    ingest([run], store, workers=1)
    with tracekit.open(store) as s:
        assert s.sql("SELECT count(peer) AS n FROM p2p WHERE source <> 'fr'")["n"][0] == 0  # as NCCL records them
        scoped = s.diagnose(tunables=SCOPED)
    assert len(scoped.scope.ranks) < scoped.scope.world_size, scoped.scope.summary
    assert _named(scoped) == {"slow_link": [(9, 10)]}, scoped.headline


@pytest.mark.parametrize("fault, want", [
    ("link:a=6,b=4,delay_ms=10", (4, 6)),  # a CP group's link (tp 2: ranks 4 and 6 are cp 0 and 1)
    ("link:a=7,b=11,delay_ms=20", (7, 11)),  # a pipeline link; NCCL's records name no peer
])
def test_with_one_replica_a_slow_link_is_in_the_scope(tmp_path, fault, want):
    """dp = 1: no replica to hold a late one against; the stage's groups (and sends) against each other."""
    from tracekit.ingest import ingest
    from tracekit.simulate.run import simulate

    run = simulate(SimConfig(tp=2, cp=2, pp=4, dp=1, steps=8, seed=3, noise=0.05, skew_ms=500, drift_ppm=20,
                             layers=4, faults=(fault,)), tmp_path / "run")
    store = tmp_path / "s.duckdb"
    ingest([run], store, workers=1)
    with tracekit.open(store) as s:
        scoped = s.diagnose(tunables=SCOPED)
        full = s.diagnose()
    assert _named(full) == {"slow_link": [want]}, full.headline
    assert len(scoped.scope.ranks) < scoped.scope.world_size, scoped.scope.summary
    assert "TP and CP groups and sends of the one replica: stages [" in scoped.scope.summary  # said, as read
    assert _named(scoped) == {"slow_link": [want]}, scoped.headline


def test_a_replica_late_in_every_step_is_searched_before_replicas_late_in_two(tmp_path):
    """Two transient stragglers make their replicas very late in two steps each; a CP link makes
    replica 5 late by less, but in every step. Only two late replicas are searched: the steady one
    must be among them (1,024 ranks, tp 1 x cp 4 x dp 256: a CP link 20 ms late, 80 ms a step,
    was read after two replicas with spikes and went unnamed at 0.97)."""
    faults = ("slow:rank=20,factor=3,steps=2+5", "slow:rank=40,factor=3,steps=3+6", "link:a=80,b=82,delay_ms=5")
    path = tmp_path / "steady.duckdb"
    write_duckdb(SimConfig(**BASE, seed=4, faults=faults), path, "steady")
    with tracekit.open(path) as s:
        scoped = s.diagnose(tunables=SCOPED)
    assert (80, 82) in _named(scoped).get("slow_link", []), scoped.headline
    dp_level = next(lv for lv in scoped.scope.levels if lv["level"] == "dp")
    assert dp_level["late_replicas"][0] == 5, dp_level
    named = _named(scoped)  # (two ranks slow in different steps read as one moving slowness)
    assert sorted(r for kind in ("transient", "moving") for r in named.get(kind, [])) == [(20,), (40,)], named


def test_a_clean_scoped_answer_is_as_sure_as_the_whole_read_and_counts_the_whole_jobs_p2p(verdicts):
    """The scope's links level measures every p2p link of the job; the ranks it then reads (a
    sample's first and last stages) hold few pairs of ops. Counted on those, "p2p links were measured
    in 0 of 5,760 p2p ops" put a clean 1,024-rank job's "no straggler" at 0.00."""
    full, scoped, _ = verdicts["clean"]
    assert scoped.localization.verdict == full.localization.verdict == "no_straggler"
    assert "p2p links were measured" not in scoped.cause.summary, scoped.cause.summary
    assert abs(scoped.localization.confidence - full.localization.confidence) <= 0.1, (
        scoped.localization.confidence, full.localization.confidence)
    links = next(lv for lv in scoped.scope.levels if lv["level"] == "links")
    assert links["p2p_ops"] == links["p2p_measured"] > 0, links


def test_a_slow_host_is_read_and_named_whole_though_more_of_its_ranks_stand_out_than_are_picked(tmp_path):
    """Every rank of host 5 (ranks 40-47: a whole pipeline of tp 1 x pp 8) at 1.1x: the compute
    level picks at most ``scope_candidates`` ranks per score, so some of the host's ranks are left
    out; read in part, the host was named with "each of its 5 ranks" (1,024 ranks, tp 1 x pp 8 x dp 128)."""
    faults = tuple(f"slow:rank={r},factor=1.1" for r in range(40, 48))
    path = tmp_path / "host.duckdb"
    write_duckdb(SimConfig(**{**BASE, "tp": 1, "cp": 1, "pp": 8, "dp": 16}, seed=6, ranks_per_host=8, faults=faults),
                 path, "host")
    with tracekit.open(path) as s:
        scoped = s.diagnose(tunables=SCOPED)
    compute = scoped.scope.levels[0]
    assert len(compute["candidates"]) < 8 and compute["host_mates"], compute  # the case the rule is for
    assert [f.ranks for f in scoped.findings] == [tuple(range(40, 48))], scoped.headline
    assert "host" in scoped.findings[0].where and "each of its 8 ranks" in scoped.findings[0].summary


def test_a_slow_cp_link_is_in_the_scope_where_noise_hides_its_replicas_lateness(tmp_path):
    """At 15% kernel noise a CP link 10 ms late (a third of a step) leaves its replica no later than
    noise lets the others be: the DP level names no late replica, and the link was read by no level
    (a 512-rank job: "no straggler" at 0.95). The TP and CP groups are compared across the job."""
    cfg = {**BASE, "tp": 4, "cp": 2, "noise": 0.15, "spikes": 0.002}
    path = tmp_path / "noisy.duckdb"
    write_duckdb(SimConfig(**cfg, seed=0, faults=("link:a=42,b=46,delay_ms=10",)), path, "noisy")
    with tracekit.open(path) as s:
        scoped = s.diagnose(tunables=SCOPED)
    assert _named(scoped) == {"slow_link": [(42, 46)]}, scoped.headline
    levels = {lv["level"]: lv for lv in scoped.scope.levels}
    assert levels["dp"]["late_replicas"] == [] and levels["tp_cp"]["slow_groups"], levels


def test_a_pipeline_alone_is_scoped_without_error_and_answers_as_the_whole_read(tmp_path):
    """tp = cp = dp = 1: no rank shares its stage, so the compute level has nothing to compare (it
    crashed on an empty matrix); the scope then answers what reading the whole job answers."""
    path = tmp_path / "pipeline.duckdb"
    write_duckdb(SimConfig(tp=1, cp=1, pp=4, dp=1, steps=8, seed=1, noise=0.05, layers=2,
                           faults=("slow:rank=2,factor=1.5",)), path, "pipeline")
    with tracekit.open(path) as s:
        scoped = s.diagnose(tunables=SCOPED)
        full = s.diagnose(tunables=Tunables(scope_above_ranks=10**9))
    assert scoped.scope.levels[0]["candidates"] == []
    assert _named(scoped) == _named(full) and scoped.localization.verdict == full.localization.verdict, (
        scoped.headline, full.headline)


@pytest.mark.parametrize("faults, want", [
    (("slow:rank=13,factor=1.3",), {"straggler": [(13,)]}),
    (("link:a=9,b=17,delay_ms=20",), {"slow_link": [(9, 17)]}),  # stages 1 -> 2 of replica 1 (tp 1)
    (("link:a=9,b=11,delay_ms=20",), {"slow_link": [(9, 11, 13, 15)]}),  # the DP group of stage 1, tp 1
])
def test_with_pp_outermost_the_scope_reads_whole_replicas_and_finds_the_same(tmp_path, faults, want):
    """torchtitan's and Megatron-LM's rank order puts PP outermost: a replica is one TP x CP cell per
    stage, not a range of ranks. The scope read replicas as ranges (and took a rank's replica as
    rank // (world / dp)), which there are other replicas' stages."""
    from tracekit.ingest import ingest
    from tracekit.simulate.run import simulate
    from tracekit.topology import PP_OUTERMOST

    run = simulate(SimConfig(tp=2, cp=1, pp=4, dp=4, steps=8, seed=9, noise=0.05, skew_ms=500, drift_ppm=20,
                             layers=2, order=PP_OUTERMOST, faults=faults), tmp_path / "run")
    (run / "manifest.json").unlink()  # the order from the mesh names alone
    ingest([run], tmp_path / "s.duckdb", workers=1)
    with tracekit.open(tmp_path / "s.duckdb") as s:
        assert s.run_tables().layout.order == PP_OUTERMOST
        full = s.diagnose(tunables=Tunables(scope_above_ranks=10**9))
        scoped = s.diagnose(tunables=SCOPED)
    assert _named(full) == want, full.headline
    assert _named(scoped) == want, scoped.headline
    assert len(scoped.scope.ranks) < scoped.scope.world_size, scoped.scope.summary
