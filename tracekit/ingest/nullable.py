"""Nullable integer and text columns as numpy arrays, with SQL's rules for nulls and overflow.

kineto_comm derives the communication tables with these, as the SQL it replaced did (its
oracle, tests/kineto_comm_sql.py): a null propagates through arithmetic, ``coalesce`` takes the
first value that is there, and BIGINT arithmetic that overflows is an error, not a wrap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracekit.ingest import columns
from tracekit.ingest.common import IngestError

_I64 = np.iinfo(np.int64)


class Text:
    """A text column as codes (int32, -1 for null) into its distinct values (``dictionary``, an
    Arrow array; ``values``, the same as Python strings, made when first asked for)."""

    def __init__(self, codes: np.ndarray, dictionary: pa.Array) -> None:
        self.codes, self.dictionary = codes, dictionary
        self._values: list[str] | None = None

    @classmethod
    def of(cls, column: pa.Array) -> "Text":
        enc = columns.one_array(pc.dictionary_encode(column))
        return cls(columns.filled(enc.indices, -1).astype(np.int32), enc.dictionary)

    @property
    def values(self) -> list[str]:
        if self._values is None:
            self._values = self.dictionary.to_pylist()
        return self._values

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
    def coded(cls, values: pa.Array, codes: np.ndarray) -> "Ints":
        """The value of each row's code, from an int64 Arrow array of one value per distinct code
        (a code of -1 is a null)."""
        v = np.append(columns.filled(values), 0)
        ok = np.append(columns.to_bools(values.is_valid()), False)
        return cls(v[codes], ok[codes])

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


def ordinals(keys: np.ndarray, ts: Ints, first_step_ns: int | None) -> np.ndarray:
    """Each row's order among the rows of its key (by ts, nulls last, ties in row order), 0 at the
    first row at or after ``first_step_ns``. ``keys``: one integer per row (rows with equal
    integers share a key), or a 2-D integer array with one row per row (equal rows share a key)."""
    n = len(keys)
    if not n:
        return np.zeros(0, dtype=np.int64)
    _, gid = np.unique(row_ids(keys if np.ndim(keys) == 2 else np.asarray(keys).reshape(n, 1)), return_inverse=True)
    gid = gid.reshape(n)  # dense, from 0
    order = np.lexsort((ts.v, ~ts.ok, gid))
    g = gid[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    pos = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    out = np.empty(n, dtype=np.int64)
    out[order] = pos
    if first_step_ns is not None:
        before = np.bincount(gid, weights=ts.ok & (ts.v < first_step_ns), minlength=int(gid.max()) + 1).astype(np.int64)
        out -= before[gid]
    return out


def row_ids(keys: np.ndarray) -> np.ndarray:
    """One integer per row of a 2-D integer array, equal exactly where the rows are equal: the
    columns combined in mixed radix, each column first numbered densely where its range is wide."""
    n, width = keys.shape
    gid = np.zeros(n, dtype=np.int64)
    if not n:
        return gid
    span = 1
    for j in range(width):
        col = keys[:, j].astype(np.int64)
        lo, hi = int(col.min()), int(col.max())
        radix = hi - lo + 1
        if radix > n:  # a wide range (ranks, sizes): number its distinct values instead
            values, col = np.unique(col, return_inverse=True)
            col, lo, radix = col.reshape(-1), 0, len(values)
        if span * radix >= 1 << 62:  # renumber what is combined so far, densely
            values, gid = np.unique(gid, return_inverse=True)
            gid, span = gid.reshape(-1), len(values)
        gid = gid * radix + (col - lo)
        span *= radix
    return gid


def text(values: list[str], codes: np.ndarray) -> pa.Array:
    """A string column of ``values[code]`` per row (null where the code is negative), taken in
    Arrow from the few distinct values rather than built from a Python string per row."""
    dictionary = columns.from_values(values, pa.string())
    if not len(values):
        return pa.nulls(len(codes), pa.string())
    return dictionary.take(columns.from_numpy(np.maximum(codes, 0).astype(np.int32), codes >= 0))


def constant_text(value: str, n: int) -> pa.Array:
    """``value`` in each of ``n`` rows."""
    return text([value], np.zeros(n, dtype=np.int32))


def ints(col: pa.ChunkedArray | pa.Array) -> Ints:
    """An integer Arrow column as Ints."""
    arr = columns.one_array(col)
    return Ints(columns.filled(arr), columns.to_bools(arr.is_valid()))
