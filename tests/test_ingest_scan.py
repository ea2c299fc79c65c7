"""The native Kineto scanner (tracekit/ingest/_kineto_scan.c) against references that nobody wrote
for it: DuckDB's JSON reader (same scratch table, same store), Python's json module (same fields
on arbitrary and mangled input), and itself fed in every possible split."""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
import threading
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracekit.ingest import limits
from tracekit.ingest import kineto, kineto_scan
from tracekit.ingest.common import IngestError
from tracekit.ingest.pipeline import ingest

ROOT = Path(__file__).resolve().parents[1]
HTA = ROOT / "tests" / "fixtures" / "real" / "hta"
REAL = sorted(HTA.glob("*/*.json.gz"))
SAMPLE = sorted((ROOT / "sample_traces" / "slow_rank_8" / "traces").glob("rank*.json.gz"))[:2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gen_traces import write_rank  # noqa: E402

Scanner = kineto_scan.Scanner
TEXT, REAL_KIND, OBJECT = kineto_scan.TEXT, kineto_scan.REAL, kineto_scan.OBJECT
# a small field set exercising every kind: top-level text and real, an object with both
FIELDS = [(-1, "name", TEXT), (-1, "ts", REAL_KIND), (-1, "args", OBJECT), (2, "k", TEXT), (2, "v", REAL_KIND),
          (-1, "ph", TEXT)]


def test_scanner_is_built() -> None:
    """CI builds the extension: without it ingest silently takes the 4x slower DuckDB reader."""
    assert kineto_scan.AVAILABLE, "tracekit.ingest._kineto_scan was not built (no C compiler?)"


# ---- the scanner against Python's json module ----

def _scan(text: bytes, fields=FIELDS, flt=None, pieces: list[int] | None = None) -> list[tuple]:
    """Rows (one tuple of Python values per kept event) from feeding ``text`` whole or in pieces."""
    sc = Scanner(fields, flt)
    pending = b""
    cuts = pieces or []
    at = 0
    for n in cuts:
        pending += text[at:at + n]
        at += n
        pending = pending[sc.feed(pending, False):]
    pending += text[at:]
    used = sc.feed(pending, True)
    assert used == len(pending)
    return _rows(sc, fields)


def _rows(sc, fields) -> list[tuple]:
    n, cols = sc.take()
    out = []
    vals = []
    for (parent, key, kind), (valid, offs, data, _nulls) in zip(fields, cols):
        ok = [True] * n if valid is None else [bool(valid[i >> 3] >> (i & 7) & 1) for i in range(n)]
        if kind == TEXT:
            o = memoryview(offs).cast("i")
            col = [data[o[i]:o[i + 1]].decode() if ok[i] else None for i in range(n)]
        elif kind == REAL_KIND:
            d = memoryview(data).cast("d")
            col = [d[i] if ok[i] else None for i in range(n)]
        else:
            col = ok
        vals.append(col)
    for i in range(n):
        out.append(tuple(c[i] for c in vals))
    return out


names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), names)
nested = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(names, c, max_size=3),
                      max_leaves=6)
numbers = st.one_of(st.none(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False))
events = st.lists(st.fixed_dictionaries(
    {"name": st.one_of(st.none(), names, numbers, st.lists(st.integers(), max_size=3)),
     "ph": st.sampled_from(["X", "i", "s"])},
    optional={"ts": numbers,
              "args": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
                  "k": st.one_of(names, st.booleans(), numbers, st.lists(nested, max_size=2),
                                 st.dictionaries(names, nested, max_size=2)),
                  "v": numbers, "other": nested})),
              "junk": nested}), max_size=8)


WANTED = {"top": ("name", "ts", "args", "ph"), "args": ("k", "v")}
NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


class Src(str):
    """A JSON number as its source text (json.loads parse hooks)."""


class Obj(dict):
    """A JSON object that remembers which keys it repeated (json keeps the last)."""

    def __init__(self, pairs: list) -> None:
        super().__init__(pairs)
        keys = [k for k, _ in pairs]
        self.repeated = {k for k in keys if keys.count(k) > 1}


class Rejected(Exception):
    """The documented rules reject the text."""


def expected(text: bytes) -> list[tuple]:
    """What the scanner must return for ``text`` by its documented rules, computed with Python's
    json module; raises Rejected where strict JSON or those rules reject it."""
    def no_constant(c: str):
        raise Rejected(f"{c} is not JSON")
    try:
        s = text.decode("utf-8")
        evs = json.loads(s, parse_int=Src, parse_float=Src, parse_constant=no_constant, object_pairs_hook=Obj)
        plain = json.loads(s, parse_constant=no_constant)
        json.dumps(plain, ensure_ascii=False).encode("utf-8")  # \\u escapes of lone surrogates
    except (ValueError, UnicodeError, RecursionError) as e:
        raise Rejected(str(e)) from None
    if not isinstance(evs, list) or not all(isinstance(e, dict) for e in evs):
        raise Rejected("not an array of objects")
    rows = []
    for e, pe in zip(evs, plain):
        if e.repeated & set(WANTED["top"]):
            raise Rejected("repeated key")
        args, pargs = e.get("args"), pe.get("args")
        if args is not None and not isinstance(args, dict):
            raise Rejected("args is not an object")
        if isinstance(args, dict) and args.repeated & set(WANTED["args"]):
            raise Rejected("repeated key in args")
        a, pa_ = (args, pargs) if isinstance(args, dict) else ({}, {})
        rows.append((_as_text(e.get("name"), pe.get("name")), _as_real(e.get("ts")), isinstance(args, dict),
                     _as_text(a.get("k"), pa_.get("k")), _as_real(a.get("v")), _as_text(e.get("ph"), pe.get("ph"))))
    return rows


def _as_text(v, plain):
    """A text field: strings as they are, numbers and literals as written, containers as JSON
    (compared by value: the scanner keeps their source text minus whitespace)."""
    if v is None:
        return None
    if isinstance(v, Src):
        return str(v)
    if isinstance(v, str):
        return ("str", v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return ("json", plain)


def _as_real(v):
    if v is None:
        return None
    if isinstance(v, Src):
        return float(v)
    if isinstance(v, str) and NUMBER.fullmatch(v):
        return float(v)
    raise Rejected("not a number where a number belongs")


def _same(ours: list[tuple], want: list[tuple]) -> bool:
    if len(ours) != len(want):
        return False
    for ro, rw in zip(ours, want):
        for o, w in zip(ro, rw):
            if isinstance(w, tuple) and w[0] == "str":
                w = w[1]
            elif isinstance(w, tuple) and w[0] == "json":
                if o is None or json.loads(o) != w[1] or any(c in o for c in "\n\t"):
                    return False
                continue
            if o != w:
                return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(evs=events, indent=st.sampled_from([None, 0, 2, 4]), ascii_only=st.booleans(), data=st.data())
def test_scanner_matches_json_on_any_events(evs: list, indent, ascii_only: bool, data) -> None:
    """Any valid array, pretty-printed or not, escaped or not, whole or cut into random pieces:
    the scanner's fields are what Python's json module reads."""
    text = json.dumps(evs, indent=indent, ensure_ascii=ascii_only).encode()
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text))), max_size=6))
    assert _same(_scan(text, pieces=cuts), expected(text))


def test_scanner_keeps_number_text_and_filters() -> None:
    text = (b'[{"ph": "X", "name": 12.50, "ts": "7.25", "args": {"k": -0.0e+1, "v": "3"}},'
            b' {"ph": "i", "name": "dropped"}, {"name": "no ph"},'
            b' {"ph": "X", "name": true, "ts": 1e400, "args": null}]')
    rows = _scan(text, flt=(5, "X"))
    assert rows == [("12.50", 7.25, True, "-0.0e+1", 3.0, "X"), ("true", math.inf, False, None, None, "X")]


def test_scanner_rounds_like_python() -> None:
    """Numbers beyond the exact fast path (more than 2^53 in the digits, large exponents) go
    through Python's correctly rounded parser."""
    nums = ["1716312345678.123", "9007199254740993", "0.1", "123456789012345678901234567890",
            "1e-320", "2.2250738585072014e-308", "-1380124.608", "4.9e-324", "1.7976931348623157e308"]
    text = ("[" + ",".join(f'{{"ts": {n}}}' for n in nums) + "]").encode()
    assert [r[1] for r in _scan(text)] == [float(n) for n in nums]


@pytest.mark.parametrize("text, message", [
    (b'[{"ts": 1}', "truncated"),
    (b'[{"ts": 1}, ', "truncated"),
    (b'[{"ts": 1}]]', "after the end of the array"),
    (b'[1]', "not an object"),
    (b'[{"ts": 01}]', "expected ','"),
    (b'[{"ts": 1.}]', "no digit after"),
    (b'[{"ts": 1e}]', "no digit in the exponent"),
    (b'[{"ts": "abc"}]', "not a number"),
    (b'[{"ts": []}]', "expected a number"),
    (b'[{"name": "a\\qb"}]', "invalid escape"),
    (b'[{"name": "\\ud800"}]', "unpaired high surrogate"),
    (b'[{"name": "\\udc00"}]', "lone low surrogate"),
    (b'[{"name": "a\x01b"}]', "control character"),
    (b'[{"name": "\xff"}]', "invalid UTF-8"),
    (b'[{"name": "\xed\xa0\x80"}]', "invalid UTF-8"),
    (b'[{"name": "a", "name": "b"}]', "duplicate key"),
    (b'[{"x": tru}]', "invalid literal"),
    (b'[{"x": NaN}]', "unexpected character"),
    (b'[{"x": [1, 2}]', "expected ',' or ']'"),
    (b'[{"x" 1}]', "expected ':'"),
    (b'[{"args": 3}]', "expected an object"),
    (b'[{"x": ' + b"[" * 600 + b"]" * 600 + b"}]", "nesting too deep"),
])
def test_scanner_rejects_malformed_input(text: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        _scan(text)
    assert "byte" in str(e.value)
    sc = Scanner(FIELDS)
    with pytest.raises(ValueError):
        sc.feed(text, True)
    with pytest.raises(ValueError, match="failed earlier"):  # a failed scanner refuses to go on
        sc.feed(b" ", True)


MANGLE_BASE = json.dumps([{"name": "a\u00e9\\\"", "ph": "X", "ts": 12.5, "args": {"k": [1, {"z": None}], "v": -3e2}},
                          {"name": "nccl:x", "ts": 1, "args": {"other": "\ud83d\ude00", "k": "17"}}], indent=1).encode()


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_scanner_accepts_what_json_accepts_on_mangled_input(data) -> None:
    """Byte edits to a valid array: the scanner rejects exactly the texts that strict JSON (or its
    documented rules) rejects, and reads the rest as Python's json module does."""
    text = bytearray(MANGLE_BASE)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text) - 1))
        op = data.draw(st.sampled_from(["replace", "delete", "insert"]))
        b = data.draw(st.sampled_from(list(b'{}[]",:.-+eE0123456789 \\tnulfrsaXk\x00\x80\xc3\xff')))
        if op == "replace":
            text[i] = b
        elif op == "delete":
            del text[i]
        else:
            text.insert(i, b)
    text = bytes(text)
    try:
        want = expected(text)
    except Rejected:
        with pytest.raises(ValueError):
            _scan(text)
        return
    assert _same(_scan(text), want)


def test_scanner_every_split_point() -> None:
    """A piece may end anywhere (inside an escape, a UTF-8 sequence, a number, a literal)."""
    text = json.dumps([{"name": "x\u00e9\U0001F600\\\"\n\u0001", "ts": -1.25e-3, "ph": "X",
                        "args": {"k": [True, False, None, {"a": "b c"}], "v": 7, "w": "\ud7ff"}},
                       {"name": None, "ts": 3, "args": {}}], indent=2).encode()
    whole = _scan(text)
    assert len(whole) == 2
    for cut in range(1, len(text)):
        assert _scan(text, pieces=[cut]) == whole, cut


def test_scanner_threads_in_parallel() -> None:
    """feed releases the GIL: scanners on several threads give the same rows as one at a time."""
    text = json.dumps([{"name": f"n{i}", "ts": i / 3, "args": {"k": "v" * (i % 7), "v": i}} for i in range(20000)]).encode()
    want = _scan(text)
    got: list = [None] * 4

    def work(i: int) -> None:
        got[i] = _scan(text, pieces=[4096] * 50)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(g == want for g in got)


def test_scanner_field_spec_is_checked() -> None:
    with pytest.raises(ValueError, match="parent"):
        Scanner([(0, "x", TEXT)])
    with pytest.raises(ValueError, match="twice"):
        Scanner([(-1, "x", TEXT), (-1, "x", REAL_KIND)])
    with pytest.raises(ValueError, match="filter"):
        Scanner([(-1, "x", REAL_KIND)], (0, "X"))


# ---- the native reader against DuckDB's reader, in the store ----

def _raw(path: Path, reader: str, monkeypatch) -> list[tuple]:
    """The reader's record batches, as sorted rows."""
    monkeypatch.setenv(kineto.READER_ENV, reader)
    con = duckdb.connect()
    import hashlib
    batches: list[pa.RecordBatch] = []
    kineto.read_events(con, path, hashlib.sha256(), batches.append)
    assert all(b.schema == kineto_scan.schema(kineto.COLUMNS) for b in batches)
    con.register("batches", pa.Table.from_batches(batches))
    return con.execute("SELECT * FROM batches ORDER BY ALL").fetchall()


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """An NCCL-flavour trace in the profiler's own layout (benchmarks/gen_traces.py), gzipped."""
    d = tmp_path_factory.mktemp("gen")
    write_rank(d / "rank3.json", 3, 4, 6000)
    (d / "rank3.json.gz").write_bytes(gzip.compress((d / "rank3.json").read_bytes()))
    return d


@pytest.mark.parametrize("which", [p.name for p in REAL] + ["generated", "generated.gz"] +
                         [f"sample/{p.name}" for p in SAMPLE])
def test_native_reader_equals_duckdb_reader(which: str, generated: Path, monkeypatch) -> None:
    path = {p.name: p for p in REAL}.get(which) or {"generated": generated / "rank3.json",
                                                    "generated.gz": generated / "rank3.json.gz"}.get(which)
    if path is None:
        path = {f"sample/{p.name}": p for p in SAMPLE}[which]
    native, ref = _raw(path, "native", monkeypatch), _raw(path, "duckdb", monkeypatch)
    assert len(native) > 1000 and native == ref


def test_stores_are_equal_by_either_reader(generated: Path, tmp_path: Path, monkeypatch) -> None:
    files = [generated / "rank3.json"] + REAL[:1]
    stores = {}
    for reader in ("native", "duckdb"):
        monkeypatch.setenv(kineto.READER_ENV, reader)
        rep = ingest(files, tmp_path / f"{reader}.duckdb", run_id="r")
        assert not rep.failed
        con = duckdb.connect(str(tmp_path / f"{reader}.duckdb"), read_only=True)
        stores[reader] = {t: con.execute(f"SELECT * EXCLUDE (run_id) FROM {t} ORDER BY ALL").fetchall()
                          for t in ("events", "steps", "collectives", "p2p", "groups")}
        con.close()
    assert stores["native"]["events"] and stores["native"]["collectives"]
    assert stores["native"] == stores["duckdb"]


def test_reader_choice_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(kineto.READER_ENV, "simdjson")
    with pytest.raises(IngestError, match="expected 'native' or 'duckdb'"):
        kineto.reader()
    monkeypatch.setenv(kineto.READER_ENV, "")
    assert kineto.reader() == ("native" if kineto_scan.AVAILABLE else "duckdb")


def test_event_size_limit_and_truncation_name_the_file(tmp_path: Path) -> None:
    """An event still open after max_event_bytes (say, a string that never ends) stops the file
    instead of growing the buffer without bound; a cut file names itself."""
    big = tmp_path / "big.json"
    sink = kineto_scan.EventSink(big, kineto.COLUMNS, lambda b: None, max_event_bytes=1 << 20)
    with pytest.raises(limits.LimitExceeded, match=r"big\.json: event 0 is still incomplete after [0-9,]+ bytes: "
                                                   r"over the limit max_event_bytes = 1 MiB"):
        sink.write(b'[{"ph": "X", "name": "' + b"a" * (5 << 20))
    cut = tmp_path / "cut.json"
    cut.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1}, {"ph": "X", "na')
    rep = ingest([cut], tmp_path / "s.duckdb")
    assert rep.failed and "cut.json" in rep.failed[0].error
