"""Choosing the next token from the last range's logits.

Sampling runs on the stage that holds the last layers, so logits (vocabulary-sized) never
cross the network; only the chosen token id travels back to the entry peer.

Randomness is a pure function of ``(seed, position)``: a replica of the last stage, or a
replay after a peer died, draws exactly the same token at the same position. A request
without a seed gets one at random from the entry peer, once, so the whole generation is
still reproducible from its record.

A draw runs in series with every decode step of its session, so it must cost tens of
microseconds, not a millisecond: at the API's default temperature 0.8 and top_p 0.95, a
softmax in float64 over SmolLM2's 49,152 tokens, a partial sort of them and a numpy
generator built per token took ~1.4 ms, an eighth of a 2-thread decode step. Now the
weights stay float32, only tokens above a threshold are sorted, and the uniform comes from
a hash (~0.1 ms in all; ``scripts/bench_peer`` section 1 prints what sampling costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_THRESHOLDS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
"""Weights, relative to the most likely token's, above which tokens are sorted for top_p,
tried in turn. At SmolLM2's temperature 0.8 the nucleus's lightest token weighed 3e-4 or
more in every step of a 200-token story, so a step sorts tens to hundreds of tokens, not
the vocabulary."""

_BLOCK = 512
"""Tokens per block when drawing from a whole vocabulary (see ``_draw``)."""

_GOLDEN = 0x9E3779B97F4A7C15
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_BELOW_ONE = 1.0 - 2.0**-53
_SEED_MASK = 0xFFFFFFFFFFFFFFFF


class UnusableLogits(ValueError):
    """The last range produced logits that no token can be drawn from."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        # These may come off the wire (a forward frame): type them before any arithmetic.
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError("seed must be an integer")
        # The generator takes 64 bits; any integer a client sends maps onto them, once, here.
        object.__setattr__(self, "seed", self.seed & _SEED_MASK)
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be within [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be within (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """The token to place at ``position``, drawn from ``logits`` under ``params``.

    Raises :class:`UnusableLogits` when the logits are not all finite: NaN or infinite
    hidden states from an upstream stage end here, and must fail this one job, not the
    stage (argmax would pick garbage, and the weights would all be NaN).

    The check is folded into reductions the draw needs anyway, plus the minimum: a NaN
    anywhere makes the maximum NaN (argmax points at the first NaN), an infinity shows in the
    maximum or the minimum. That is two passes over the vocabulary where ``isfinite().all()``
    then ``argmax`` made three and a temporary array, on caches the engine call left cold."""
    if params.greedy:
        best = int(np.argmax(logits))
        top = logits[best]
    else:
        top = logits.max()
    if not (math.isfinite(top) and math.isfinite(logits.min())):
        raise UnusableLogits("the logits are not all finite (the hidden states upstream were corrupt)")
    if params.greedy:
        return best
    # exp((l - max) / T): the most likely token weighs 1, every other less. 1/T is capped at
    # float32's largest value: a temperature of 1e-300 (valid, from any client) must not make
    # it infinite, since 0 * inf is NaN; what overflows to -inf instead weighs 0.
    with np.errstate(over="ignore"):
        weights = (logits - top).astype(np.float32, copy=False)
        weights *= np.float32(min(1.0 / params.temperature, _FLOAT32_MAX))
        np.exp(weights, out=weights)
    u = _uniform(params.seed, position)
    if params.top_p >= 1.0:
        return _draw(weights, u)
    candidates = _nucleus(weights, params.top_p)
    return int(candidates[_draw(weights[candidates], u)])


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of heaviest tokens whose weight reaches ``top_p`` of the
    total, heaviest first (ties in index order).

    Only tokens above a threshold are sorted: every token outside that set is lighter than
    every token in it, so the nucleus is a prefix of the set's order once the set reaches
    ``top_p``. Thresholds fall until it does; the last one is low enough that the tokens
    it leaves out cannot weigh ``1 - top_p`` of the total between them.
    """
    total = float(weights.sum(dtype=np.float64))
    goal = top_p * total
    for threshold in (*_THRESHOLDS, (total - goal) / len(weights)):
        candidates = np.flatnonzero(weights >= threshold)
        chosen = weights[candidates]
        if float(chosen.sum(dtype=np.float64)) >= goal:
            break
    order = np.argsort(-chosen, kind="stable")
    cumulative = np.cumsum(chosen[order], dtype=np.float64)
    keep = int(np.searchsorted(cumulative, goal)) + 1
    return candidates[order[: min(keep, len(order))]]


def _draw(weights: np.ndarray, u: float) -> int:
    """The index whose share of the running sum holds ``u`` (in [0, 1)) of the total: index
    ``i`` with probability ``weights[i] / sum``; never one of zero weight.

    A running sum over the whole vocabulary is slow in numpy (~0.2-0.4 ms for 49,152
    tokens), so the draw picks a block of ``_BLOCK`` tokens by the blocks' sums, then the
    token inside it."""
    n = len(weights)
    if n <= _BLOCK:
        return _first_past(np.cumsum(weights, dtype=np.float64), u)
    whole = n - n % _BLOCK
    sums = weights[:whole].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if whole < n:
        sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
    cumulative = np.cumsum(sums)
    block = _first_past(cumulative, u)
    before = float(cumulative[block - 1]) if block else 0.0
    # Rounding (the block's sum against its own running sum) must not push the draw past
    # the block's last token of weight.
    inside = min(max((u * float(cumulative[-1]) - before) / float(sums[block]), 0.0), _BELOW_ONE)
    start = block * _BLOCK
    return start + _first_past(np.cumsum(weights[start : start + _BLOCK], dtype=np.float64), inside)


def _first_past(cumulative: np.ndarray, u: float) -> int:
    """The first index whose running sum passes ``u`` of the last one (side="right": a
    step of zero weight is never chosen); the last index if rounding ran past the end."""
    index = int(np.searchsorted(cumulative, u * float(cumulative[-1]), side="right"))
    return min(index, len(cumulative) - 1)


def _uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on ``(seed, position)``: splitmix64 run to
    step ``position + 1`` from the mixed seed. Cheaper than building a numpy generator per
    token (~30 us) and the same on every platform and numpy version."""
    state = (_mix(seed) + (position + 1) * _GOLDEN) & _SEED_MASK
    return (_mix(state) >> 11) * (1.0 / (1 << 53))


def _mix(z: int) -> int:
    """splitmix64's finaliser: 64 bits in, 64 well-mixed bits out."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _SEED_MASK
    return z ^ (z >> 31)
