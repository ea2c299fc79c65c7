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


def biweight_spread(values: np.ndarray, c: float = 9.0) -> float:
    """Tukey's biweight midvariance, as a spread: as robust as ``spread`` (a culprit among the
    values moves it little) but about 87% efficient on normal data where the MAD is 37%, so a
    spread of 8-16 values comes out high by chance far less often (Mosteller and Tukey 1977)."""
    values = values[np.isfinite(values)]
    if values.size < 2:
        return 0.0
    center = np.median(values)
    mad = np.median(np.abs(values - center))
    if mad == 0:
        return 0.0
    u = (values - center) / (c * mad)
    inside = np.abs(u) < 1
    num = math.sqrt(values.size * np.sum(((values - center) ** 2 * (1 - u ** 2) ** 4)[inside]))
    den = abs(np.sum(((1 - u ** 2) * (1 - 5 * u ** 2))[inside]))
    return float(num / den) if den > 0 else spread(values)


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
