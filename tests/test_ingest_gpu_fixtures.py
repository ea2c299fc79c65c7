"""Real NCCL/CUDA artifacts recorded on an H100 (tests/gpu_fixtures/README.md): a profiler trace,
ProcessGroupNCCL's flight recorder (pickle and JSON), a CUDA memory snapshot with C++ frames, and
a reference-trainer run on NCCL. Expected values come from the raw files, read here with the
standard library and torch's own memory viz, not from tracekit."""

from __future__ import annotations

import collections
import gzip
import json
import pickle
import re
from pathlib import Path

import pytest

import tracekit
from tracekit.analysis import memory as memory_analysis
from tracekit.ingest import pipeline

FIX = Path(__file__).parent / "gpu_fixtures"
H100 = FIX / "h100"


def _ingest(tmp_path: Path, *paths: Path, name: str = "s.duckdb") -> tuple[pipeline.IngestReport, tracekit.Store]:
    store = tmp_path / name
    report = pipeline.ingest(list(paths), store)
    return report, tracekit.open(store)


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> tuple[pipeline.IngestReport, tracekit.Store]:
    return _ingest(tmp_path_factory.mktemp("h100"), H100)


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)  # our own committed fixture, not a user's file


def test_every_h100_file_ingests(h100) -> None:
    report, _ = h100
    assert not report.failed
    assert sorted((f.path.name, f.status) for f in report.files) == [
        ("fr_rank0.pkl", "ok"), ("rank0.json.gz", "ok"), ("snapshot_rank0.pickle", "ok")]


def test_nccl_profiler_trace(h100) -> None:
    _, s = h100
    raw = json.load(gzip.open(H100 / "rank0.json.gz"))
    spans = [e for e in raw["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    assert s.sql("SELECT count(*) FROM events").item() == len(spans)
    cats = collections.Counter(e["cat"] for e in spans)
    kinds = dict(s.sql("SELECT kind, count(*) FROM events GROUP BY kind").rows())
    assert kinds["kernel"] == cats["kernel"] == 375
    assert kinds["cpu_op"] == cats["cpu_op"]
    # The longest kernel, exactly: Kineto's microseconds to integer nanoseconds, in profiler step 2.
    longest = max((e for e in spans if e["cat"] == "kernel"), key=lambda e: e["dur"])
    row = s.sql("SELECT name, dur_ns, step FROM events WHERE kind = 'kernel' ORDER BY dur_ns DESC LIMIT 1").row(0)
    assert row == (longest["name"], round(longest["dur"] * 1000), 2)
    assert s.sql("SELECT step FROM steps ORDER BY step").to_series().to_list() == [2, 3, 4]
    # Groups from distributedInfo.pg_config, with the description given at new_group.
    info = raw["distributedInfo"]
    assert (info["backend"], info["world_size"]) == ("nccl", 1)
    groups = s.sql("SELECT pg_name, pg_desc, ranks FROM groups ORDER BY pg_name").rows()
    assert groups == [(g["pg_name"], g["pg_desc"], g["ranks"]) for g in info["pg_config"]] == [
        ("0", "default_pg", [0]), ("1", "dp_shard", [0])]
    # Every c10d op of the trace is communication: record_param_comms, its nccl: annotation on CPU
    # and GPU, and the c10d:: dispatcher op.
    comm = {n for (n,) in s.sql("SELECT DISTINCT name FROM events WHERE is_comm").rows()}
    raw_comm = {e["name"] for e in spans if e["name"] == "record_param_comms" or e["name"].startswith(("nccl:", "c10d::"))}
    assert comm == raw_comm
    # One rank alone: NCCL launches no kernel for a collective, so the trace has no NCCL kernel to
    # time a collective by (FR below has them).
    assert not any("nccl" in e["name"].lower() for e in spans if e["cat"] == "kernel")
    assert s.sql("SELECT count(*) FROM collectives WHERE source <> 'fr'").item() == 0


def test_nccl_flight_recorder_pickle(h100) -> None:
    _, s = h100
    dump = _unpickle(H100 / "fr_rank0.pkl")
    entries = dump["entries"]
    assert (dump["version"], dump["comm_lib_version"], len(entries)) == ("2.10", "2.28.9", 174)
    fr = s.sql("SELECT * FROM fr_entries ORDER BY record_id")
    assert fr["profiling_name"].to_list() == [e["profiling_name"] for e in entries]
    assert fr["duration_ms"].to_list() == [e["duration_ms"] for e in entries]
    assert set(fr["state"]) == {"completed"}
    # A collective row lasts the op's measured GPU time: the discovered times are the watchdog's
    # polls, microseconds apart however long the op ran.
    polls = [e["time_discovered_completed_ns"] - e["time_discovered_started_ns"] for e in entries]
    assert max(polls) < 20_000 < max(e["duration_ms"] * 1e6 for e in entries)
    colls = s.sql("SELECT seq, pg_name, op, start_ns, end_ns - start_ns AS d FROM collectives ORDER BY start_ns, seq")
    want = sorted((e["time_discovered_started_ns"], e["collective_seq_id"], e["process_group"][0],
                   max(p, round(e["duration_ms"] * 1e6))) for e, p in zip(entries, polls))
    assert [(r[3], r[0], r[1], r[4]) for r in colls.rows()] == want
    ops = collections.Counter(colls["op"].to_list())
    assert ops == {"all_reduce": 144, "reduce_scatter": 6, "all_gather": 6, "broadcast": 6,
                   "all_to_all": 6, "all_reduce_barrier": 6}
    # The stack of the first all_reduce points at the line of record.py that issued it.
    frames = json.loads(fr["frames"][0])
    assert any(f["filename"].endswith("record.py") and f["name"] == "step" for f in frames)


def test_nccl_flight_recorder_json_is_recognized_and_equals_the_pickle(tmp_path: Path, h100) -> None:
    # torch writes the JSON's keys sorted, so "pg_config" and "version" come after 96 KB of entries.
    text = (FIX / "h100_fr_json" / "fr_rank0.json").read_bytes()
    assert text.index(b'"pg_config"') > 64 << 10
    report, s = _ingest(tmp_path, FIX / "h100_fr_json" / "fr_rank0.json")
    assert [(f.format, f.status, f.rows) for f in report.files] == [("fr", "ok", 348)]
    cols = "record_id, pg_name, pg_desc, collective_seq_id, profiling_name, input_sizes, duration_ms, state"
    assert s.sql(f"SELECT {cols} FROM fr_entries ORDER BY record_id").equals(
        h100[1].sql(f"SELECT {cols} FROM fr_entries ORDER BY record_id"))


def test_cuda_snapshot_matches_torch_memory_viz(h100) -> None:
    torch_viz = pytest.importorskip("torch.cuda._memory_viz")
    _, s = h100
    raw = _unpickle(H100 / "snapshot_rank0.pickle")
    summary = torch_viz.segsum(raw)
    count = int(re.search(r"segments: (\d+)", summary)[1])
    seg = s.sql("SELECT count(*), sum(total_size)::BIGINT, sum(allocated_size)::BIGINT FROM memory_segments").row(0)
    assert seg == (count, sum(x["total_size"] for x in raw["segments"]),
                   sum(x["allocated_size"] for x in raw["segments"]))
    assert f"total_reserved: {torch_viz.Bytes(seg[1])}" in summary
    assert f"total_allocated: {torch_viz.Bytes(seg[2])}" in summary
    trace = raw["device_traces"][0]
    assert s.sql("SELECT count(*) FROM memory_events").item() == len(trace)
    actions = collections.Counter(t["action"] for t in trace)
    assert dict(s.sql("SELECT action, count(*) FROM memory_events GROUP BY action").rows()) == actions


def test_cuda_snapshot_sites_skip_cpp_frames(h100) -> None:
    """torch's default stacks="all" puts the allocator's and ATen's C++ frames first: the site is
    the first Python frame of user code, and backward work (no Python frame) is named by its node."""
    _, s = h100
    raw = _unpickle(H100 / "snapshot_rank0.pickle")
    allocs = [t for t in raw["device_traces"][0] if t["action"] == "alloc"]

    def expected(frames: list[dict]) -> str | None:
        for f in frames:
            if f["filename"].endswith("record.py"):
                return f"{f['filename']}:{f['line']}:{f['name']}"
        for f in frames:
            if m := re.match(r"torch::autograd::generated::(\w+?)(_apply_functional|::apply)", f["name"]):
                return f"<autograd>:0:{m[1]}"
            if m := re.match(r"torch::autograd::((Engine|InputBuffer)::\w+)", f["name"]):
                return f"<autograd>:0:{m[1]}"
        return None

    want = collections.Counter(expected(t["frames"]) for t in allocs)
    got = collections.Counter(dict(s.sql("SELECT frame, count(*) FROM memory_events WHERE action = 'alloc' "
                                         "GROUP BY frame").rows()))
    assert got == want
    assert None not in got  # every allocation has a site
    forward = [k for k in got if k.endswith(":forward")]
    assert forward and all(k.rsplit("/", 1)[-1] == "record.py:52:forward" for k in forward)
    assert got["<autograd>:0:AddmmBackward0"] > 0
    assert not any(k.split(":")[0].endswith(".cpp") for k in got)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pipeline.IngestReport, tracekit.Store]:
    return _ingest(tmp_path_factory.mktemp("trainer"), FIX / "trainer_nccl_h100")


def test_trainer_nccl_run_ingests(trainer_run) -> None:
    report, s = trainer_run
    assert not report.failed
    assert sorted(f.format for f in report.files) == ["fr", "kineto", "memory"]
    manifest = json.loads((FIX / "trainer_nccl_h100" / "manifest.json").read_text())
    assert manifest["config"]["backend"] == "nccl"
    raw = _unpickle(FIX / "trainer_nccl_h100" / "memory" / "rank0.pickle")
    assert s.sql("SELECT count(*) FROM memory_events").item() == len(raw["device_traces"][0])
    # The trainer's model code is where forward memory is allocated; backward by autograd node.
    sites = dict(s.sql("SELECT frame, count(*) FROM memory_events WHERE action = 'alloc' GROUP BY frame").rows())
    assert any("reference_trainer/model.py" in k for k in sites if k)
    assert sites["<autograd>:0:MmBackward0"] > 0
    assert None not in sites
    kernels = s.sql("SELECT count(*) FROM events WHERE kind = 'kernel'").item()
    assert kernels > 0


def test_trainer_nccl_run_memory_peak(trainer_run) -> None:
    """The measured peak, replayed from the raw trace: what was allocated before recording began
    (blocks freed in the trace without an alloc entry there, and blocks still allocated at the end
    without one) plus the trace's allocations minus its completed frees."""
    _, s = trainer_run
    raw = _unpickle(FIX / "trainer_nccl_h100" / "memory" / "rank0.pickle")
    trace = raw["device_traces"][0]
    allocated: set[int] = set()
    before = 0
    for t in trace:
        if t["action"] == "alloc":
            allocated.add(t["addr"])
        elif t["action"] == "free_completed" and t["addr"] not in allocated:
            before += t["size"]
        elif t["action"] == "free_completed":
            allocated.discard(t["addr"])
    in_trace = {t["addr"] for t in trace if t["action"] == "alloc"}
    before += sum(b["size"] for seg in raw["segments"] for b in seg["blocks"]
                  if b["state"] == "active_allocated" and b["address"] not in in_trace)
    live = peak = before
    for t in trace:
        if t["action"] == "alloc":
            live += t["size"]
            peak = max(peak, live)
        elif t["action"] == "free_completed":
            live -= t["size"]
    result = memory_analysis.peaks(s.table("memory_events"), s.table("memory_segments"),
                                   blocks=s.table("memory_blocks"))
    assert result.select("peak_allocated", "baseline_allocated").row(0) == (peak, before)
