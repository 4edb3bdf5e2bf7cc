"""The sampler draws from exactly the distribution a request asks for, reproducibly.

Its fast paths (a threshold before sorting for top_p, a blockwise draw over the whole
vocabulary, a hashed uniform instead of a numpy generator per token) are checked against a
plain reference: softmax in float64 and a stable sort of the whole vocabulary.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from node.sampling import SamplingParams, UnusableLogits, _draw, _nucleus, _uniform, sample

VOCAB = 49_152  # SmolLM2's: not a multiple of the draw's block, so the last block is short


def reference_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def reference_nucleus(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    probs = reference_probs(logits, temperature)
    order = np.argsort(-probs, kind="stable")
    keep = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
    return {int(i) for i in order[:keep]}


def weights_of(logits: np.ndarray, temperature: float) -> np.ndarray:
    return np.exp((logits - logits.max()) / temperature).astype(np.float32)


def model_like_logits(seed: int, spread: float) -> np.ndarray:
    """Heavy-tailed logits like a language model's: a few likely tokens, a long flat tail."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(VOCAB).astype(np.float32) * 2.0
    logits[rng.choice(VOCAB, 40, replace=False)] += rng.uniform(0, spread, 40).astype(np.float32)
    return logits


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("temperature", "top_p"), [(0.8, 0.95), (1.0, 0.9), (1.5, 0.95), (0.3, 0.5), (2.0, 0.99)])
def test_the_nucleus_is_the_smallest_heaviest_set_reaching_top_p(seed: int, temperature: float, top_p: float) -> None:
    for spread in (4.0, 12.0, 25.0):  # flat to peaked: each threshold of the cascade gets used
        logits = model_like_logits(seed, spread)
        weights = weights_of(logits, temperature)
        got = _nucleus(weights, top_p)
        assert {int(i) for i in got} == reference_nucleus(logits, temperature, top_p)
        assert list(weights[got]) == sorted(weights[got], reverse=True), "heaviest first"


def test_nucleus_ties_keep_the_lower_indices() -> None:
    logits = np.zeros(1000, np.float32)  # every token equally likely
    got = _nucleus(weights_of(logits, 1.0), 0.1)
    assert list(got) == list(range(100))


def test_a_tiny_top_p_keeps_the_most_likely_token() -> None:
    logits = model_like_logits(1, 12.0)
    assert list(_nucleus(weights_of(logits, 0.8), 1e-9)) == [int(np.argmax(logits))]


@pytest.mark.parametrize("n", [7, 512, 513, VOCAB])
def test_the_draw_lands_on_the_only_token_with_weight(n: int) -> None:
    for k in sorted({0, n // 2, n - 1, min(n - 1, 511), min(n - 1, 512)}):
        weights = np.zeros(n, np.float32)
        weights[k] = 3.5
        assert {_draw(weights, u) for u in np.linspace(0, 1, 50, endpoint=False)} == {k}


def test_the_draw_never_picks_a_token_of_zero_weight() -> None:
    weights = np.zeros(VOCAB, np.float32)
    chosen = np.array([3, 600, 601, 20_000, VOCAB - 1])
    weights[chosen] = 1.0
    picks = {_draw(weights, u) for u in np.linspace(0, 1, 2000, endpoint=False)}
    assert picks == set(chosen.tolist())


def test_the_draw_at_the_top_of_the_range_stays_on_a_token_of_weight() -> None:
    """A draw a hair below 1 lands on the last token of weight, not on the zeros after it
    (the block's sum and its running sum may round differently; the draw clamps)."""
    weights = np.zeros(VOCAB, np.float32)
    weights[[0, 600]] = [1.0, 1e-7]
    for u in (1.0 - 2.0**-53, 1.0 - 1e-12, 1.0 - 1e-9):
        assert _draw(weights, u) == 600


@pytest.mark.parametrize("n", [6, 2_000])
def test_draws_follow_the_weights(n: int) -> None:
    """Over many positions, each token comes up as often as its weight says (n=2,000 goes
    through the blockwise draw, including a short last block)."""
    rng = np.random.default_rng(5)
    weights = rng.uniform(0.0, 1.0, n).astype(np.float32) ** 4
    probs = weights.astype(np.float64) / weights.sum(dtype=np.float64)
    draws = 60_000
    counts = np.bincount([_draw(weights, _uniform(11, pos)) for pos in range(draws)], minlength=n)
    # Tokens pooled into 6 bins (of about equal expected mass when there are many): a
    # chi-square with 5 degrees of freedom, whose 99.99th percentile is ~25.7. The draws
    # are deterministic, so this cannot flake.
    edges = np.searchsorted(np.cumsum(probs), np.linspace(0, 1, 7)[1:-1]) if n > 6 else np.arange(1, 6)
    observed = np.array([c.sum() for c in np.split(counts, edges)])
    expected = np.array([p.sum() for p in np.split(probs, edges)]) * draws
    assert float(((observed - expected) ** 2 / expected).sum()) < 25.7


def test_temperature_and_top_p_shape_what_is_drawn() -> None:
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0], np.float32)
    nucleus = reference_nucleus(logits, 0.8, 0.9)
    drawn = [sample(logits, SamplingParams(0.8, 0.9, 1), pos) for pos in range(4000)]
    assert set(drawn) == nucleus
    share = drawn.count(0) / len(drawn)
    expected = reference_probs(logits, 0.8)[0] / reference_probs(logits, 0.8)[sorted(nucleus)].sum()
    assert abs(share - expected) < 0.03


def test_a_draw_depends_only_on_seed_and_position() -> None:
    logits = model_like_logits(2, 6.0)
    params = SamplingParams(1.0, 0.95, 1234)
    first = [sample(logits, params, pos) for pos in range(200)]
    assert first == [sample(logits.copy(), SamplingParams(1.0, 0.95, 1234), pos) for pos in range(200)]
    assert len(set(first)) > 10, "positions draw independently"
    other = [sample(logits, SamplingParams(1.0, 0.95, 1235), pos) for pos in range(200)]
    assert other != first
    # The seed is taken modulo 2**64, as the wire carries it.
    assert [sample(logits, SamplingParams(1.0, 0.95, 1234 + 2**64), pos) for pos in range(200)] == first


def test_uniform_draws_cover_the_unit_interval() -> None:
    us = np.array([_uniform(seed, pos) for seed in (0, 1, 2**64 - 1) for pos in range(3000)])
    assert 0.0 <= us.min() and us.max() < 1.0
    assert np.histogram(us, bins=10, range=(0, 1))[0].min() > 800  # ~900 per bin


def test_greedy_takes_the_first_most_likely_token() -> None:
    logits = np.array([0.5, 2.0, 2.0, -1.0], np.float32)
    assert sample(logits, SamplingParams(0.0, 0.95, 9), 3) == 1


def test_tokens_far_below_the_rest_are_never_drawn() -> None:
    logits = np.full(VOCAB, -1e30, np.float32)
    logits[[10, 40_000]] = [0.0, 0.5]
    drawn = {sample(logits, SamplingParams(2.0, 1.0, 3), pos) for pos in range(300)}
    assert drawn == {10, 40_000}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logits_that_are_not_finite_fail_the_job(bad: float, temperature: float) -> None:
    logits = model_like_logits(3, 6.0)
    logits[777] = bad
    with pytest.raises(UnusableLogits):
        sample(logits, SamplingParams(temperature, 0.95, 1), 0)


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 5e-324])
@pytest.mark.parametrize("top_p", [0.95, 1.0])
def test_a_vanishing_temperature_is_greedy_and_warns_of_nothing(temperature: float, top_p: float) -> None:
    """Any positive temperature is valid from a client or the wire; 1/T must not become
    infinite (0 * inf is NaN, which would leave nothing to draw)."""
    logits = model_like_logits(4, 12.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drawn = {sample(logits, SamplingParams(temperature, top_p, 5), pos) for pos in range(20)}
    assert drawn == {int(np.argmax(logits))}


def test_extreme_finite_logits_still_draw_a_token() -> None:
    huge = np.array([3e38, -3e38, 3e38, 1.0], np.float32)  # differences overflow float32
    wide = np.array([1e300, -1e300, 5.0])  # float64, beyond float32's range
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {sample(huge, SamplingParams(0.8, 0.95, 2), pos) for pos in range(50)} == {0, 2}
        assert sample(wide, SamplingParams(1.0, 1.0, 2), 0) == 0
