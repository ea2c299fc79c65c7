"""What an ingest leaves in the process and the database it runs in: no pandas import, no OpenBLAS
thread pool, Arrow on the system allocator, the database's settings put back, and each file's row
groups left where it wrote them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tracekit.ingest.pipeline import ingest

sys.path.insert(0, str(Path(__file__).parent))
from _traces import nccl_trace, write_trace  # noqa: E402

SAMPLE = Path(__file__).parent.parent / "sample_traces" / "slow_rank_8"


NO_COMM_TRACE = ('{"distributedInfo": {"rank": 0, "world_size": 1, "backend": "gloo"}, "traceEvents": ['
                 '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}]}')


@pytest.mark.parametrize("files", [["traces/rank0.json.gz"], ["fr/rank0", "memory/rank0.pickle"], ["no_comm"]],
                         ids=["kineto", "fr+memory", "kineto-without-communication"])
def test_ingest_does_not_import_pandas(tmp_path: Path, files: list[str]) -> None:
    """pyarrow imports pandas (0.5 CPU-s) when it converts Python objects or numpy arrays, or
    combines a chunked array of no chunks; ingest builds its tables in DuckDB or from Arrow buffers
    instead, so no format pays for it, nor a trace without communication events."""
    pytest.importorskip("pandas")  # without pandas installed the check would say nothing
    (tmp_path / "no_comm").mkdir()
    (tmp_path / "no_comm" / "rank0.json").write_text(NO_COMM_TRACE)
    paths = [str(tmp_path / f if f == "no_comm" else SAMPLE / f) for f in files]
    code = ("import sys; from tracekit.ingest.pipeline import ingest; "
            f"rep = ingest({paths!r}, {str(tmp_path / 's.duckdb')!r}); "
            f"assert [f.status for f in rep.files] == {['ok'] * len(files)!r}, rep.files; "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_keeps_openblas_from_starting_its_thread_pool() -> None:
    """numpy (under pyarrow) starts OpenBLAS's thread pool, which spins for about 0.2 CPU-s while
    the ingest's workers need the cores; the CLI asks for one BLAS thread unless the user chose."""
    code = ("import os, sys; from click.testing import CliRunner; from tracekit.cli import main; "
            "r = CliRunner().invoke(main, ['ingest', '--help']); assert r.exit_code == 0, r.output; "
            "assert 'numpy' in sys.modules; "  # else the thread count says nothing
            "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))")

    def cli(user_value: str | None) -> tuple[str, int]:
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
        if user_value is not None:
            env["OPENBLAS_NUM_THREADS"] = user_value
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        value, threads = out.stdout.split()
        return value, int(threads)

    unset, one, three = cli(None), cli("1"), cli("3")
    assert unset == one == ("1", one[1])  # as if the user had asked for one thread
    assert three[0] == "3" and three[1] > one[1]  # the user's choice wins, pool and all


def test_ingest_puts_the_database_settings_back(tmp_path: Path) -> None:
    """Ingest tunes the database instance (one thread, no vacuum, a memory limit); a connection of
    the same process to the same store shares that instance and must find its settings as it left
    them, defaults or its own."""
    db = tmp_path / "s.duckdb"
    duckdb.connect(str(db)).close()
    other = duckdb.connect(str(db))
    settings = ("SELECT current_setting('threads'), current_setting('max_vacuum_tasks'), "
                "current_setting('memory_limit')")
    try:
        defaults = other.execute(settings).fetchall()
        for r in range(2):
            write_trace(tmp_path / "run" / f"rank{r}.json.gz", nccl_trace(r, world=2))
        rep = ingest([tmp_path / "run"], db)
        assert [f.status for f in rep.files] == ["ok", "ok"]
        assert other.execute(settings).fetchall() == defaults
        other.execute("SET max_vacuum_tasks = 7")
        other.execute("SET memory_limit = '3GB'")
        tuned = other.execute(settings).fetchall()
        assert tuned != defaults
        rep = ingest([tmp_path / "run"], db, run_id="again")
        assert [f.status for f in rep.files] == ["ok", "ok"]
        assert other.execute(settings).fetchall() == tuned
        assert other.execute("SELECT count(DISTINCT run_id || rank) FROM events").fetchall() == [(4,)]
    finally:
        other.close()


def test_files_last_row_groups_are_not_rewritten_at_close(tmp_path: Path) -> None:
    """Each trace of more than a row group (122,880 rows) is written straight to the store and
    ends in a partial row group. The checkpoint at the end of ingest must run with the vacuum
    still off, or it rewrites every such group to merge it with the next (0.25 CPU-s at 8 ranks,
    docs/ingest.md): the partial groups stay where each file put them."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from gen_traces import write_rank

    for r in range(2):
        write_rank(tmp_path / f"rank{r}.json", r, 2, 200_000)
    db = tmp_path / "s.duckdb"
    for r in range(2):  # one commit each
        rep = ingest([tmp_path / f"rank{r}.json"], db, run_id="r")
        assert [f.status for f in rep.files] == ["ok"]
    con = duckdb.connect(str(db), read_only=True)
    try:
        groups = [n for (n,) in con.execute("SELECT max(count) FROM pragma_storage_info('events') "
                                            "GROUP BY row_group_id ORDER BY row_group_id").fetchall()]
        per_file = [n for (n,) in con.execute("SELECT count(*) FROM events GROUP BY rank ORDER BY rank").fetchall()]
    finally:
        con.close()
    assert all(n > 122_880 for n in per_file)
    assert groups == [122_880, per_file[0] - 122_880, 122_880, per_file[1] - 122_880]


@pytest.mark.parametrize("user_value", [None, "mimalloc"])
def test_cli_gives_arrow_the_system_allocator(user_value: str | None) -> None:
    """Arrow's mimalloc pool costs the Kineto path page faults and peak memory; the CLI picks the
    system allocator before pyarrow loads, unless the user chose one."""
    code = ("import sys; from click.testing import CliRunner; from tracekit.cli import main; "
            "r = CliRunner().invoke(main, ['ingest', '--help']); assert r.exit_code == 0, r.output; "
            "assert 'pyarrow' in sys.modules; import pyarrow; print(pyarrow.default_memory_pool().backend_name)")
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if user_value is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = user_value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == (user_value or "system")
