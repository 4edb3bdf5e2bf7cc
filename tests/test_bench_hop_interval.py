"""The pinned hop's verdict rests on a median and its interval (``scripts/bench_chain.py``):
the interval must hold the true median as often as it claims, whatever the figures' skew."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))  # bench_chain imports its siblings
from bench_chain import Verdict, median_interval, pair_schedule  # noqa: E402


def test_the_interval_is_the_order_statistics_of_the_binomial_table() -> None:
    # The published ranks for 95%: n=30 -> 10th and 21st, n=10 -> 2nd and 9th.
    assert median_interval([float(v) for v in range(1, 31)]) == (10.0, 21.0)
    assert median_interval([float(v) for v in range(10, 0, -1)]) == (2.0, 9.0)


def test_too_few_figures_claim_nothing() -> None:
    assert median_interval([0.3, 0.4, 0.5, 0.6, 0.7]) == (-math.inf, math.inf)


def test_the_interval_holds_a_skewed_median_at_least_as_often_as_it_claims() -> None:
    rng = random.Random(7)
    true_median = math.log(2)  # of an exponential(1): skewed as slow spells skew hop figures
    trials = 2000
    held = 0
    for _ in range(trials):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(30)])
        held += low <= true_median <= high
    assert held / trials >= 0.94  # 0.957 exactly for n=30; 2000 trials' noise is ~0.005


def test_the_pairs_cross_every_whole_peer_with_every_chain_in_both_orders() -> None:
    schedule = pair_schedule(32, 2, 2)
    assert len(schedule) == 32
    for combo in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        orders = [whole_first for w, c, whole_first in schedule if (w, c) == combo]
        assert len(orders) == 8 and sum(orders) == 4  # as often whole-first as chain-first
    # One of each alternates the order from pair to pair, as before there were twins.
    assert [whole_first for _, _, whole_first in pair_schedule(4, 1, 1)] == [True, False, True, False]
    for w, c in [(1, 3), (3, 1), (3, 3)]:  # odd counts of combinations alike
        schedule = pair_schedule(2 * w * c, w, c)
        assert sorted((a, b) for a, b, whole_first in schedule if whole_first) == sorted(
            (a, b) for a, b, whole_first in schedule if not whole_first)


def test_an_interval_that_straddles_the_target_decides_nothing() -> None:
    def verdict(low: float, high: float) -> str:
        return Verdict("hop", (low + high) / 2, 0.5, higher_is_better=False, interval=(low, high)).reliability

    assert verdict(0.2, 0.4) == "met reliably"
    assert verdict(0.6, 0.9) == "NOT met, reliably"
    assert verdict(0.3, 0.9).startswith("undecided")  # a noisy run (or a figure at its line)
    higher = Verdict("ratio", 0.9, 0.85, interval=(0.86, 0.95))
    assert higher.reliability == "met reliably" and "target >= 0.85" in higher.line()
