"""A run's topology in the store: groups as recorded, then runs / ranks / groups.dim recomputed.

Sizes come from the manifest when it gives them, else from the op-table's own metadata, else they
are inferred from the recorded process groups (``layout_infer``: DeviceMesh names first, then the
groups' structure); a guess that another layout would explain as well is logged as a warning. A run whose groups explain nothing keeps NULL sizes ('unknown').
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import PurePath

import duckdb
import pyarrow as pa

from tracekit.ingest import columns, rundir
from tracekit.ingest.common import Parsed, crash_point, group_key
from tracekit.layout_infer import dim_of_desc, infer_layout
from tracekit.topology import DIMS, Layout

PER_RANK_FORMATS = ("kineto", "fr", "memory")


@dataclass
class RunBatch:
    """A run this ingest touched; what its files say about the run is read back from the store
    (``file_meta``), so that the result never depends on which files this ingest itself wrote."""

    run_id: str
    manifest: rundir.Manifest | None
    touched: bool = False
    warnings: list[str] = field(default_factory=list)  # what finalize found wrong with the run

    def note(self, parsed: Parsed | None = None, rank: int | None = None) -> None:
        self.touched = True


@dataclass
class FileFacts:
    """What the run's ingested files say, from ``file_meta``."""

    world_sizes: list[int] = field(default_factory=list)
    backends: set[str] = field(default_factory=set)
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    hosts: dict[int, str] = field(default_factory=dict)  # rank -> host, where a file's name says it
    groups: dict[tuple, dict] = field(default_factory=dict)  # by identity
    descs: dict[tuple, set] = field(default_factory=dict)  # every pg_desc the files gave each group


FILE_META_ROW = "(?, ?, ?, ?, ?, ?, ?)"
GROUP_ROW = "(?, ?, ?, NULL::VARCHAR, ?::INTEGER[], ?)"


def file_meta_values(run_id: str, path: object, parsed: Parsed, rank: int | None) -> list:
    """The ``file_meta`` row of one file (FILE_META_ROW's parameters): what it says about its run."""
    return [run_id, str(path), rank, parsed.world_size, parsed.backend,
            parsed.pids[0] if rank is not None and parsed.pids else None,
            json.dumps([{"pg_name": g.get("pg_name"), "pg_desc": g.get("pg_desc"),
                         "ranks": [int(r) for r in g["ranks"]]} for g in parsed.groups])]


def group_values(run_id: str, g: dict) -> list:
    """The ``groups`` row of one process group (GROUP_ROW's parameters; ``dim`` is set when the
    run's topology is recomputed)."""
    ranks = [int(r) for r in g["ranks"]]
    return [run_id, g.get("pg_name"), g.get("pg_desc"), ranks, len(ranks)]


def insert_file_meta(con: duckdb.DuckDBPyConnection, run_id: str, path: object, parsed: Parsed,
                     rank: int | None) -> None:
    """Record what one file says about its run, with its rows (its transaction)."""
    con.execute(f"INSERT INTO file_meta VALUES {FILE_META_ROW}", file_meta_values(run_id, path, parsed, rank))


# torch.profiler.tensorboard_trace_handler names each trace after its process:
# f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json" (.gz when gzipped)
_HANDLER_NAME = re.compile(r"^(?P<host>.+)_(?P<pid>\d+)\.\d+\.pt\.trace\.json(?:\.gz)?$")


def host_from_name(path: str, pid: int | None) -> str | None:
    """The host a trace was written on, from tensorboard_trace_handler's file name, where the name's
    pid is the trace's own (another name that merely looks like it says nothing)."""
    m = _HANDLER_NAME.match(PurePath(path).name)
    return m["host"] if m and (pid is None or int(m["pid"]) == pid) else None


def file_facts(con: duckdb.DuckDBPyConnection, run_id: str) -> FileFacts:
    facts = FileFacts()
    # in path order: the first file's group entry is the one recorded, whichever committed first
    for path, rank, world, backend, pid, groups in con.execute(
            "SELECT path, rank, world_size, backend, pid, groups FROM file_meta WHERE run_id = ? ORDER BY path",
            [run_id]).fetchall():
        if world:
            facts.world_sizes.append(world)
        if backend:
            facts.backends.add(backend)
        if rank is not None and pid is not None:
            facts.pids.setdefault(rank, pid)
        if rank is not None and (host := host_from_name(path, pid)):
            facts.hosts.setdefault(rank, host)
        for g in json.loads(groups or "[]"):
            key = group_key(g)
            facts.groups.setdefault(key, g)
            facts.descs.setdefault(key, set()).add(g.get("pg_desc"))
    return facts


def add_groups(con: duckdb.DuckDBPyConnection, run_id: str, groups: list[dict]) -> None:
    """Record process groups not yet known for the run (same name and ranks = same group)."""
    if not groups:
        return
    # the run's groups read once (a query per group was 0.7 ms each, at the end of every ingest)
    known = {(name, tuple(ranks)) for name, ranks in
             con.execute("SELECT pg_name, ranks FROM groups WHERE run_id = ?", [run_id]).fetchall()}
    for g in groups:
        name, ranks = g.get("pg_name"), tuple(int(r) for r in g["ranks"])
        key = (None if name is None else str(name), ranks)  # as the VARCHAR column holds it
        if ranks and key not in known:
            insert_group(con, run_id, g)
            known.add(key)


def preferred_desc(descs: set[str | None]) -> str | None:
    """The description a group keeps when files describe it differently (an FR dump's 'default_pg',
    a trace's 'world'): a dimension's name first, since it tells the layout, then the first in
    sorted order. Without a rule the first file committed would decide, and the store would depend
    on which parse finished first."""
    named = sorted(d for d in descs if d is not None)
    return next((d for d in named if dim_of_desc(d)), named[0] if named else None)


def _settle_descs(con: duckdb.DuckDBPyConnection, run_id: str, facts: FileFacts, manifest_groups: list[dict]) -> None:
    """Give each group of the run that its files described its preferred description."""
    descs = {k: set(v) for k, v in facts.descs.items()}
    for g in manifest_groups:
        descs.setdefault(group_key(g), set()).add(g.get("pg_desc"))
    for name, desc, ranks in con.execute("SELECT pg_name, pg_desc, ranks FROM groups WHERE run_id = ?",
                                         [run_id]).fetchall():
        seen = descs.get((name, tuple(ranks)))
        if seen is None:
            continue
        best = preferred_desc(seen | {desc})
        if best != desc:
            con.execute("UPDATE groups SET pg_desc = ? WHERE run_id = ? AND pg_name IS NOT DISTINCT FROM ? "
                        "AND ranks = ?::INTEGER[]", [best, run_id, name, list(ranks)])


def insert_group(con: duckdb.DuckDBPyConnection, run_id: str, g: dict) -> None:
    """Record one process group."""
    con.execute(f"INSERT INTO groups VALUES {GROUP_ROW}", group_values(run_id, g))


def ranges_text(rs: list[int]) -> str:
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def _layout(con: duckdb.DuckDBPyConnection, rb: RunBatch, world: int, prev: dict,
            groups: list[tuple]) -> tuple[Layout | None, str, str | None]:
    """(layout, layout_source, why it may be wrong) for one run."""
    m = rb.manifest
    if m is not None and m.sizes is not None:
        lay = Layout(**m.sizes, order=m.order or DIMS)
        if lay.world_size == world:
            return lay, "manifest", None
    if prev.get("layout_source") == "wia-meta" and prev.get("tp"):
        return Layout(**{d: prev[d] for d in DIMS}), "wia-meta", None
    p2p_names = {r[0] for r in con.execute("SELECT DISTINCT pg_name FROM p2p WHERE run_id = ?",
                                           [rb.run_id]).fetchall()}
    named = con.execute("SELECT pg_name, ranks FROM groups WHERE run_id = ?", [rb.run_id]).fetchall()
    p2p_groups = [ranks for name, ranks in named if name in p2p_names]
    guess = infer_layout(world, [(desc, ranks) for _, desc, ranks in groups], p2p_groups)
    return guess.layout, guess.source, guess.ambiguity


def _insert_ranks(con: duckdb.DuckDBPyConnection, rid: str, ranks: "range | list[int]", lay: Layout | None,
                  m: rundir.Manifest | None, prev: dict, pids: dict[int, int], hosts: dict[int, str]) -> None:
    """The run's ranks rows in one insert (a row per INSERT took minutes at a world of 10^5)."""
    rows: dict[str, list] = {k: [] for k in ("rank", "dp", "pp", "cp", "tp", "host", "pid", "clock_offset_ns")}
    for r in ranks:
        c = lay.coords(r) if lay else None
        old = prev.get(r)
        for k, v in zip(rows, (r, c and c.dp, c and c.pp, c and c.cp, c and c.tp,
                               (m.hosts.get(r) if m else None) or hosts.get(r) or (old[6] if old else None),
                               pids.get(r, old[7] if old else None), old[8] if old else None)):
            rows[k].append(v)
    types = {"host": pa.string(), "pid": pa.int64(), "clock_offset_ns": pa.int64()}
    table = columns.table({k: columns.from_values(v, types.get(k, pa.int32()), f"ranks.{k}") for k, v in rows.items()})
    con.register("_tk_ranks", table)
    try:
        con.execute("INSERT INTO ranks SELECT ?, rank, dp, pp, cp, tp, host, pid, clock_offset_ns FROM _tk_ranks",
                    [rid])
    finally:
        try:
            con.unregister("_tk_ranks")
        except duckdb.Error:  # the failed insert aborted the transaction; its error is the one to report
            pass


def finalize(con: duckdb.DuckDBPyConnection, rb: RunBatch) -> dict[tuple[str, str], list[int]]:
    """Recompute runs, ranks and groups.dim for one run; return ranks missing per format."""
    rid, m = rb.run_id, rb.manifest
    rows = con.execute("SELECT * FROM runs WHERE run_id = ?", [rid]).fetchall()
    prev_row = rows[0] if rows else None
    prev = dict(zip([d[0] for d in con.description], prev_row)) if prev_row else {}
    have: dict[str, set[int]] = {}
    for fmt, r in con.execute("SELECT format, rank FROM ingest_log WHERE run_id = ? AND status = 'ok' "
                              "AND rank IS NOT NULL", [rid]).fetchall():
        have.setdefault(fmt, set()).add(r)
    prev_ranks = {r[1]: r for r in con.execute("SELECT * FROM ranks WHERE run_id = ?", [rid]).fetchall()}
    seen = set().union(*have.values(), prev_ranks) if (have or prev_ranks) else set()
    facts = file_facts(con, rid)
    world = (m.world_size if m and m.world_size else None) or (max(facts.world_sizes) if facts.world_sizes else None) \
        or prev.get("world_size") or (max(seen) + 1 if seen else None)
    if m is not None:
        add_groups(con, rid, m.groups)
    # Each file records its groups with its rows; a group that a file found already claimed by
    # another worker's transaction, which then rolled back, is recorded here instead.
    add_groups(con, rid, list(facts.groups.values()))
    _settle_descs(con, rid, facts, m.groups if m is not None else [])
    groups = con.execute("SELECT rowid, pg_desc, ranks FROM groups WHERE run_id = ?", [rid]).fetchall()
    lay, source, doubt = _layout(con, rb, world, prev, groups) if world else (None, "unknown", None)
    formats = sorted(have) or ([prev["source"]] if prev.get("source") else [])
    run_source = "trainer" if m else (formats[0] if len(formats) == 1 else "mixed" if formats else "unknown")
    backend = (m.backend if m else None) or (sorted(facts.backends)[0] if facts.backends else prev.get("backend"))
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute("DELETE FROM runs WHERE run_id = ?", [rid])
        sizes = [getattr(lay, d) if lay else None for d in DIMS]
        con.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, now())",
                    [rid, "wia" if source == "wia-meta" else run_source,
                     str(m.path.parent) if m else prev.get("root"), world, *sizes, source, backend,
                     json.dumps(m.data) if m else prev.get("manifest")])
        if source != "wia-meta":
            con.execute("DELETE FROM ranks WHERE run_id = ?", [rid])
            _insert_ranks(con, rid, range(world) if lay else sorted(seen), lay, m, prev_ranks, facts.pids,
                          facts.hosts)
        settled: dict[tuple[str, int], list[int]] = {}  # (dim, size) -> rowids: an UPDATE each, not one a group
        for rowid, _, ranks in groups:
            dim = (lay.dim_of(ranks) if lay and max(ranks) < lay.world_size else None) or \
                ("world" if world and sorted(ranks) == list(range(world)) else "other")
            settled.setdefault((dim, len(ranks)), []).append(rowid)
        for (dim, size), rowids in settled.items():
            con.execute("UPDATE groups SET dim = ?, size = ? WHERE rowid IN (SELECT unnest(?::BIGINT[]))",
                        [dim, size, rowids])
        con.execute("DELETE FROM ingest_log WHERE run_id = ? AND status = 'warning'", [rid])
        missing: dict[tuple[str, str], list[int]] = {}
        for fmt in PER_RANK_FORMATS:
            if fmt in have and world:
                gone = sorted(set(range(world)) - have[fmt])
                if gone:
                    missing[(rid, fmt)] = gone
                    con.execute("INSERT INTO ingest_log VALUES (?, NULL, ?, NULL, NULL, 'warning', ?, 0, 0, now())",
                                [rid, fmt, f"ranks missing from {fmt} data: {ranges_text(gone)} "
                                           f"({len(gone)} of {world})"])
        if doubt:
            con.execute("INSERT INTO ingest_log VALUES (?, NULL, NULL, NULL, NULL, 'warning', ?, 0, 0, now())",
                        [rid, f"layout {lay or 'unknown'} ({source}): {doubt}"])
        crash_point("finalize")
        claimed = sorted(set(facts.world_sizes))
        if len(claimed) > 1:
            rb.warnings.append(f"files disagree on the world size ({', '.join(map(str, claimed))}); "
                               f"taken as {world}")
            con.execute("INSERT INTO ingest_log VALUES (?, NULL, NULL, NULL, NULL, 'warning', ?, 0, 0, now())",
                        [rid, rb.warnings[-1]])
        outside = sorted(r for r in seen if world and r >= world)
        if outside:
            con.execute("INSERT INTO ingest_log VALUES (?, NULL, NULL, NULL, NULL, 'warning', ?, 0, 0, now())",
                        [rid, f"ranks {ranges_text(outside)} lie outside the world size {world}"])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return missing
