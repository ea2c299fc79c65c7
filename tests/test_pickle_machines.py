"""The C pickle machine (tracekit.ingest.unpickle._pickle_machine) against the Python one (unpickle/build.py):
the same values and sharing, the same callback batches, the same errors naming the same byte, on
real snapshot layouts (tests/cuda_snapshot.py, every protocol, torch's C++ pickler) and on mangled
and malicious pickles; the reader choice; and no leak in the C machine."""

from __future__ import annotations

import pickle
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tracekit.ingest.unpickle import stream as pickle_stream  # the machines themselves: internals
from tracekit.ingest.common import IngestError

sys.path.insert(0, str(Path(__file__).parent))
from cuda_snapshot import cuda_snapshot  # noqa: E402
from test_memory_snapshot_stream import ENTRIES, FORBIDDEN, PLAIN, _Boom, jit_pickle, mangle, write  # noqa: E402


@pytest.fixture(scope="module")
def snapshot():
    return cuda_snapshot(ENTRIES, depth=24, seed=3)


def _canonical(obj: Any, seen: dict[int, int]) -> Any:
    """``obj`` as plain nested tuples in which a container met before is ("ref", its number): equal
    for two reads only if they built the same values with the same sharing."""
    t = type(obj)
    if t in (list, dict, tuple, set, frozenset, bytearray):
        if id(obj) in seen:
            return ("ref", seen[id(obj)])
        me = seen[id(obj)] = len(seen)
        if t is dict:
            return ("dict", me, [(_canonical(k, seen), _canonical(v, seen)) for k, v in obj.items()])
        if t in (set, frozenset):
            return (t.__name__, me, sorted(repr(x) for x in obj))
        if t is bytearray:
            return ("bytearray", me, bytes(obj))
        return (t.__name__, me, [_canonical(x, seen) for x in obj])
    return (t.__name__, obj.hex() if t is float else obj)


def _read_with(machine: str, path: Path, patterns: list[tuple], batch: int,
               monkeypatch: pytest.MonkeyPatch) -> tuple:
    """What one machine does with ``path``: ("ok", top, calls) or ("error", class, message, calls),
    with each callback call as (pattern, target list, items), all canonical together."""
    monkeypatch.setenv(pickle_stream.READER_ENV, machine)
    calls: list = []
    watch = {p: (lambda p: lambda lst, items: calls.append((p, lst, items)))(p) for p in patterns}
    try:
        top = pickle_stream.read(path, watch, batch)
    except Exception as e:  # noqa: BLE001 - compared between the machines
        return ("error", type(e), str(e), len(calls))
    seen: dict[int, int] = {}
    return ("ok", _canonical(top, seen), [(p, _canonical(lst, seen), _canonical(items, seen)) for p, lst, items in calls])


_BATCHES = (0, 1, 3, 1024)


def _same_on_both(path: Path, monkeypatch: pytest.MonkeyPatch, patterns: list[list[tuple]],
                  batches: tuple = _BATCHES) -> list[tuple]:
    outcomes = []
    for watch in patterns:
        for batch in batches:
            py = _read_with("python", path, watch, batch, monkeypatch)
            c = _read_with("native", path, watch, batch, monkeypatch)
            assert c == py, (watch, batch)
            outcomes.append(py)
    return outcomes


native_only = pytest.mark.skipif(not pickle_stream.AVAILABLE, reason="tracekit.ingest.unpickle._pickle_machine is not built")
SNAPSHOT_WATCHES = [[], [("device_traces", "*", "*"), ("segments", "*")], [("device_traces", "*")],
                    [("segments", "*", "blocks", "*")], [("*",)], [()]]


@native_only
@pytest.mark.parametrize("writer", ["pickle0", "pickle1", "pickle2", "pickle3", "pickle4", "pickle5", "jit2"])
def test_machines_agree_on_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    snap, _ = cuda_snapshot(300, depth=8, seed=2)
    data = jit_pickle(snap) if writer == "jit2" else pickle.dumps(snap, protocol=int(writer[-1]))
    outcomes = _same_on_both(write(tmp_path / "s.pickle", data), monkeypatch, SNAPSHOT_WATCHES)
    assert all(o[0] == "ok" for o in outcomes)
    _, _, calls = outcomes[len(_BATCHES)]  # watching the trace entries and segments, batch 0
    assert sum(len(items[2]) for p, _, items in calls if p[0] == "device_traces") == len(snap["device_traces"][0])


@native_only
@pytest.mark.parametrize("proto", range(6))
def test_machines_agree_on_every_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proto: int) -> None:
    data: dict = dict(PLAIN, nan=float("nan"), neg=-0.0, big=-2**200, empty=[[], {}, ()], text="\n'\"é\U0001f600")
    if proto < 4:
        for k in ("b", "s", "f"):
            del data[k]
    shared = [1, 2]
    data["shared"] = [shared, shared, {"x": shared}, (shared,)]
    path = write(tmp_path / "p.pkl", pickle.dumps(data, protocol=proto))
    outcomes = _same_on_both(path, monkeypatch, [[], [("a", "*"), ("one", "*", "*")], [("shared", "*")],
                                                 [("d", "nested", "*")], [("*",)], [()]])
    assert all(o[0] == "ok" for o in outcomes)


MALICIOUS = {**{name: b"\x80\x04}\x94(\x8c\x08segments\x94]" + op + b"eu." for name, op in FORBIDDEN.items()},
             "GLOBAL0": pickle.dumps({"segments": [_Boom()]}, protocol=0),
             "GLOBAL2": pickle.dumps({"segments": [_Boom()]}, protocol=2),
             "STACK_GLOBAL4": pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}, _Boom()]]}, protocol=4),
             "GLOBAL-unterminated": b"\x80\x02}(X\x08\x00\x00\x00segments]cos\nsys"}


@native_only
@pytest.mark.parametrize("name", sorted(MALICIOUS))
def test_machines_refuse_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    (outcome, *_), = _same_on_both(write(tmp_path / "x.pickle", MALICIOUS[name]), monkeypatch,
                                   [[("segments", "*")]], batches=(1,))
    assert outcome == "error"


@native_only
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(["truncate", "overwrite", "delete", "insert"]), pos=st.floats(0.0, 1.0),
       blob=st.binary(min_size=1, max_size=6), writer=st.sampled_from(["pickle0", "pickle2", "pickle4", "jit2"]))
@example(how="insert", pos=0.5, blob=b"0", writer="pickle4")  # a POP where a watched list's items go
def test_machines_fail_alike_on_mangled_pickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str,
                                                pos: float, blob: bytes, writer: str) -> None:
    """Same error class and message (the byte too), and the same callbacks before it."""
    snap, _ = cuda_snapshot(30, depth=4, seed=1)
    data = jit_pickle(snap) if writer == "jit2" else pickle.dumps(snap, protocol=int(writer[-1]))
    path = write(tmp_path / "m.pickle", mangle(data, how, pos, blob))
    _same_on_both(path, monkeypatch, [[("device_traces", "*", "*"), ("segments", "*")]], batches=(2,))


def test_reader_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "p.pickle", pickle.dumps({"segments": []}))
    monkeypatch.delenv(pickle_stream.READER_ENV, raising=False)
    assert pickle_stream.machine() == ("native" if pickle_stream.AVAILABLE else "python")
    monkeypatch.setenv(pickle_stream.READER_ENV, "rust")
    with pytest.raises(IngestError, match="TRACEKIT_PICKLE_READER='rust': expected 'native' or 'python'"):
        pickle_stream.read(path, {})
    monkeypatch.setenv(pickle_stream.READER_ENV, " Python ")
    assert pickle_stream.read(path, {}) == {"segments": []}
    monkeypatch.setenv(pickle_stream.READER_ENV, "native")
    monkeypatch.setattr(pickle_stream, "AVAILABLE", False)
    with pytest.raises(IngestError, match="native, but tracekit.ingest.unpickle._pickle_machine is not built"):
        pickle_stream.read(path, {})


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@native_only
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_native_machine_leaks_nothing(snapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 reads of a snapshot (and of a truncated one, and with a failing callback): no Python
    object and no memory left behind."""
    monkeypatch.setenv(pickle_stream.READER_ENV, "native")
    snap, _ = snapshot
    data = pickle.dumps(snap, protocol=4)
    good, bad = write(tmp_path / "s.pickle", data), write(tmp_path / "t.pickle", data[: len(data) * 2 // 3])
    got = []

    def once() -> None:
        top = pickle_stream.read(good, {("device_traces", "*", "*"): lambda lst, items: got.append(len(items))})
        assert len(top["segments"]) == len(snap["segments"])
        with pytest.raises(pickle.UnpicklingError):
            pickle_stream.read(bad, {("device_traces", "*", "*"): lambda lst, items: None})
        with pytest.raises(ZeroDivisionError):
            pickle_stream.read(good, {("device_traces", "*", "*"): lambda lst, items: 1 / 0})

    once()
    blocks, rss = sys.getallocatedblocks(), _rss_kb()
    for _ in range(20):
        once()
    got.clear()
    # a leak of one object per trace entry would be 20 * 6000 blocks; of the memo, MBs
    assert sys.getallocatedblocks() - blocks < 500
    assert _rss_kb() - rss < 8 << 10
    if hasattr(sys, "gettotalrefcount"):  # a debug build of Python
        before = sys.gettotalrefcount()
        once()
        assert sys.gettotalrefcount() - before < 100


@native_only
def test_machines_name_the_same_byte_for_a_slot_fetched_before_it_is_set(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python scan checks fetched slots in bulk (every 2**18 fetches, and at STOP), so a fetch
    of a slot not set yet is reported there, or by the build at the fetch; the C machine too."""
    names = [f"s{i}" for i in range(300)]
    data = bytearray(pickle.dumps({"segments": names + [names[299]] * 300_000, "z": [names[299]] * 10}, protocol=4))
    ref = struct.pack("<I", 302)  # slot of names[299] (after the dict, its key and the list)
    first, last = data.index(b"j" + ref), data.rindex(b"j" + ref)
    errors = []
    for at in (first, first + 5 * 270_000, last):  # a bulk check mid-file, the next, the one at STOP
        for slot in (303, 10**6):  # set later (the build's KeyError if no bulk check comes first), never
            bad = bytearray(data)
            bad[at + 1:at + 5] = struct.pack("<I", slot)
            path = write(tmp_path / f"{at}-{slot}.pickle", bytes(bad))
            (outcome, *rest), = _same_on_both(path, monkeypatch, [[("segments", "*")]], batches=(1024,))
            errors += [rest[1]] if outcome == "error" else []
    assert len(errors) == 5 and sum("(KeyError: 303 at byte" in e for e in errors) == 1
