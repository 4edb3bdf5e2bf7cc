"""Layer engines (llama.cpp, MLX) and the sessions they hold.

Public surface: ``node.engine`` (the ``LayerEngine`` contract, ``BatchItem``,
``StageOutput``, ``EngineConfig``), ``node.engines`` (``resolve_engine``, ``load_engine``:
which engine and building it), ``node.llamacpp_engine.LlamaCppEngine``,
``node.mlx_engine.MlxEngine`` (needs mlx), ``node.tokenizer.Tokenizer``, ``node.errors``.
"""

import os
from collections.abc import Mapping

COLOCATED_ENV = "INCLAVATE_COLOCATED"
"""Set (to 1) by whoever starts several peers on one machine whose engine threads may
outnumber its cores (``LocalSwarm``): threads that wait at a barrier then sleep at once
instead of spinning a while. ``inclavate swarm`` splits the cores and sets 0."""

_DEFAULTED_ENV = "INCLAVATE_THREAD_WAIT_DEFAULTED"
"""Names the variables this module set (comma-separated), so a child process tells our
default from a user's."""

BOUNDED_SPIN = "1000"
"""libgomp spin iterations before a waiting thread sleeps: tens of microseconds."""


def _thread_wait_policy() -> None:
    """How llama.cpp's OpenMP threads wait at the barrier after nearly every graph node.

    Spinning forever (``OMP_WAIT_POLICY=ACTIVE`` alone) is fastest on an idle machine and a
    collapse on a busy one: a thread spinning for a partner that lost its core burns the
    rest of its time slice. Sleeping at once (``PASSIVE``) costs a futex wake-up per barrier:
    one peer at 2 threads ran at ~0.3x llama.cpp. libgomp's default spins ~3 ms, long
    enough to keep a core busy through a token's whole Python-side turn. A bounded spin
    catches a barrier whose partners are running and sleeps when they are not: measured at 2
    threads, as fast as libgomp's default with free cores, 5x faster than it (half of
    PASSIVE) on an overloaded machine (docs/ARCHITECTURE.md, performance notes). Peers told
    that their threads may outnumber the cores (``COLOCATED_ENV``) sleep at once. libgomp
    reads these variables when it loads, i.e. at the first ``import llama_cpp``; a user's
    own setting wins.

    The bounded spin is set with ``OMP_WAIT_POLICY=ACTIVE`` beside it: with a spin count
    given, the policy only decides libgomp's *throttled* count, used once a process holds
    more OpenMP threads than cores (two OS threads calling llama.cpp each get a team):
    100 without a policy, which turns most barriers into futex sleeps (a peer whose decode
    steps ran on the event loop and prefill on the engine thread decoded at 0.72x
    llama.cpp), 1000 with ACTIVE, the same as the bounded spin. So the OS thread that calls
    the engine no longer matters (:func:`teams_spin_alike`).
    """
    inherited_default = os.environ.pop(_DEFAULTED_ENV, "")
    for name in filter(None, inherited_default.split(",")):
        os.environ.pop(name, None)  # a parent's default, not a choice: choose again
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if colocated():
        defaults = {"OMP_WAIT_POLICY": "PASSIVE"}
    else:
        defaults = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": BOUNDED_SPIN}
    os.environ.update(defaults)
    os.environ[_DEFAULTED_ENV] = ",".join(defaults)


_INFINITE_SPIN = 30_000_000_000
"""What libgomp spins for ``OMP_WAIT_POLICY=ACTIVE`` without a count (``infinite`` too)."""
_SPIN_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _spin_count(text: str) -> int | None:
    """``GOMP_SPINCOUNT`` as libgomp reads it (a count with an optional k/M/G/T suffix, or
    ``infinite``); None when it would not parse it."""
    text = text.strip().lower()
    if text in ("infinite", "infinity"):
        return _INFINITE_SPIN
    digits = text.rstrip("kmgt")
    suffix = text[len(digits):]
    if not digits.isdigit() or suffix not in _SPIN_SUFFIXES:
        return None
    return int(digits) * _SPIN_SUFFIXES[suffix]


def teams_spin_alike(env: Mapping[str, str] | None = None) -> bool:
    """Whether llama.cpp's threads wait the same way however many OpenMP teams the process
    holds: libgomp's spin count equals its throttled count (see :func:`_thread_wait_policy`).

    Then an engine may be called from any OS thread, e.g. a decode step on the event loop,
    without slowing every barrier of every call. ``env`` defaults to the variables as they
    were when this package chose the policy, i.e. what libgomp read when it loaded."""
    env = _LOADED_WITH if env is None else env
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    given = env.get("GOMP_SPINCOUNT")
    if given is not None:
        spin = _spin_count(given)
        if spin is None:
            return False
    else:
        spin = {"active": _INFINITE_SPIN, "passive": 0}.get(policy, 300_000)
    throttled = {"active": 1000, "passive": 0}.get(policy, 100)
    return min(throttled, spin) == spin


def colocated() -> bool:
    return os.environ.get(COLOCATED_ENV, "") not in ("", "0")


_thread_wait_policy()
_LOADED_WITH = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
