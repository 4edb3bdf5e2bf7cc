"""Choosing the next token from the last range's logits.

Sampling runs on the stage that holds the last layers, so logits (vocabulary-sized) never
cross the network; only the chosen token id travels back to the entry peer.

Randomness is a pure function of ``(seed, position)``: a replica of the last stage, or a
replay after a peer died, draws exactly the same token at the same position. A request
without a seed gets one at random from the entry peer, once, so the whole generation is
still reproducible from its record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_NUCLEUS_CANDIDATES = 1024
"""Tokens sorted first when applying top_p; the full vocabulary is sorted only when these
do not reach top_p (nearly flat distributions), which keeps a step to tens of microseconds."""


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
    stage (``rng.choice`` raises on NaN probabilities; argmax would pick garbage)."""
    if not np.isfinite(logits).all():
        raise UnusableLogits("the logits are not all finite (the hidden states upstream were corrupt)")
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    candidates = _nucleus(probs, params.top_p)
    weights = probs[candidates]
    rng = np.random.default_rng([params.seed, position])
    return int(candidates[rng.choice(len(candidates), p=weights / weights.sum())])


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of most likely tokens whose mass reaches ``top_p``."""
    if top_p >= 1.0:
        return np.arange(len(probs))
    k = min(_NUCLEUS_CANDIDATES, len(probs))
    top = np.argpartition(-probs, k - 1)[:k]
    order = top[np.argsort(-probs[top], kind="stable")]
    if probs[order].sum() < top_p and k < len(probs):
        order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p)) + 1
    return order[: min(keep, len(order))]
