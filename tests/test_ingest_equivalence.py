"""The columnar Kineto path (DuckDB SQL) agrees row for row with the documented rules applied in
plain Python (json.load, one event at a time) on the real HTA traces."""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter
from pathlib import Path

import pytest

import tracekit
from tracekit.ingest.pipeline import ingest

HTA = Path(__file__).resolve().parent / "fixtures" / "real" / "hta"
FILES = {("single_rank_nccl", 0): "single_rank_nccl/nccl_data.json.gz",
         ("two_rank_train", 0): "two_rank_train/sampled_rank-0.json.gz",
         ("two_rank_train", 1): "two_rank_train/sampled_rank-1.json.gz"}
# the store's event kinds by Chrome-trace category; GPU events take the step of their launch
KINDS = {"cpu_op": "cpu_op", "user_annotation": "user_annotation", "gpu_user_annotation": "gpu_annotation",
         "kernel": "kernel", "cuda_runtime": "runtime", "cuda_driver": "runtime", "gpu_memcpy": "memcpy",
         "gpu_memset": "memset", "python_function": "python"}
GPU_KINDS = {"kernel", "memcpy", "memset", "gpu_annotation"}
# Communication by name, from FORMATS.md section 1 (not from tracekit.classify): NCCL kernels of
# both generations, record_param_comms, gloo/nccl/c10d spans, and the trainer's tk.comm spans.
NCCL_KERNEL_PREFIXES = ("ncclKernel_", "ncclDevKernel_")
COMM_PREFIXES = NCCL_KERNEL_PREFIXES + ("gloo:", "nccl:", "c10d::", "tk.comm ")
# record_param_comms's 'Collective name' spellings in these samples, in the store's vocabulary.
OP_OF_COLLECTIVE_NAME = {"allreduce": "all_reduce", "broadcast": "broadcast"}


def _is_comm(name: str) -> bool:
    return name.startswith(COMM_PREFIXES) or name == "record_param_comms"


def _ns(us: float) -> int:
    whole = math.floor(us)
    return int(whole) * 1000 + round((us - whole) * 1000)


def reference_events(doc: dict) -> Counter:
    """(ts_ns, dur_ns, kind, name, tid, step, correlation, is_comm) of every X event, by the rules
    in tracekit/ingest/kineto.py's docstring, one Python object at a time."""
    base = doc.get("baseTimeNanoseconds") or 0
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    steps = []
    for e in xs:
        if e.get("cat") in ("cpu_op", "user_annotation") and e["name"].startswith("ProfilerStep#"):
            steps.append((int(e["name"].split("#")[1]), _ns(e["ts"]), _ns(e["ts"]) + round(e.get("dur", 0) * 1000)))
    spans: dict[int, tuple[int, int]] = {}
    for s, a, b in steps:
        lo, hi = spans.get(s, (a, b))
        spans[s] = (min(lo, a), max(hi, b))

    def by_time(ts: int) -> int | None:
        for s, (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0]):
            if a <= ts < b:
                return s
        return None

    launch: dict[int, int] = {}
    for e in xs:
        corr = (e.get("args") or {}).get("correlation")
        if KINDS.get(e["cat"]) == "runtime" and corr is not None:
            s = by_time(_ns(e["ts"]))
            if s is not None:
                launch[corr] = min(s, launch.get(corr, s))
    out: Counter = Counter()
    for e in xs:
        kind = KINDS.get(e["cat"], e["cat"])
        ts = _ns(e["ts"])
        corr = (e.get("args") or {}).get("correlation")
        step = launch.get(corr) if kind in GPU_KINDS and corr in launch else by_time(ts)
        out[(base + ts, round((e.get("dur") or 0) * 1000), kind, e["name"], str(e["tid"]), step, corr,
             _is_comm(e["name"]))] += 1
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("eq") / "hta.duckdb"
    rep = ingest([HTA], db)
    assert not rep.failed, [f.error for f in rep.failed]
    return db


@pytest.mark.parametrize("key", sorted(FILES))
def test_events_equal_the_python_reference(store: Path, key: tuple[str, int]) -> None:
    doc = json.loads(gzip.open(HTA / FILES[key]).read())
    expected = reference_events(doc)
    with tracekit.open(store) as s:
        rows = s.sql("SELECT ts_ns, dur_ns, kind, name, tid, step, correlation, is_comm FROM events "
                     "WHERE run_id = ? AND rank = ?", list(key)).rows()
    got = Counter(rows)
    assert sum(got.values()) == sum(expected.values()) > 4000
    assert got == expected


def test_collectives_equal_the_python_reference(store: Path) -> None:
    """single_rank_nccl: every NCCL kernel with its args is one collective: op from 'Collective
    name', bytes = elements x dtype width, group from 'Process Group Name'."""
    doc = json.loads(gzip.open(HTA / FILES[("single_rank_nccl", 0)]).read())
    base = doc["baseTimeNanoseconds"]
    width = {"float": 4, "long": 8, "int": 4, "half": 2, "byte": 1}
    expected = Counter()
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "kernel" and e["name"].startswith(NCCL_KERNEL_PREFIXES):
            a = e["args"]
            n = max(int(a["In msg nelems"]), int(a["Out msg nelems"]))
            expected[(OP_OF_COLLECTIVE_NAME[a["Collective name"]], base + _ns(e["ts"]),
                      base + _ns(e["ts"]) + round(e["dur"] * 1000), n * width[a["dtype"].lower()],
                      a["Process Group Name"])] += 1
    with tracekit.open(store) as s:
        got = Counter(s.sql("SELECT op, start_ns, end_ns, nbytes, pg_name FROM collectives "
                            "WHERE run_id = 'single_rank_nccl'").rows())
    assert got == expected and sum(got.values()) == 21
