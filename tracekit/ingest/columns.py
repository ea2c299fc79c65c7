"""Arrow columns from Python values and numpy arrays, built from buffers.

pyarrow imports pandas (when installed: about 0.5 CPU-s, once per process) the first time
``pa.array``, ``pa.table`` or ``pa.Table.from_pylist`` is given Python objects or numpy arrays, to
check whether they are pandas objects. The flight-recorder and memory-snapshot parsers build
their tables here instead, so an ingest of a trainer's run directory does not pay for it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa

# The Python types a column accepts, checked value by value: numpy would silently truncate 1.5 to 1.
_ACCEPTS: dict[pa.DataType, tuple[type, ...]] = {
    pa.int32(): (int,), pa.int64(): (int,), pa.float64(): (float, int), pa.bool_(): (bool,), pa.string(): (str,),
}
_INT32_MAX = (1 << 31) - 1


def from_numpy(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A numeric numpy array as an Arrow array sharing its buffer; ``valid`` (bool) marks non-nulls."""
    values = np.ascontiguousarray(values)
    if values.dtype.kind not in "iuf":  # Arrow packs booleans into bits; strings are not numbers
        raise TypeError(f"from_numpy takes integers or floats, not {values.dtype}")
    typ = pa.from_numpy_dtype(values.dtype)
    bitmap, nulls = _validity(valid)
    return pa.Array.from_buffers(typ, len(values), [bitmap, pa.py_buffer(values)], null_count=nulls)


def from_bools(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A numpy bool array as an Arrow boolean array (bit-packed); ``valid`` marks non-nulls."""
    values = np.asarray(values, dtype=bool)
    bitmap, nulls = _validity(valid)
    return pa.Array.from_buffers(pa.bool_(), len(values), [bitmap, pa.py_buffer(np.packbits(values, bitorder="little"))],
                                 null_count=nulls)


def from_values(values: Sequence[Any], typ: pa.DataType, name: str = "column") -> pa.Array:
    """Python values (None for null) as an Arrow array of ``typ`` (int32, int64, float64, bool,
    string). Raises TypeError for a value of another type (or a string that is not valid Unicode)
    and OverflowError for an integer that does not fit; both name the column."""
    if typ not in _ACCEPTS:
        raise TypeError(f"{name}: no column builder for Arrow type {typ}")
    accepts = _ACCEPTS[typ]
    for i, v in enumerate(values):
        if v is not None and type(v) not in accepts:  # exact types: bool is not an int here
            raise TypeError(f"{name}: row {i} holds {type(v).__name__} {v!r:.40}, expected {typ}")
    n = len(values)
    valid = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    bitmap, nulls = _validity(valid)
    if typ == pa.string():
        try:
            data = [v.encode() if v is not None else b"" for v in values]
        except UnicodeEncodeError as e:  # a lone surrogate, which a pickle can hold
            raise TypeError(f"{name}: a string that is not valid Unicode ({e.reason})") from None
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, data), dtype=np.int64, count=n), out=offsets[1:])
        if offsets[-1] > _INT32_MAX:
            raise OverflowError(f"{name}: more than 2 GiB of text in one column")
        return pa.Array.from_buffers(typ, n, [bitmap, pa.py_buffer(offsets.astype(np.int32)),
                                              pa.py_buffer(b"".join(data))], null_count=nulls)
    if typ == pa.bool_():
        bits = np.packbits(np.fromiter((v is True for v in values), dtype=bool, count=n), bitorder="little")
        return pa.Array.from_buffers(typ, n, [bitmap, pa.py_buffer(bits)], null_count=nulls)
    wide = np.float64 if typ == pa.float64() else np.int64
    try:
        data = np.array([0 if v is None else v for v in values], dtype=wide)
    except OverflowError:
        raise OverflowError(f"{name}: an integer does not fit in {typ}") from None
    if typ == pa.int32():
        out = (data < -_INT32_MAX - 1) | (data > _INT32_MAX)
        if out.any():
            raise OverflowError(f"{name}: row {int(np.argmax(out))} does not fit in {typ}")
        data = data.astype(np.int32)
    return pa.Array.from_buffers(typ, n, [bitmap, pa.py_buffer(data)], null_count=nulls)


def one_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A chunked array as one array (an array as it is). pyarrow's own ``combine_chunks`` imports
    pandas for a chunked array of no chunks (a trace without communication events has some)."""
    if not isinstance(values, pa.ChunkedArray):
        return values
    return values.combine_chunks() if values.num_chunks else pa.nulls(0, values.type)


def to_numpy(values: pa.Array) -> np.ndarray:
    """A numeric Arrow array without nulls as a numpy view of its buffer (``to_numpy`` would
    import pandas)."""
    values = one_array(values)
    if values.null_count:
        raise TypeError(f"to_numpy takes numbers without nulls, not {values.type} with {values.null_count} nulls")
    return _data(values)


def filled(values: pa.Array, fill: int = 0) -> np.ndarray:
    """A numeric Arrow array as numpy, ``fill`` where null."""
    values = one_array(values)
    if not values.null_count:
        return _data(values)
    data = _data(values)
    return np.where(_bits(values.buffers()[0], values.offset, len(values)), data, fill).astype(data.dtype)


def _data(values: pa.Array) -> np.ndarray:
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise TypeError(f"expected numbers, not {values.type}")
    dtype = values.type.to_pandas_dtype()
    return np.frombuffer(values.buffers()[1], dtype=dtype)[values.offset:values.offset + len(values)]


def _bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little", count=offset + n)[offset:].astype(bool)


def to_bools(values: pa.Array) -> np.ndarray:
    """A boolean Arrow array as numpy (null as False), unpacked from its buffers
    (``to_numpy`` would import pandas)."""
    values = one_array(values)
    n, off = len(values), values.offset
    validity, data = values.buffers()[:2]
    out = _bits(data, off, n)
    if validity is not None and values.null_count:
        out &= _bits(validity, off, n)
    return out


def scalar(value: Any, typ: pa.DataType) -> pa.Scalar:
    """An Arrow scalar: compute functions given a plain Python value convert it with ``pa.scalar``,
    which imports pandas too."""
    return from_values([value], typ, "scalar")[0]


def table(columns: dict[str, pa.Array]) -> pa.Table:
    """A table of named arrays (``pa.table`` would look for pandas first)."""
    return pa.Table.from_arrays(list(columns.values()), names=list(columns))


def _validity(valid: np.ndarray | None) -> tuple[pa.Buffer | None, int]:
    if valid is None:
        return None, 0
    nulls = int(len(valid) - np.count_nonzero(valid))
    return (pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None), nulls
