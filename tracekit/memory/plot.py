"""Measured vs estimated memory per rank, as a PNG: for every rank two stacked bars (measured at
the peak, estimated), one colour per component. Rendering only; the numbers come from
tracekit.memory.compare. Needs matplotlib (``pip install tracekit[plot]``)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tracekit.memory.compare import COMPARED, MemoryComparison

COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
           "activations": "#c44e52", "other": "#8c8c8c"}


def plot_comparison(cmp: MemoryComparison, path: Path, title: str = "") -> Path:
    """Write the plot to ``path`` (PNG) and return it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'tracekit[plot]'") from None
    comp = cmp.by_component
    ranks = cmp.by_rank["rank"].to_list()
    totals = comp.group_by("rank").agg(pl.col("measured").sum(), pl.col("estimated").sum())
    peak = max(float(totals["measured"].max()), float(totals["estimated"].max()), 1.0)
    unit, scale = ("GiB", 1024**3) if peak >= 1024**3 else ("MiB", 1024**2) if peak >= 1024**2 else ("KiB", 1024)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(ranks) + 2), 4.5), dpi=120)
    width = 0.38
    for side, column, hatch in ((-1, "measured", None), (1, "estimated", "//")):
        bottom = [0.0] * len(ranks)
        for c in COMPARED:
            rows = {r["rank"]: r[column] / scale for r in comp.filter(pl.col("component") == c).iter_rows(named=True)}
            heights = [rows.get(r, 0.0) for r in ranks]
            ax.bar([i + side * width / 2 for i in range(len(ranks))], heights, width * 0.95, bottom=bottom,
                   color=COLOURS[c], hatch=hatch, edgecolor="white", linewidth=0.5,
                   label=c if column == "measured" else None)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylabel(unit)
    cfg = cmp.config
    ax.set_title(f"{title}  measured at the peak (left) vs estimated (right, hatched)\n"
                 f"tp{cfg.get('tp')} cp{cfg.get('cp')} pp{cfg.get('pp')} dp{cfg.get('dp')}, "
                 f"{cfg.get('compute_dtype')}/{cfg.get('grad_accum_dtype')}, ZeRO-{cfg.get('zero_stage')}",
                 fontsize=9)
    ax.legend(fontsize=8, ncols=len(COMPARED), loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
