"""Which architectures a layer range can run exactly, and what each needs to get there.

llama.cpp builds its graph from the GGUF's metadata, so a slice renumbered to start at block
0 runs the same arithmetic as the whole model *unless* the graph depends on the absolute
layer index or on the total layer count. The rules below are the measured cases (see
shared/NOTES.md); everything else is refused at load time rather than run wrong, because a
silently different layer computes plausible-looking but wrong text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from inclavate.types import LayerRange
from node.errors import UnsupportedArchitecture


@dataclass(frozen=True)
class ArchRules:
    """How to slice and feed one architecture.

    ``swa_period``: the loader marks layer ``il`` sliding-window when ``il % period <
    period - 1``, deriving it from the index; a slice renumbers layers, so it must carry
    the original flags as an explicit per-layer BOOL array. ``embd_input_scale`` is what the graph multiplies
    ``batch.embd`` by; a later stage pre-divides its hidden state by it.
    ``layer_count_dependent`` names block counts at which llama.cpp changes the graph
    (e.g. Gemma "27B" attention scale): a slice of such a model would be typed UNKNOWN.
    """

    name: str
    swa_period: int | None = None
    embd_input_scale: Callable[[Mapping[str, Any]], float] | None = None
    layer_count_dependent: frozenset[int] = frozenset()


def _sqrt_n_embd(meta: Mapping[str, Any]) -> float:
    return math.sqrt(float(meta["embedding_length"]))


# Measured bit-exact (split == whole) with random-weight files of each architecture.
_RULES: dict[str, ArchRules] = {
    rules.name: rules
    for rules in (
        ArchRules("llama"),
        ArchRules("qwen2"),
        ArchRules("qwen3"),
        ArchRules("qwen3moe"),
        ArchRules("phi3"),
        # Gemma 2 alternates SWA by index (il % 2 == 0) and scales *every* input embedding,
        # token or not, by sqrt(n_embd): exact only when that is a power of two, otherwise
        # ~1 ulp on some elements (greedy tokens still agree).
        ArchRules(
            "gemma2",
            swa_period=2,
            embd_input_scale=_sqrt_n_embd,
            layer_count_dependent=frozenset({46}),
        ),
        # Gemma 3: 5 local layers then 1 global, by index; the rope base follows that choice.
        # Token inputs are scaled inside the graph but embd inputs are not.
        ArchRules(
            "gemma3",
            swa_period=6,
            layer_count_dependent=frozenset({62}),
        ),
    )
}


def swa_flags(period: int, layers: range) -> list[bool]:
    """The sliding-window flag of each original layer, as llama.cpp derives it by index."""
    return [il % period < period - 1 for il in layers]


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_RULES))


def check_swa_range(rules: ArchRules, layers: LayerRange, flags: list[bool]) -> None:
    """Refuse a range llama.cpp would abort on (the whole process, not just the load).

    An interleaved-SWA model's graph asserts that some layer slides; a slice holding only
    global layers (one odd layer of gemma2, one 6th layer of gemma3) trips it.
    """
    if not any(flags):
        raise UnsupportedArchitecture(
            f"{rules.name} layers {layers} are all global-attention layers; llama.cpp needs "
            "a sliding-window layer in every range: take 2 or more layers"
        )


def rules_for(arch: str, n_layers: int, *, whole_model: bool) -> ArchRules:
    """Return the slicing rules for ``arch``, or refuse it with a reason a user can act on.

    Running the whole model in one range needs no slicing, so any architecture llama.cpp
    knows is accepted there.
    """
    if whole_model:
        return _RULES.get(arch, ArchRules(arch))
    rules = _RULES.get(arch)
    if rules is None:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} cannot be split into layer ranges exactly "
            f"(verified: {', '.join(supported_architectures())}); run it whole on one peer"
        )
    if n_layers in rules.layer_count_dependent:
        raise UnsupportedArchitecture(
            f"{arch} with {n_layers} layers changes its attention by total layer count in "
            "llama.cpp, so a slice would compute differently; run it whole on one peer"
        )
    return rules
