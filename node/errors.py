"""Errors of the layer engines; llama.cpp failures become these at the edge of ``node/``.

::

    EngineError(InclavateError)
    ├── UnsupportedArchitecture   the model cannot be split exactly; refused at load time
    ├── EngineLoadError           llama.cpp could not load a slice or create a context
    ├── InvalidBatch              a batch does not fit this range (shape, positions, dtype)
    ├── SessionLimitReached       every sequence slot is in use
    ├── ContextFull               the KV cache has no room for the batch
    ├── DecodeFailed              llama_decode returned an error
    └── UnknownToken              a token id outside the vocabulary (from a faulty chain)
"""

from __future__ import annotations

from inclavate.errors import InclavateError


class EngineError(InclavateError):
    """Base of every error raised by a layer engine."""


class UnsupportedArchitecture(EngineError):
    """The architecture cannot run as a layer range with output equal to the whole model."""


class EngineLoadError(EngineError):
    """llama.cpp refused the model file or could not create a context."""


class InvalidBatch(EngineError):
    """An item does not match what this range takes (tokens vs hidden, width, positions)."""


class SessionLimitReached(EngineError):
    """All ``max_sessions`` sequence slots hold a live session."""


class SessionEvicted(EngineError):
    """The stage gave the session's slot to another source's new session (fair share when
    every slot is taken: ``node.slot_share``); the entry replays it, not a client error."""


class ContextFull(EngineError):
    """The session (or the shared KV cache) has no room for more positions."""


class DecodeFailed(EngineError):
    """``llama_decode`` failed for a reason other than a full cache."""


class UnknownToken(EngineError):
    """A token id outside the model's vocabulary reached the tokenizer (a stage sent it).

    llama.cpp does not check: ``llama_token_to_piece`` on such an id aborts the process."""
