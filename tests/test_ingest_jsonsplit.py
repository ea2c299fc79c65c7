"""The streaming split of a Chrome trace into header and event array agrees with json.loads."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracekit.ingest import jsonsplit
from tracekit.ingest.jsonsplit import TraceFormatError, split_trace

NASTY = ['quote " and ] and }', "back\\slash\\", 'esc \\" ]} ,{ "traceEvents": [', "{lambda()#1}, {lambda()#2}"]


def _doc(events: list[dict], order: str, indent: int | None) -> bytes:
    meta = {"schemaVersion": 1, "distributedInfo": {"rank": 3, "note": NASTY[2]}, "INFO": NASTY,
            "baseTimeNanoseconds": 5}
    keys = list(meta)
    if order == "first":
        doc = {"traceEvents": events, **meta}
    elif order == "last":
        doc = {**meta, "traceEvents": events}
    else:
        doc = {k: meta[k] for k in keys[:2]} | {"traceEvents": events} | {k: meta[k] for k in keys[2:]}
    return json.dumps(doc, indent=indent).encode()


def _split(tmp_path: Path, data: bytes, gz: bool) -> tuple[dict, list]:
    f = tmp_path / ("t.json.gz" if gz else "t.json")
    f.write_bytes(gzip.compress(data) if gz else data)
    with open(tmp_path / "events.json", "w+b") as out:  # a real file, as ingest writes
        meta = split_trace(f, out)
    return meta, json.loads((tmp_path / "events.json").read_bytes())


@pytest.mark.parametrize("order", ["first", "middle", "last"])
@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("gz", [False, True])
def test_split_matches_json(tmp_path: Path, order: str, indent: int | None, gz: bool) -> None:
    events = [{"ph": "X", "name": n, "ts": i, "args": {"l": [[1], {"a": n}]}} for i, n in enumerate(NASTY * 3)]
    data = _doc(events, order, indent)
    meta, evs = _split(tmp_path, data, gz)
    full = json.loads(data)
    assert evs == full.pop("traceEvents")
    assert {k: v for k, v in meta.items() if k != "traceEvents"} == full


def test_split_handles_arrays_larger_than_the_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonsplit, "TAIL_WINDOW", 256)
    monkeypatch.setattr(jsonsplit, "CHUNK", 100)
    events = [{"ph": "X", "name": f"op{i}", "args": {}} for i in range(200)]
    meta, evs = _split(tmp_path, _doc(events, "middle", 2), gz=True)
    assert len(evs) == 200 and meta["distributedInfo"]["rank"] == 3


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 400))
def test_truncation_is_detected(tmp_path_factory: pytest.TempPathFactory, cut: int) -> None:
    tmp = tmp_path_factory.mktemp("cut")
    data = _doc([{"ph": "X", "name": n} for n in NASTY], "middle", 2)
    if cut >= len(data) - 1:
        cut = len(data) - 2
    f = tmp / "t.json"
    f.write_bytes(data[:-cut])
    with pytest.raises(TraceFormatError, match=str(f)):
        split_trace(f, io.BytesIO())


def _inflaters() -> list:
    import zlib

    out = [pytest.param(zlib, id="zlib")]
    try:
        from isal import isal_zlib
    except ImportError:
        return out
    return out + [pytest.param(isal_zlib, id="isal")]


@pytest.mark.parametrize("inflater", _inflaters())
def test_each_inflater_reads_gzip_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inflater) -> None:
    """ISA-L's inflate where installed, zlib's otherwise: the same events from a stream of two
    gzip members cut into small blocks, and one line naming the file for a corrupt or cut one."""
    monkeypatch.setattr(jsonsplit, "inflater", inflater)
    monkeypatch.setattr(jsonsplit, "CHUNK", 333)
    events = [{"ph": "X", "name": f"{NASTY[i % 4]} {i}", "ts": i} for i in range(2000)]
    data = _doc(events, "middle", 2)
    f = tmp_path / "t.json.gz"
    half = len(data) // 2
    f.write_bytes(gzip.compress(data[:half]) + gzip.compress(data[half:]))  # concatenated members
    with open(tmp_path / "events.json", "w+b") as out:
        meta = split_trace(f, out)
    assert json.loads((tmp_path / "events.json").read_bytes()) == events and meta["baseTimeNanoseconds"] == 5
    packed = gzip.compress(data)
    for bad in (packed[:len(packed) // 2], packed[:40] + bytes(200) + packed[240:]):
        f.write_bytes(bad)
        with pytest.raises(TraceFormatError, match=f"{f}: (corrupt or truncated|truncated)"):
            split_trace(f, io.BytesIO())
