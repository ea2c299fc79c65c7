"""The fault grid's cases (benchmarks/grid_cases.py) stay what was published: the numbers in
docs/analysis.md were measured on them, so a new kind of case must not move the others."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import grid_cases as grid  # noqa: E402

# sha1 of the labels (layout, names, noise, clocks, seed, faults) of every case, as published
PUBLISHED = {(0, False): "e03489a99d521e40", (1, False): "78669cecc22c5ee8", (3, True): "efcf1287fae177d9"}


@pytest.mark.parametrize("draw,schedules", sorted(PUBLISHED))
def test_the_published_cases_do_not_move_when_kinds_are_added(draw: int, schedules: bool) -> None:
    cases = grid.make_cases(list(grid.KINDS), 2, False, draw, schedules)
    labels = [c.label for c in cases if c.kind not in grid.LATER_KINDS]
    assert len(labels) == 280
    assert hashlib.sha1("\n".join(labels).encode()).hexdigest()[:16] == PUBLISHED[(draw, schedules)]


def test_clean_runs_whose_chips_differ_cover_every_layout_at_each_spread() -> None:
    chips = grid.make_cases(["chips"], 2, False, 26)
    assert len(chips) == 2 * len(grid.LAYOUTS) * len(grid.CHIP_SPREADS)
    assert {c.chips for c in chips} == set(grid.CHIP_SPREADS) and not any(c.faults for c in chips)
    assert {c.layout for c in chips} == set(grid.LAYOUTS)
    # each is its own run: no two share a label (the cache key)
    assert len({c.label for c in chips}) == len(chips)


def test_slow_hosts_are_every_rank_of_one_host_of_a_layout_with_two_or_more() -> None:
    for schedules in (False, True):
        hosts = grid.make_cases(["host"], 2, False, 26, schedules)
        assert hosts and all(c.faults for c in hosts)
        for c in hosts:
            per_host = c.schedule[3] if c.schedule else 8
            ranks = c.truth["ranks"]
            assert len(ranks) == per_host and ranks[0] % per_host == 0 and ranks == list(range(ranks[0], ranks[-1] + 1))
            assert len(c.faults) == per_host and all(f"factor={c.truth['factor']}" in f for f in c.faults)
            tp, cp, pp, dp = c.layout
            assert tp * cp * pp * dp >= 2 * per_host
