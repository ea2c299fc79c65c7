"""Does one member of a level stand out from the others? The noise bar every localization decision
uses: the others' spread (a robust one: 1.4826 x the median absolute deviation), floored at a share
of the step, and a margin that rises with the number of members competing for the top."""

from __future__ import annotations

import math

import numpy as np

from tracekit.analysis.tunables import Tunables


def spread(values: np.ndarray) -> float:
    """Robust spread of ``values``: 1.4826 x their median absolute deviation (0 for fewer than two)."""
    if values.size < 2:
        return 0.0
    return float(1.4826 * np.median(np.abs(values - np.median(values))))


def standout(row: np.ndarray, step_ns: float, tun: Tunables, effect_min_frac: float) -> tuple[int, float, bool]:
    """One step's top member, its effect over the others' median, and whether it stands out
    (beyond ``margin_min`` noise units of the others' spread, and a minimum share of the step)."""
    top = int(np.argmax(row))
    others = np.delete(row, top)
    eff = float(row[top] - np.median(others))
    noise = max(spread(others), tun.noise_floor_frac * step_ns)
    return top, eff, eff >= tun.margin_min * noise and eff >= effect_min_frac * step_ns


def margin_bar(tun: Tunables, searched: int) -> float:
    """The margin a top member must reach when ``searched`` members compete for the top (the
    largest of many noisy scores is large by chance): margin_min for a pair, higher beyond."""
    return tun.margin_min + tun.margin_per_log * math.log(max(1.0, searched / 2))
