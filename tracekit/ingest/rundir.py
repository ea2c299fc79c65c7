"""Which files make up which run: run directories, manifests, run ids and ranks from file names.

The trainer's run directory (DESIGN.md) holds ``manifest.json`` beside ``traces/``, ``fr/`` and
``memory/``. From a manifest ingest reads, when present: ``run_id``; ``world_size``; ``backend``;
the sizes ``tp``/``cp``/``pp``/``dp`` at top level or under ``config`` or ``layout``; per-rank
``pids`` and ``hosts`` (``{rank: value}``) or a ``ranks`` list of ``{rank, pid, host}``; and
``groups`` as a list of ``{pg_name, pg_desc, ranks}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tracekit.dataset import MARKER as DATASET_MARKER
from tracekit.ingest.common import IngestError
from tracekit.topology import DIMS

MANIFEST = "manifest.json"
ARTIFACT_DIRS = ("traces", "fr", "fr_json", "memory", "profiler")
_RANK_PATTERNS = (re.compile(r"rank[-_]?(\d+)", re.I), re.compile(r"_(\d+)\."))


@dataclass
class Manifest:
    path: Path
    data: dict
    run_id: str
    world_size: int | None = None
    backend: str | None = None
    sizes: dict[str, int] | None = None
    order: tuple[str, ...] | None = None  # how the job numbered its ranks, innermost first (None: DIMS)
    pid_rank: dict[int, int] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)


def _by_rank(value: object) -> list[tuple[object, object]]:
    """(rank, value) pairs of a per-rank manifest entry: {rank: v} or a list indexed by rank (the
    reference trainer writes lists)."""
    if isinstance(value, list):
        return list(enumerate(value))
    return list((value or {}).items())  # type: ignore[union-attr]


def read_manifest(path: Path) -> Manifest:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IngestError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(data, dict):
        raise IngestError(f"{path}: manifest is not a JSON object")
    m = Manifest(path=path, data=data, run_id=str(data.get("run_id") or path.parent.name))
    m.world_size = data.get("world_size") if isinstance(data.get("world_size"), int) else None
    m.backend = data.get("backend")
    for holder in (data, data.get("config"), data.get("layout")):
        if isinstance(holder, dict) and all(isinstance(holder.get(d), int) for d in DIMS):
            m.sizes = {d: holder[d] for d in DIMS}
            order = holder.get("order")
            if isinstance(order, list) and sorted(map(str, order)) == sorted(DIMS):
                m.order = tuple(map(str, order))
            break
    try:
        for r, pid in _by_rank(data.get("pids")):
            m.pid_rank[int(pid)] = int(r)
        for r, host in _by_rank(data.get("hosts")):
            m.hosts[int(r)] = str(host)
        for item in data.get("ranks") or []:
            if isinstance(item, dict) and "rank" in item:
                if item.get("pid") is not None:
                    m.pid_rank[int(item["pid"])] = int(item["rank"])
                if item.get("host") is not None:
                    m.hosts[int(item["rank"])] = str(item["host"])
        for g in data.get("groups") or []:
            m.groups.append({"pg_name": str(g.get("pg_name")), "pg_desc": g.get("pg_desc"),
                             "ranks": [int(r) for r in g["ranks"]]})
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise IngestError(f"{path}: malformed per-rank or group entries in manifest ({e})") from None
    return m


def find_manifest(file: Path, stop: Path | None = None) -> Path | None:
    """The manifest of the run a file belongs to: in its directory or the one above."""
    for d in (file.parent, file.parent.parent):
        cand = d / MANIFEST
        if cand.is_file():
            return cand
        if stop is not None and d == stop:
            break
    return None


def default_run_id(file: Path) -> str:
    """Loose files: their directory's name (the run directory's, for files under traces/ etc.)."""
    parent = file.resolve().parent
    return parent.parent.name if parent.name in ARTIFACT_DIRS else parent.name


def rank_from_name(file: Path) -> int | None:
    for pat in _RANK_PATTERNS:
        m = pat.search(file.name)
        if m:
            return int(m.group(1))
    return None


@dataclass
class Job:
    path: Path
    explicit: bool  # named on the command line (unrecognized content is then an error)
    run_id: str
    manifest: Manifest | None


def collect(paths: list[Path], run_id: str | None = None) -> list[Job]:
    """Expand files and directories into ingest jobs, each with its run id and manifest."""
    manifests: dict[Path, Manifest] = {}
    jobs: list[Job] = []
    seen: set[Path] = set()

    def manifest_for(f: Path) -> Manifest | None:
        mp = find_manifest(f)
        if mp is None:
            return None
        if mp not in manifests:
            manifests[mp] = read_manifest(mp)
        return manifests[mp]

    for p in paths:
        if not p.exists():  # logged as a failed file; the other paths still go in
            jobs.append(Job(path=p, explicit=True, run_id=run_id or default_run_id(p), manifest=None))
            continue
        if p.is_dir():
            if (p / DATASET_MARKER).exists():
                raise IngestError(f"{p}: a tracekit Parquet dataset (a store to analyse), not traces to ingest")
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            # a dataset inside the folder (tracekit ingest RUN --out RUN/ds) is a store, not traces
            stores = [f.parent for f in files if f.name == DATASET_MARKER]
            files = [f for f in files if not any(f.is_relative_to(d) for d in stores)]
            explicit = False
        else:
            files, explicit = [p], True
        for f in files:
            if f.name == MANIFEST or f.resolve() in seen or (not explicit and _optable_meta(f)):
                continue
            seen.add(f.resolve())
            m = manifest_for(f)
            rid = run_id or (m.run_id if m else default_run_id(f))
            jobs.append(Job(path=f, explicit=explicit, run_id=rid, manifest=m))
    return jobs


def _optable_meta(f: Path) -> bool:
    """A what-if op table's meta*.yaml: read with the parquet beside it (optable.py), not a file of
    its own, so a directory walk does not list it among the files it passed over."""
    return f.name.startswith("meta") and f.suffix in (".yaml", ".yml") and any(f.parent.glob("*.parquet"))
