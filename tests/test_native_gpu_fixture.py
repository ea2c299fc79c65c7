"""A torch-native job's own records from a real H100 (FSDP2 on a DeviceMesh, NCCL, plain profiler,
torch's flight recorder, a CUDA snapshot; tests/gpu_fixtures/README.md): ingest reads every file,
and the analyses say what one rank allows. Expected values are read from the raw files here."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import tracekit
from tracekit.ingest import pipeline

RUN = Path(__file__).parent / "gpu_fixtures" / "native_fsdp2_h100"


def test_a_torch_native_nccl_run_is_read_whole(tmp_path: Path) -> None:
    trace = json.load(gzip.open(RUN / "traces" / "rank0.json.gz"))
    fr = pickle.loads((RUN / "fr" / "rank0").read_bytes())
    kernels = sum(1 for e in trace["traceEvents"] if e.get("cat") == "kernel")
    report = pipeline.ingest([RUN], tmp_path / "s.duckdb")
    assert not report.failed and len(report.ok) == 3
    with tracekit.open(tmp_path / "s.duckdb") as s:
        run = s.table("runs").row(0, named=True)
        assert (run["world_size"], run["backend"], run["layout_source"]) == (1, "nccl", "group-names")
        assert (run["tp"], run["cp"], run["pp"], run["dp"]) == (1, 1, 1, 1)
        assert s.sql("SELECT count(*) FROM events WHERE kind = 'kernel'").rows()[0][0] == kernels
        entries = s.table("fr_entries")
        assert entries.height == len(fr["entries"]) == 6
        assert set(entries["state"]) == {"completed"} and set(entries["profiling_name"]) == {"nccl:all_reduce"}
        d = s.diagnose()
        assert d.localization.verdict == "no_data" and "one rank" in d.headline
        assert not s.hangs().hung
