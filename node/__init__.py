"""Layer engines (llama.cpp, MLX) and the sessions they hold.

Public surface: ``node.engine`` (the ``LayerEngine`` contract, ``BatchItem``,
``StageOutput``, ``EngineConfig``), ``node.engines`` (``resolve_engine``, ``load_engine``:
which engine and building it), ``node.llamacpp_engine.LlamaCppEngine``,
``node.mlx_engine.MlxEngine`` (needs mlx), ``node.tokenizer.Tokenizer``, ``node.errors``.
"""

import os

COLOCATED_ENV = "INCLAVATE_COLOCATED"
"""Set (to 1) by whoever starts several peers on one machine (``LocalSwarm``): threads that
wait at a barrier then sleep at once instead of spinning."""

_DEFAULTED_ENV = "INCLAVATE_THREAD_WAIT_DEFAULTED"
"""Names the variable this module set, so a child process tells our default from a user's."""

BOUNDED_SPIN = "1000"
"""libgomp spin iterations before a waiting thread sleeps: tens of microseconds."""


def _thread_wait_policy() -> None:
    """How llama.cpp's OpenMP threads wait at the barrier after nearly every graph node.

    Spinning forever (``OMP_WAIT_POLICY=ACTIVE``) is fastest on an idle machine and a
    collapse on a busy one: a thread spinning for a partner that lost its core burns the
    rest of its time slice. Sleeping at once (``PASSIVE``) costs a futex wake-up per barrier:
    one peer at 2 threads ran at ~0.3x llama.cpp. libgomp's default spins ~3 ms, long
    enough to keep a core busy through a token's whole Python-side turn. A bounded spin
    catches a barrier whose partners are running and sleeps when they are not: measured at 2
    threads, as fast as libgomp's default with free cores, 5x faster than it (half of
    PASSIVE) on an overloaded machine (docs/ARCHITECTURE.md, performance notes). Peers that
    know they share the machine with other peers sleep at once. libgomp reads these variables
    when it loads, i.e. at the first ``import llama_cpp``; a user's own setting wins.
    """
    inherited_default = os.environ.pop(_DEFAULTED_ENV, "")
    if inherited_default:
        os.environ.pop(inherited_default, None)  # a parent's default, not a choice: choose again
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    name, value = ("OMP_WAIT_POLICY", "PASSIVE") if colocated() else ("GOMP_SPINCOUNT", BOUNDED_SPIN)
    os.environ[name] = value
    os.environ[_DEFAULTED_ENV] = name


def colocated() -> bool:
    return os.environ.get(COLOCATED_ENV, "") not in ("", "0")


_thread_wait_policy()
