"""The root of every exception Inclavate raises on purpose.

Each package hangs its own tree below :class:`InclavateError`; foreign errors
(llama.cpp, libp2p, HTTP) are translated into these at the package edge, and
``api/errors.py`` is the one place that turns them into HTTP statuses::

    InclavateError
    ├── inclavate.errors.ConfigError          bad settings or command-line values
    ├── inclavate.errors.ModelNotFound        no such model in catalog or overlay
    ├── inclavate.store.StoreError            downloads, checksums, the model directory
    ├── node.errors.EngineError               loading or running a layer range
    ├── p2p.errors.P2PError                   transport, wire, registry, routing
    └── api.errors.RequestError               a client request that cannot be served
"""

from __future__ import annotations


class InclavateError(Exception):
    """Base class: catching it catches every error Inclavate raises deliberately."""


class ConfigError(InclavateError):
    """A setting, flag or config file value is invalid."""


class ModelNotFound(InclavateError):
    """The model id is in neither the shipped catalog nor the local overlay."""

    def __init__(self, model_id: str, known: list[str] | None = None) -> None:
        self.model_id = model_id
        self.known = sorted(known or [])
        hint = f"; known models: {', '.join(self.known)}" if self.known else ""
        super().__init__(f"unknown model {model_id!r}{hint}")


class RelayedError(InclavateError):
    """Another peer answered a forwarded request with an error: its status and JSON body
    reach the client unchanged (``api/errors.py`` serves them as they are)."""

    def __init__(self, status: int, body: dict) -> None:  # type: ignore[type-arg]
        super().__init__(f"peer answered {status}: {body}")
        self.status = status
        self.body = body
