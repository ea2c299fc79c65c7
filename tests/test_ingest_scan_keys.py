"""The scanner's predicted keys (tracekit/ingest/_kineto_scan.c, ``members``): a key that follows
the same key as in an earlier object is matched by its bytes and closing quote alone. Held to
Python's json module, as tests/test_ingest_scan.py holds the rest of the scanner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from test_ingest_scan import Rejected, _same, _scan, expected  # noqa: E402

# Keys the scanner may predict from the events before (a key that follows the same key as last
# time is matched by its bytes and closing quote alone): wanted keys, keys that start or end like
# them, spellings with escapes, and keys longer than it remembers.
_KEYS = ["name", "nam", "names", "ts", "t", "tsx", "ph", "args", "n\\u0061me", "t\\u0073", "k", "v", "kk", "o",
         "x" * 45, "x" * 39, "\u00e9t\u00e9"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=6), min_size=1, max_size=4),
       order=st.lists(st.integers(0, 3), min_size=8, max_size=40), indent=st.sampled_from([None, 2]),
       data=st.data())
def test_predicted_keys_read_as_json_does(shapes: list, order: list, indent, data) -> None:
    """Events of a few shapes (key orders) repeated, as a trace's are: whichever key the scanner
    predicts, its fields and its errors (a repeated key, an escaped spelling of a wanted key, a
    key that only starts like a wanted one) are those of Python's json module, whole or in pieces."""
    def value(key: str, i: int):
        if key in ("args", "o"):
            inner = data.draw(st.lists(st.sampled_from(_KEYS), max_size=4))
            return "{" + ", ".join(f'"{k}": {i}' for k in inner) + "}"
        return json.dumps(f"v{i}" if key in ("name", "ph", "k", "nam") else i / 4)
    sep = ",\n  " if indent else ", "
    evs = []
    for i, o in enumerate(order):
        keys = shapes[o % len(shapes)]
        evs.append("{" + sep.join(f'"{k}": {value(k, i)}' for k in keys) + "}")
    text = ("[" + sep.join(evs) + "]").encode()
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text))), max_size=4))
    try:
        want = expected(text)
    except Rejected:
        with pytest.raises(ValueError):
            _scan(text, pieces=cuts)
        return
    assert _same(_scan(text, pieces=cuts), want)


def test_a_predicted_key_is_matched_with_its_closing_quote_as_written() -> None:
    """A key whose text has an escaped quote, then the same bytes unescaped where that key is
    predicted: the raw bytes are not the key it remembers (they end the key early), so the array
    is rejected; an unescaped spelling of a key remembered escaped is read as the key it names."""
    pad = ', "o": "' + "p" * 64 + '"'
    twice = '{"a\\"b": 1, "name": "x"' + pad + '}, ' * 1
    bad = ("[" + twice * 2 + '{"a"b": 1, "name": "y"' + pad + "}]").encode()
    with pytest.raises(ValueError):
        _scan(bad)
    good = ("[" + twice * 2 + '{"a\\"b": 1, "n\\u0061me": "y"' + pad + '}, {"a\\"b": 2, "name": "z"' + pad + "}]").encode()
    assert [r[0] for r in _scan(good)] == ["x", "x", "y", "z"]
