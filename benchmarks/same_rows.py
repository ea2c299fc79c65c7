"""Ingest the same inputs with two versions of tracekit and check that every table holds the same
rows: a change meant to be faster must not change what the store says.

    python benchmarks/same_rows.py --before /tmp/tracekit-before PATH [PATH ...]

``--before`` is another checkout of the repository (say ``git worktree add`` or ``git archive`` of
the commit before the change, with its compiled extensions built or copied); this checkout is the
"after". Each PATH (a run directory, a folder of traces, a trace) is ingested by the real CLI
(``tracekit ingest PATH --store S``) once with each version, in a subprocess whose PYTHONPATH is
that checkout, into its own new store. Then for every table of tracekit.schema the rows of one
store that the other lacks, both ways (``EXCEPT ALL``, so duplicates count), are counted: all
columns but the timing ones (``ingest_log.seconds``, ``ingested_at``). Prints a table per PATH;
exit code 1 if any table differs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VOLATILE = {"ingested_at", "seconds"}


def ingest(tree: Path, path: Path, store: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-P", "-c", "from tracekit.cli import main; main()", "ingest", str(path),
           "--store", str(store), "--json"]
    res = subprocess.run(cmd, env=env, cwd=store.parent, capture_output=True, text=True)
    if res.returncode not in (0, 2):  # 2: some file failed, which must then fail the same way in both
        raise SystemExit(f"{tree}: ingest of {path} exited {res.returncode}:\n{res.stderr[-2000:]}")


def compare(before: Path, after: Path) -> list[tuple[str, int, int, int]]:
    """(table, rows, rows only before, rows only after) for every table."""
    import duckdb

    from tracekit import schema

    con = duckdb.connect()
    con.execute(f"ATTACH '{before}' AS b (READ_ONLY)")
    con.execute(f"ATTACH '{after}' AS a (READ_ONLY)")
    out = []
    for t in schema.TABLES:
        cols = ", ".join(f'"{c}"' for c in schema.columns(t) if c not in VOLATILE)
        rows = con.execute(f"SELECT count(*) FROM a.{t}").fetchall()[0][0]
        only_b = con.execute(f"SELECT count(*) FROM (SELECT {cols} FROM b.{t} EXCEPT ALL SELECT {cols} FROM a.{t})").fetchall()[0][0]
        only_a = con.execute(f"SELECT count(*) FROM (SELECT {cols} FROM a.{t} EXCEPT ALL SELECT {cols} FROM b.{t})").fetchall()[0][0]
        out.append((t, rows, only_b, only_a))
    con.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the other checkout")
    ap.add_argument("paths", type=Path, nargs="+")
    a = ap.parse_args()
    differ = False
    for path in a.paths:
        with tempfile.TemporaryDirectory() as tmp:
            stores = {}
            for name, tree in (("before", a.before.resolve()), ("after", ROOT)):
                (Path(tmp) / name).mkdir()
                stores[name] = Path(tmp) / name / "s.duckdb"
                ingest(tree, path.resolve(), stores[name])
            rows = compare(stores["before"], stores["after"])
        print(f"\n{path}\n\n| table | rows | only before | only after |\n|---|---|---|---|")
        for t, n, b, af in rows:
            if n or b or af:
                print(f"| {t} | {n:,} | {b} | {af} |")
            differ |= bool(b or af)
    print("\nsame rows in every table" if not differ else "\nTABLES DIFFER")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
