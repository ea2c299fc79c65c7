"""Nullable integer and text columns as numpy arrays, with SQL's rules for nulls and overflow.

kineto_comm derives the communication tables with these, as the SQL it replaced did (its
oracle, tests/kineto_comm_sql.py): a null propagates through arithmetic, ``coalesce`` takes the
first value that is there, and BIGINT arithmetic that overflows is an error, not a wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracekit.ingest import columns
from tracekit.ingest.common import IngestError

_I64 = np.iinfo(np.int64)


@dataclass
class Text:
    """A text column as codes (int32, -1 for null) into its distinct values."""

    codes: np.ndarray
    values: list[str]

    @classmethod
    def of(cls, column: pa.Array) -> "Text":
        enc = columns.one_array(pc.dictionary_encode(column))
        values = enc.dictionary.to_pylist()
        codes = columns.filled(enc.indices, -1).astype(np.int32)
        return cls(codes, values)

    def code_of(self, value: str) -> int:
        try:
            return self.values.index(value)
        except ValueError:
            return -2  # matches no row (and not a null)

    def lut(self, fn: Callable[[str], object]) -> list:
        """fn of every distinct value, plus None for the null code (-1, the last entry)."""
        return [fn(v) for v in self.values] + [None]


class Ints:
    """Nullable int64 values: ``v`` where ``ok``."""

    def __init__(self, v: np.ndarray, ok: np.ndarray) -> None:
        self.v, self.ok = v.astype(np.int64), ok.astype(bool)

    @classmethod
    def of(cls, values: list[int | None], codes: np.ndarray) -> "Ints":
        """The value of each row's code, from one value per distinct code (+ None for null)."""
        v = np.array([0 if x is None else x for x in values], dtype=np.int64)
        ok = np.array([x is not None for x in values], dtype=bool)
        return cls(v[codes], ok[codes])

    def take(self, idx: np.ndarray) -> "Ints":
        return Ints(self.v[idx], self.ok[idx])

    def coalesce(self, other: "Ints") -> "Ints":
        return Ints(np.where(self.ok, self.v, other.v), self.ok | other.ok)

    def arrow(self) -> pa.Array:
        """As int64; ``_table`` casts to the store's type, an error where a value does not fit."""
        return columns.from_numpy(np.where(self.ok, self.v, 0), self.ok)


def _overflow(what: str, path: Path) -> IngestError:
    return IngestError(f"{path}: malformed trace events (a {what} out of the 64-bit range)")


def add(a: Ints, b: Ints, what: str, path: Path) -> Ints:
    """a + b where both are valid; an error on overflow, as DuckDB's BIGINT arithmetic."""
    ok = a.ok & b.ok
    with np.errstate(over="ignore"):
        out = a.v + b.v  # wraps; overflow shows as a result of the other sign than both operands
    if (ok & (((a.v ^ out) & (b.v ^ out)) < 0)).any():
        raise _overflow(what, path)
    return Ints(out, ok)


def mul(a: Ints, b: Ints, what: str, path: Path) -> Ints:
    """a * b where both are valid; an error on overflow. Products that could overflow (a factor
    beyond 2**31, rare: sizes and ranks) are redone with Python's integers."""
    ok = a.ok & b.ok
    with np.errstate(over="ignore"):
        out = a.v * b.v
    for i in np.flatnonzero(ok & ((np.abs(a.v) > (1 << 31)) | (np.abs(b.v) > (1 << 31)))).tolist():
        r = int(a.v[i]) * int(b.v[i])
        if not _I64.min <= r <= _I64.max:
            raise _overflow(what, path)
        out[i] = r
    return Ints(out, ok)


def ordinals(keys: list[object], ts: Ints, first_step_ns: int | None) -> np.ndarray:
    """Each row's order among the rows of its key (by ts, nulls last, ties in row order), 0 at the
    first row at or after ``first_step_ns``. ``keys`` are hashable, one per row (None is a key)."""
    n = len(keys)
    ids: dict[object, int] = {}
    gid = np.fromiter((ids.setdefault(k, len(ids)) for k in keys), dtype=np.int64, count=n)
    order = np.lexsort((ts.v, ~ts.ok, gid))
    g = gid[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if n else np.zeros(0, dtype=np.int64)
    pos = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    out = np.empty(n, dtype=np.int64)
    out[order] = pos
    if first_step_ns is not None:
        before = np.bincount(gid, weights=ts.ok & (ts.v < first_step_ns), minlength=len(ids)).astype(np.int64)
        out -= before[gid]
    return out


def ints(col: pa.ChunkedArray | pa.Array) -> Ints:
    """An integer Arrow column as Ints."""
    arr = columns.one_array(col)
    return Ints(columns.filled(arr), columns.to_bools(arr.is_valid()))
