"""The REST API's exception tree, and the one place that turns any error into HTTP.

Handlers raise; they never build error bodies. The server catches everything at its edge
and asks :func:`error_response_parts` for the status and JSON body, so the spec's two body
shapes (and the rule that tracebacks never reach a client) live in exactly one module::

    InclavateError
    └── ApiError                  a request that cannot be served; carries its status
        ├── BadRequest            400  {"error": "..."}
        ├── Unauthorized          401
        ├── Forbidden             403
        ├── NotFound              404
        ├── Conflict              409
        ├── UnknownModel          422
        ├── PayloadTooLarge       413
        ├── ServiceUnavailable    503
        ├── GatewayTimeout        504
        └── MediaError            400 or 413, the media envelope (see MediaCode)

Errors from other packages are not ApiErrors; :func:`register` maps their types to a status
(``ModelNotFound`` -> 422 and ``ConfigError`` -> 400 are registered here, the lower layers'
in :func:`_register_lower_layers`, the artifact store's among them: 400 malformed id or
range, 404, 409 not ready, 413, 416, 507 store full, 503 unreachable).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any, ClassVar

from inclavate.errors import ConfigError, InclavateError, ModelNotFound, RelayedError

__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "MediaCode",
    "MediaError",
    "NotFound",
    "PayloadTooLarge",
    "ServiceUnavailable",
    "GatewayTimeout",
    "Unauthorized",
    "UnknownModel",
    "error_headers",
    "error_response_parts",
    "register",
]


MAX_MESSAGE_CHARS = 2000
"""The longest error message a client is sent (and a log line shows). Messages quote what
the caller sent: an 8 MiB model id came back as an 8 MiB error body (2026-12-07, an audit
from outside)."""


def bounded(message: str) -> str:
    """``message``, cut to :data:`MAX_MESSAGE_CHARS` with a note of how much was left out."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


class ApiError(InclavateError):
    """A request the API refuses; subclasses fix the status, the message is for the client."""

    status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, Any]:
        """The spec's general error shape ("Error Format")."""
        return {"error": self.message}


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    status = 409


class UnknownModel(ApiError):
    status = 422


class PayloadTooLarge(ApiError):
    status = 413


class ServiceUnavailable(ApiError):
    status = 503


class GatewayTimeout(ApiError):
    """A bounded wait ran out; the work goes on (the message says where to look), so a
    client's automatic retry would start it again (:func:`error_headers`)."""

    status = 504
    should_retry = False


class MediaCode(StrEnum):
    """The stable ``type``/``code`` values of the media envelope; clients may switch on them.

    Add a value only for a failure a client would handle differently; reword messages freely.
    """

    UNSUPPORTED_MODALITY = "unsupported_modality"
    """The model (or this server, for whole video files) cannot take this kind of input."""
    UNSUPPORTED_MEDIA_SOURCE = "unsupported_media_source"
    """A remote http(s) URL, file URL or local path where a base64 data URL is required."""
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    """A MIME type or audio format outside the accepted list."""
    INVALID_MEDIA = "invalid_media"
    """A malformed part, data URL or base64, a header that cannot be read, a declared type
    that the magic bytes contradict, or frames out of order."""
    TOO_MANY_PARTS = "too_many_parts"
    """More content parts per request, or frames per video part, than the limits allow."""
    TOO_MANY_MEDIA = "too_many_media"
    """More media items (images, audio clips, videos) per request than the limits allow."""
    MEDIA_TOO_LARGE = "media_too_large"
    """Encoded bytes, megapixels or audio duration over a limit; the only 413."""

    @property
    def status(self) -> int:
        return 413 if self is MediaCode.MEDIA_TOO_LARGE else 400


class MediaError(ApiError):
    """Media validation and capability failures, in the spec's envelope shape."""

    def __init__(self, code: MediaCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param

    @property
    def status(self) -> int:  # type: ignore[override]  # per instance: depends on the code
        return self.code.status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.code.value,
                "param": self.param,
                "code": self.code.value,
            }
        }


_Render = Callable[[BaseException], str]
_registry: dict[type[BaseException], tuple[int, _Render]] = {}


def register(exc_type: type[BaseException], status: int, *, message: _Render = str) -> None:
    """Map a foreign (non-ApiError) exception type to a status and a client message.

    Lookup follows the raised type's MRO, so the most specific registration wins. Pass a
    ``message`` that hides detail for errors whose text may carry internals (peer addresses,
    file paths); the default shows ``str(exc)``.
    """
    if issubclass(exc_type, ApiError):
        raise TypeError(f"{exc_type.__name__} is an ApiError; it already carries its status")
    _registry[exc_type] = (status, message)


register(ModelNotFound, UnknownModel.status)
register(ConfigError, BadRequest.status)


def _register_lower_layers() -> None:
    """Errors of the packages below the API, mapped once, here (see the tree above)."""
    from api.chat_template import TemplateError
    from api.generation import PromptTooLong
    from api.reasoning import ReasoningRequestError
    from inclavate.artifact_types import (
        ArtifactNotFound,
        ArtifactNotReady,
        ArtifactTooLarge,
        ArtifactUnavailable,
        BadArtifactRequest,
        QuotaExceeded,
    )
    from inclavate.byte_ranges import RangeMalformed, RangeNotSatisfiable
    from inclavate.fan_out import ListingsBusy
    from inclavate.owner_ids import MalformedId
    from inclavate.metrics_store import MetricsStoreError
    from inclavate.store import StoreError
    from node.errors import ContextFull, EngineError, InvalidBatch
    from p2p.chain import ChainTimeout, ContextExceeded, FailoverExhausted, StageFailed
    from p2p.admin import AdminRefused
    from p2p.errors import P2PError
    from p2p.legacy import (BadRegistration, DuplicateNode, NodeMismatch, NoRangeAvailable, NotYourNode,
                            UnknownLegacyNode, UnreachableNode)  # fmt: skip
    from p2p.routing import NoRoute

    for exc_type, status in [
        (ReasoningRequestError, 400),  # a reasoning level the model does not accept
        (TemplateError, 400),  # the model's template refused this conversation
        (PromptTooLong, 400),
        (ContextFull, 400),
        (ContextExceeded, 400),
        (InvalidBatch, 400),
        (NoRoute, 503),  # no Ready chain: the message names the missing layers
        (BadRegistration, 400),
        (UnknownLegacyNode, 404),
        (DuplicateNode, 409),
        (NotYourNode, 403),  # heartbeat/leave without the node's relay token; a wrong join token
        (UnreachableNode, 422),  # the node's URL does not answer
        (NodeMismatch, 422),
        (NoRangeAvailable, 503),
        (AdminRefused, 409),  # the peer holding the node refused or could not do it
        (StageFailed, 503),
        (FailoverExhausted, 503),  # the route kept failing: the message says how often and why
        (ChainTimeout, 504),
        (EngineError, 503),
        (StoreError, 503),
        (MetricsStoreError, 503),
        (MalformedId, 400),  # artifacts (inclavate/artifact_types.py draws their tree)
        (BadArtifactRequest, 400),
        (RangeMalformed, 400),
        (ArtifactNotFound, 404),
        (ArtifactNotReady, 409),
        (ArtifactTooLarge, 413),
        (RangeNotSatisfiable, 416),
        (QuotaExceeded, 507),
        (ArtifactUnavailable, 503),
        (P2PError, 503),
        (ListingsBusy, 503),  # with Retry-After (error_headers): this peer runs its listings at once
    ]:
        register(exc_type, status)


_register_lower_layers()


def _register_generation_errors() -> None:
    """Generation jobs, generators and the peer-to-peer forwarding they use."""
    from inclavate.generations import ListingTooDeep, NoGenerator
    from inclavate.job_feeds import WatchersFull
    from inclavate.job_runner import JobActive, JobFinished, JobNotFound
    from inclavate.jobs import IdempotencyConflict, JobStoreError, QueueFull
    from inclavate.peer_http import PeerBusy, PeerUnreachable
    from node.generators.base import InvalidParams

    for exc_type, status in [
        (InvalidParams, 400),
        (ListingTooDeep, 400),
        (JobNotFound, 404),
        (JobFinished, 409),
        (JobActive, 409),
        (IdempotencyConflict, 409),
        (NoGenerator, 422),
        (QueueFull, 429),
        (PeerBusy, 429),
        (WatchersFull, 429),  # with Retry-After (error_headers): a job's or this peer's event streams are all taken
        (JobStoreError, 503),
        (PeerUnreachable, 503),
    ]:
        register(exc_type, status)


_register_generation_errors()


NO_RETRY_HEADER = "x-should-retry"
"""OpenAI's SDKs retry every 408, 409, 429 and 5xx twice unless the answer says
``x-should-retry: false``. A speech or transcription call whose wait ran out (504: the job
keeps running) was submitted three times, each a job of its own, and a 507 re-uploaded the
clip three times (an audit, 2026-12-07)."""


def error_headers(exc: BaseException) -> dict[str, str]:
    """Headers an error's answer carries: ``Retry-After`` for one that says when to retry
    (a ``retry_after_s`` attribute, whole seconds); ``x-should-retry: false`` for one a
    retry would only repeat (a ``should_retry`` attribute that is False: the work goes on,
    the job failed, the store is full)."""
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if isinstance(retry, int) and not isinstance(retry, bool):
        headers["Retry-After"] = str(retry)
    if getattr(exc, "should_retry", None) is False:
        headers[NO_RETRY_HEADER] = "false"
    return headers


def error_response_parts(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body for any exception a handler let escape."""
    if isinstance(exc, ApiError):
        return exc.status, exc.body()
    if isinstance(exc, RelayedError):
        return exc.status, exc.body
    for cls in type(exc).__mro__:
        entry = _registry.get(cls)
        if entry is not None:
            status, render = entry
            return status, {"error": bounded(render(exc))}
    if isinstance(exc, InclavateError):
        # Ours but unmapped: name the class so a bug report is actionable, keep the text
        # (which may hold paths or peer addresses) out of the response.
        return 500, {"error": f"internal error ({type(exc).__name__})"}
    return 500, {"error": "internal error"}
