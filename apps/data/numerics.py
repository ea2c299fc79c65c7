"""The numerics report stored with a run: the manifest's ``numerics`` rows, or ``numerics.json``
(a list of rows) in the run's directory."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from apps.data.store import DashboardData
from tracekit.store import StoreError


def numerics_report(data: DashboardData, run_id: str) -> pl.DataFrame | None:
    info = data.run_info(run_id)
    rows = info["manifest"].get("numerics")
    if rows is None and info.get("root"):
        f = Path(info["root"]) / "numerics.json"
        if f.is_file():
            try:
                rows = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise StoreError(f"{f}: not valid JSON ({e})") from None
    if not rows:
        return None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise StoreError(f"run {run_id!r}: numerics report must be a list of rows (objects)")
    return pl.DataFrame(rows)
