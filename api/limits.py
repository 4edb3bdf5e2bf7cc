"""Request size limits of the chat endpoints, with the spec's numbers ("Limits") as defaults.

One frozen value so the HTTP and /ws/chat paths (and tests) share the same numbers and a
deployment can tighten them in one place. Megapixels are decimal (10**6 pixels), as cameras
and the spec mean them; byte sizes are binary MiB.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from api.errors import PayloadTooLarge
from inclavate.errors import ConfigError

__all__ = ["MIB", "RequestLimits"]

MIB = 1024 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """Every limit is inclusive: a value equal to the limit is accepted."""

    max_body_bytes: int = 24 * MIB
    """Raw request body; the server checks it before decoding JSON."""
    max_buffered_body_bytes: int = 256 * MIB
    """Request bodies this peer holds at once, over all requests (``api.body_budget``):
    ten bodies of the largest size, sixteen chats with 16 MiB of media each."""
    max_content_parts: int = 64
    """Content-array elements over all messages (string content counts none)."""
    max_media_items: int = 16
    """Images, audio clips and videos over all messages; a video counts once, frames or file."""
    max_frames_per_video: int = 16
    max_decoded_frames_per_file: int = 240
    """A cap for the server-side video decoder, not a reason to refuse a request."""
    max_item_bytes: int = 8 * MIB
    """Decoded (not base64) bytes of one image, frame, audio clip or video file."""
    max_total_media_bytes: int = 16 * MIB
    max_image_pixels: int = 16_000_000
    """Per image, video frames included."""
    max_total_pixels: int = 32_000_000
    """Over all images and video frames of a request: it bounds the vision encoder's work."""
    max_audio_seconds: float = 300.0
    max_artifact_bytes: int = 512 * MIB
    """One ``POST /v1/artifacts`` body (the spec's per-upload cap)."""
    max_file_bytes: int = 64 * MIB
    """The file part of one ``POST /v1/files`` upload."""
    max_generations: int = 8
    """Chat generations this peer drives as entry at once (a peer sets its ``--max-sessions``,
    the session slots of each stage of a chain). Driving more made them queue for slots at
    the stages past the entry's step deadline, which then blamed healthy peers."""
    max_waiting_generations: int = 32
    """Chat requests waiting for one of those turns; past them a request is a 429 before any work."""
    generation_wait_s: float = 120.0
    """How long a request waits for its turn before a 429."""
    websocket_idle_s: float = 300.0
    """A ``/ws/chat`` connection that sends no request for this long is closed."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(
                    f"request limit {f.name} must be a positive number, got {value!r}"
                )
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ConfigError("request limit max_buffered_body_bytes must hold one body of max_body_bytes")

    def check_body_size(self, nbytes: int) -> None:
        """Refuse a body before reading it into JSON, so a huge upload costs no parsing."""
        if nbytes > self.max_body_bytes:
            raise PayloadTooLarge(
                f"request body is {nbytes} bytes; the limit is {self.max_body_bytes} "
                f"({self.max_body_bytes // MIB} MiB)"
            )
