"""The facts that span files, for transactions that run at the same time.

Each worker commits its own files in its own transaction (pipeline.py). DuckDB runs such
transactions in parallel, but a transaction sees neither the rows nor the log entries of the others
until they commit, so checks made in SQL inside it would let two files through that exclude each
other. The ledger holds those facts instead, under one lock: which content each run already holds,
which files hold each (run, format, rank), which process groups each run has recorded. It starts
from the store as it is when the ingest begins; a file's ``claim`` adds its own facts before its
rows are written, and ``release`` takes them back if its transaction rolls back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from tracekit.ingest.common import IngestError, group_key

_ABSENT = object()


class RankTaken(IngestError):
    """Another file holds this file's rank (of its format) in the run."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class SameContent(Exception):
    """The run already holds (or is being given) a file with this content."""

    def __init__(self, fmt: str | None, rank: int | None) -> None:
        super().__init__("already ingested (same content)")
        self.format, self.rank = fmt, rank


@dataclass
class Claim:
    """What one file claimed, with the previous values needed to take it back."""

    replace: bool  # the file replaces rows of its own earlier version (same path, other content)
    new_groups: list[dict]  # groups this file records first, to insert with its rows
    undo: list[tuple[dict, object, object]] = field(default_factory=list)  # (map, key, old value)


class Ledger:
    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self._lock = threading.Lock()
        # (run, content hash) -> (format, rank, path) of the file that holds it
        self._content: dict[tuple[str, str], tuple[str | None, int | None, str]] = {}
        # (run, format, rank) -> paths of the files that hold that rank's rows of that format
        self._holders: dict[tuple[str, str, int], frozenset[str]] = {}
        for rid, digest, fmt, rank, path in con.execute(
                "SELECT run_id, content_hash, format, rank, path FROM ingest_log WHERE status = 'ok'").fetchall():
            if digest is not None:
                self._content[(rid, digest)] = (fmt, rank, path)
            if rank is not None:
                key = (rid, fmt, rank)
                self._holders[key] = self._holders.get(key, frozenset()) | {path}
        self._groups: dict[tuple, bool] = {
            (rid, name, tuple(ranks)): True
            for rid, name, ranks in con.execute("SELECT run_id, pg_name, ranks FROM groups").fetchall()}
        stored: dict[str, set[str]] = {}
        for rid, digest in self._content:
            stored.setdefault(rid, set()).add(digest)
        self._stored = {rid: frozenset(hs) for rid, hs in stored.items()}

    def stored(self, run_id: str) -> frozenset[str]:
        """Content hashes the run held when the ingest began (files with them need not be read)."""
        return self._stored.get(run_id, frozenset())

    def holds(self, run_id: str, digest: str) -> bool:
        """Whether a file with this content is in the run (in the store, or committed by this ingest)."""
        with self._lock:
            return (run_id, digest) in self._content

    def previous(self, run_id: str, digest: str | None) -> tuple[str | None, int | None]:
        """(format, rank) of the file that holds this content in the run, if any."""
        with self._lock:
            fmt, rank, _ = self._content.get((run_id, digest or ""), (None, None, ""))
        return fmt, rank

    def claim(self, run_id: str, path: Path, fmt: str, rank: int | None, digest: str | None,
              groups: list[dict]) -> Claim:
        """Record that this file is being written. Raises SameContent when the run holds its content
        already, IngestError when another file holds its rank."""
        p = str(path)
        with self._lock:
            if digest is not None and (run_id, digest) in self._content:
                held_fmt, held_rank, _ = self._content[(run_id, digest)]
                raise SameContent(held_fmt, held_rank)
            claim = Claim(False, [])
            if rank is not None:
                key = (run_id, fmt, rank)
                holders = self._holders.get(key, frozenset())
                others = sorted(holders - {p})
                if others:
                    raise RankTaken(f"{path}: duplicate rank {rank} in run {run_id!r}: "
                                    f"{fmt} data for it was already ingested from {others[0]}", others[0])
                claim.replace = p in holders
                if claim.replace:  # its earlier content leaves the store with its rows
                    for k, (_, _, held_path) in list(self._content.items()):
                        if k[0] == run_id and held_path == p:
                            self._set(claim, self._content, k, _ABSENT)
                self._set(claim, self._holders, key, holders | {p})
            if digest is not None:
                self._set(claim, self._content, (run_id, digest), (fmt, rank, p))
            for g in groups:
                key = (run_id, *group_key(g))
                if g["ranks"] and key not in self._groups:
                    self._set(claim, self._groups, key, True)
                    claim.new_groups.append(g)
            return claim

    def rank_of(self, run_id: str, fmt: str, path: str) -> int | None:
        """The rank of ``fmt`` that this file holds in the run."""
        with self._lock:
            return next((k[2] for k, paths in self._holders.items()
                         if k[0] == run_id and k[1] == fmt and path in paths), None)

    def evict(self, run_id: str, fmt: str, rank: int, path: str) -> list[tuple[dict, object, object]]:
        """Forget a file's hold on its rank and content (its rows are being deleted); what was
        forgotten, for ``unevict``."""
        with self._lock:
            undo: list[tuple[dict, object, object]] = []
            key = (run_id, fmt, rank)
            undo.append((self._holders, key, self._holders.get(key, frozenset())))
            self._holders[key] = self._holders.get(key, frozenset()) - {path}
            for k, v in list(self._content.items()):
                if k[0] == run_id and v[2] == path:
                    undo.append((self._content, k, v))
                    del self._content[k]
            return undo

    def unevict(self, undo: list[tuple[dict, object, object]]) -> None:
        with self._lock:
            for table, key, old in undo:
                table[key] = old

    def release(self, claim: Claim | None) -> None:
        """Take a claim back (its transaction rolled back)."""
        if claim is None:
            return
        with self._lock:
            for table, key, old in reversed(claim.undo):
                if old is _ABSENT:
                    table.pop(key, None)
                else:
                    table[key] = old
            claim.undo.clear()

    @staticmethod
    def _set(claim: Claim, table: dict, key: object, value: object) -> None:
        claim.undo.append((table, key, table.get(key, _ABSENT)))
        if value is _ABSENT:
            table.pop(key, None)
        else:
            table[key] = value
