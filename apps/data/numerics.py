"""The numerics report stored with a run: the manifest's ``numerics`` rows, or ``numerics.json``
(a list of rows, as `numerics check --out DIR` writes it) in the run's directory, and its verdict:
``numerics_verdict.json`` beside it (the check's own summary and diagnosis), else the first
diverging buffer in comparison order read off the rows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from apps.data.store import DashboardData
from tracekit.store import StoreError


@dataclass(frozen=True)
class NumericsReport:
    rows: pl.DataFrame
    headline: str  # the diagnosis (e.g. "... the first wrong gradient in backward order is X")
    detail: str  # the summary's first line (counts, ULPs), or ""
    bit_exact: bool


def _read(f: Path):
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{f}: not valid JSON ({e})") from None


def numerics_report(data: DashboardData, run_id: str) -> NumericsReport | None:
    return data.memo(("numerics", run_id), lambda: _report(data, run_id))


def _report(data: DashboardData, run_id: str) -> NumericsReport | None:
    info = data.run_info(run_id)
    rows, verdict = info["manifest"].get("numerics"), info["manifest"].get("numerics_verdict")
    root = Path(info["root"]) if info.get("root") else None
    if rows is None and root is not None and (root / "numerics.json").is_file():
        rows = _read(root / "numerics.json")
    if verdict is None and root is not None and (root / "numerics_verdict.json").is_file():
        verdict = _read(root / "numerics_verdict.json")
    if not rows:
        return None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise StoreError(f"run {run_id!r}: numerics report must be a list of rows (objects)")
    df = pl.DataFrame(rows, infer_schema_length=None)
    if isinstance(verdict, dict) and verdict.get("diagnosis"):
        summary = str(verdict.get("summary") or "").splitlines()
        return NumericsReport(df, str(verdict["diagnosis"]), summary[0] if summary else "",
                              bool(verdict.get("bit_exact")))
    return NumericsReport(df, *_first_divergent(df))


def _first_divergent(df: pl.DataFrame) -> tuple[str, str, bool]:
    """(headline, detail, bit_exact) from the rows alone (comparison order: the rows' order)."""
    if "mismatches" not in df.columns or "buffer" not in df.columns:
        return "numerics report without per-buffer mismatch counts", "", False
    bad = df.filter(pl.col("mismatches").cast(pl.Int64, strict=False) > 0)
    if not bad.height:
        return f"bit-exact: {df.height} buffers, 0 mismatching elements", "", True
    r = bad.row(0, named=True)
    step = f" at step {r['step']}" if "step" in r else ""
    return (f"first diverging buffer {r['buffer']}{step}",
            f"{bad.height} of {df.height} buffers differ; {r['mismatches']}/{r.get('numel', '?')} elements of the "
            f"first, max {r.get('max_ulp', '?')} ULP", False)
