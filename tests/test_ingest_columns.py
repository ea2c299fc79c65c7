"""Arrow columns built from buffers (tracekit.ingest.columns) hold exactly what pyarrow's own
conversion holds, and refuse what does not fit with an error naming the column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracekit.ingest import columns
from tracekit.ingest.common import table_from_rows

VALUES = {
    pa.int32(): st.integers(-(1 << 31), (1 << 31) - 1),
    pa.int64(): st.integers(-(1 << 63), (1 << 63) - 1),
    pa.float64(): st.floats(allow_nan=False) | st.integers(-(1 << 53), 1 << 53),
    pa.bool_(): st.booleans(),
    pa.string(): st.text(st.characters(blacklist_categories=("Cs",))),  # no lone surrogates
}


@pytest.mark.parametrize("typ", list(VALUES), ids=str)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_from_values_equals_pyarrow(typ: pa.DataType, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.none() | VALUES[typ], max_size=70))
    got = columns.from_values(values, typ)
    got.validate(full=True)
    assert got.equals(pa.array(values, typ))


@pytest.mark.parametrize(("values", "typ", "error", "says"), [
    ([1, 2 ** 31], pa.int32(), OverflowError, "row 1 does not fit in int32"),
    ([2 ** 63], pa.int64(), OverflowError, "does not fit in int64"),
    ([None, 1.5], pa.int64(), TypeError, "row 1 holds float 1.5"),
    ([True], pa.int64(), TypeError, "row 0 holds bool True"),  # numpy would store 1
    (["7"], pa.float64(), TypeError, "holds str '7'"),
    ([1], pa.bool_(), TypeError, "holds int 1"),
    (["ok", "\ud800"], pa.string(), TypeError, "not valid Unicode"),
    ([[1, 2]], pa.string(), TypeError, "holds list"),
])
def test_from_values_refuses_what_does_not_fit(values: list, typ: pa.DataType, error: type, says: str) -> None:
    with pytest.raises(error, match=says) as e:
        columns.from_values(values, typ, "fr_entries.record_id")
    assert str(e.value).startswith("fr_entries.record_id: ")


def test_from_numpy_shares_the_buffer_and_marks_nulls() -> None:
    values = np.arange(10, dtype=np.int64) * 3
    arr = columns.from_numpy(values, valid=values % 2 == 0)
    assert arr.type == pa.int64() and arr.null_count == 5
    assert arr.to_pylist() == [v if v % 2 == 0 else None for v in range(0, 30, 3)]
    values[0] = 99  # no copy: Arrow reads the numpy memory
    assert arr[0].as_py() == 99
    assert columns.from_numpy(np.array([1.5, 2.5])).to_pylist() == [1.5, 2.5]
    with pytest.raises(TypeError, match="not bool"):  # Arrow booleans are bits, numpy's are bytes
        columns.from_numpy(np.array([True, False]))


def test_table_from_rows_follows_the_store_schema() -> None:
    rows = [{"pg_name": "0", "seq": 3, "op": "all_reduce", "start_ns": 10, "end_ns": 20, "nbytes": None,
             "dtype": "float", "source": "fr", "ignored_key": object()}, {"pg_name": "1", "seq": 4}]
    t = table_from_rows("collectives", rows)
    assert t.column_names == ["pg_name", "seq", "op", "start_ns", "end_ns", "nbytes", "dtype", "step", "source"]
    assert t.schema.field("step").type == pa.int32()
    assert t.to_pylist()[1] == {"pg_name": "1", "seq": 4, "op": None, "start_ns": None, "end_ns": None,
                                "nbytes": None, "dtype": None, "step": None, "source": None}
    with pytest.raises(TypeError, match=r"collectives\.seq: row 1 holds str"):
        table_from_rows("collectives", [{"seq": 1}, {"seq": "2"}])


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.none() | st.booleans(), max_size=70), start=st.integers(0, 9))
def test_bools_round_trip_through_bits_at_any_offset(values: list, start: int) -> None:
    """from_bools packs, to_bools unpacks (null as False), also from a slice whose bits start
    mid-byte, as Arrow's filters and slices hand them over."""
    valid = np.array([v is not None for v in values], dtype=bool)
    arr = columns.from_bools(np.array([bool(v) for v in values], dtype=bool), valid)
    arr.validate(full=True)
    assert arr.to_pylist() == values
    part = arr.slice(min(start, len(values)))
    assert columns.to_bools(part).tolist() == [v is True for v in part.to_pylist()]


def test_to_numpy_views_numbers_without_nulls() -> None:
    arr = columns.from_values([5, 6, 7, 8], pa.int64()).slice(1, 2)
    assert columns.to_numpy(arr).tolist() == [6, 7]
    assert columns.to_numpy(pa.chunked_array([arr, arr])).tolist() == [6, 7, 6, 7]
    with pytest.raises(TypeError, match="without nulls"):
        columns.to_numpy(columns.from_values([1, None], pa.int64()))
    with pytest.raises(TypeError, match="numbers"):
        columns.to_numpy(columns.from_values(["a"], pa.string()))


@given(values=st.lists(st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)), max_size=40), start=st.integers(0, 20),
       fill=st.integers(-5, 5))
def test_filled_puts_the_fill_where_null(values: list[int | None], start: int, fill: int) -> None:
    part = columns.from_values(values, pa.int32()).slice(min(start, len(values)))
    got = columns.filled(part, fill)
    assert got.dtype == np.int32 and got.tolist() == [fill if v is None else v for v in part.to_pylist()]


def test_scalar_has_the_column_type() -> None:
    s = columns.scalar(1000, pa.int64())
    assert isinstance(s, pa.Scalar) and s.type == pa.int64() and s.as_py() == 1000
