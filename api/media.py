"""Multimodal content parts: validate them as the spec's "Limits" says, before any real work.

A content array is checked in two passes over the whole request. The first pass looks only
at the JSON: part types, data URL prefixes, MIME types, counts, frame order, and each item's
decoded size, which base64 gives away by its length. Only when every count and byte budget
holds does the second pass decode base64 and read each item's header (no pixels, no audio
samples) for magic bytes, dimensions and duration. So an oversized or overfull request costs
no decoding at all, and one bad item fails the request without the rest being decoded.

Counting rules (the spec leaves them open): a string ``content`` is not a content part; a
video is one media item whether it carries frames or a file; video frames count toward the
per-image and total megapixel limits, because the vision encoder pays for every one of them.
WebP images are checked at their sent size; the spec counts a WebP against the PNG it is
re-encoded to, so whoever re-encodes must charge that PNG against the byte limits again.

Modality names are those of :class:`api.content.Modality`.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from api.content import (
    AudioPart,
    ContentPart,
    ImagePart,
    Modality,
    TextPart,
    VideoFile,
    VideoFrame,
    VideoPart,
)
from api.errors import BadRequest, MediaCode, MediaError
from api.limits import MIB, RequestLimits
from api.media_headers import (
    UnreadableHeader,
    audio_duration,
    image_size,
    sniff_audio,
    sniff_image,
    sniff_video,
)

if TYPE_CHECKING:
    from api.chat_request import ChatRequest

__all__ = [
    "AUDIO_FORMATS",
    "IMAGE_MIMES",
    "VIDEO_MIMES",
    "RawContent",
    "parse_contents",
    "require_modalities",
]


class RawContent(NamedTuple):
    """One message's content array as decoded JSON, with where it sits in the request."""

    param: str
    """Field path of the array, e.g. ``messages[2].content``; error params extend it."""
    parts: list[Any]
    allow_media: bool
    """False outside user messages: OpenAI takes media only from the user, and so do we."""


IMAGE_MIMES: Mapping[str, str] = {
    "image/png": "image/png",
    "image/jpeg": "image/jpeg",
    "image/jpg": "image/jpeg",  # not registered, but browsers and SDKs send it
    "image/webp": "image/webp",
    "image/bmp": "image/bmp",
    "image/x-ms-bmp": "image/bmp",
}
VIDEO_MIMES: Mapping[str, str] = {
    m: m for m in ("video/mp4", "video/quicktime", "video/webm", "video/x-matroska")
}
AUDIO_FORMATS = ("wav", "mp3")


def parse_contents(
    contents: Sequence[RawContent], limits: RequestLimits
) -> list[tuple[ContentPart, ...]]:
    """Validate every content array of a request together; one tuple of parts per input."""
    budget = _Budget(limits)
    pending = [
        [
            _collect_part(budget, f"{c.param}[{i}]", raw, c.allow_media)
            for i, raw in enumerate(c.parts)
        ]
        for c in contents
    ]
    return [tuple(finish(budget) for finish in message) for message in pending]


def require_modalities(request: ChatRequest, supported: Iterable[str]) -> None:
    """Refuse a request that sends a model input it cannot take; text is always accepted."""
    allowed = {Modality.TEXT, *supported}
    for m, message in enumerate(request.messages):
        for p, part in enumerate(message.parts):
            if part.modality not in allowed:
                raise MediaError(
                    MediaCode.UNSUPPORTED_MODALITY,
                    _unsupported_message(request.model, part.modality, allowed),
                    f"messages[{m}].content[{p}]",
                )


def _unsupported_message(model: str, modality: Modality, allowed: set[str]) -> str:
    if modality is Modality.VIDEO_FILE and Modality.VIDEO_FRAMES in allowed:
        return (
            "unsupported modality: video_file; this server cannot decode video files "
            "(ffmpeg and ffprobe are not on its PATH), send input_video.frames instead"
        )
    accepts = ", ".join(sorted(allowed))
    return f"unsupported modality: {modality.value}; model {model!r} accepts {accepts}"


class _Budget:
    """Running counts and sizes over the whole request, checked as each item is added."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self.parts = self.media = self.bytes = self.pixels = 0

    def count_part(self, param: str) -> None:
        self.parts += 1
        if self.parts > self.limits.max_content_parts:
            raise MediaError(
                MediaCode.TOO_MANY_PARTS,
                f"a request may have at most {self.limits.max_content_parts} content parts",
                param,
            )

    def count_media(self, param: str) -> None:
        self.media += 1
        if self.media > self.limits.max_media_items:
            raise MediaError(
                MediaCode.TOO_MANY_MEDIA,
                f"a request may have at most {self.limits.max_media_items} media items",
                param,
            )

    def charge_bytes(self, item: _Encoded) -> None:
        limit = self.limits.max_item_bytes
        if item.size > limit:
            raise _too_large(
                f"media item is {_mib(item.size)} decoded; the limit is {_mib(limit)}", item.param
            )
        self.bytes += item.size
        if self.bytes > self.limits.max_total_media_bytes:
            raise _too_large(
                f"media in this request add up to over {_mib(self.limits.max_total_media_bytes)}",
                item.param,
            )

    def charge_pixels(self, param: str, width: int, height: int) -> None:
        pixels = width * height
        if pixels > self.limits.max_image_pixels:
            raise _too_large(
                f"image is {width}x{height} ({pixels / 1e6:.1f} MP); "
                f"the limit is {self.limits.max_image_pixels / 1e6:g} MP per image",
                param,
            )
        self.pixels += pixels
        if self.pixels > self.limits.max_total_pixels:
            raise _too_large(
                f"images in this request add up to over {self.limits.max_total_pixels / 1e6:g} MP",
                param,
            )


def _too_large(message: str, param: str) -> MediaError:
    return MediaError(MediaCode.MEDIA_TOO_LARGE, message, param)


def _invalid(message: str, param: str) -> MediaError:
    return MediaError(MediaCode.INVALID_MEDIA, message, param)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class _Encoded:
    """A media item still in base64; ``size`` is what it will decode to."""

    param: str
    kind: str  # canonical MIME type or audio format
    b64: str = field(repr=False)

    @property
    def size(self) -> int:
        # Every 4 base64 characters carry 3 bytes and trailing '=' only pad the last group;
        # the floor also holds without padding (2 chars -> 1 byte, 3 chars -> 2 bytes).
        b64 = self.b64
        pad = 2 if b64.endswith("==") else 1 if b64.endswith("=") else 0
        return (len(b64) - pad) * 3 // 4

    def decode(self) -> bytes:
        text = self.b64 + "=" * (-len(self.b64) % 4)  # tolerate unpadded base64
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise _invalid("data is not valid base64", self.param) from None


_Finish = Callable[[_Budget], ContentPart]
_T = TypeVar("_T")


def _collect_part(budget: _Budget, param: str, raw: Any, allow_media: bool) -> _Finish:
    budget.count_part(param)
    if not isinstance(raw, dict):
        raise _invalid("a content part must be an object", param)
    kind = raw.get("type")
    if not isinstance(kind, str):
        # Checked before the collector lookup: a list or object is unhashable (a 500 there).
        raise _invalid("a content part's type must be a string", f"{param}.type")
    if kind == "text":
        text = raw.get("text")
        if not isinstance(text, str):
            raise BadRequest(f"{param}.text must be a string")
        part = TextPart(text)
        return lambda _: part
    collect = _MEDIA_COLLECTORS.get(kind)
    if collect is None:
        known = ", ".join(["text", *_MEDIA_COLLECTORS])
        raise _invalid(
            f"unknown content part type {kind!r}; expected one of {known}", f"{param}.type"
        )
    if not allow_media:
        raise _invalid(f"{kind} parts are accepted only in user messages", param)
    budget.count_media(param)
    payload = raw.get(kind)
    if kind == "image_url" and isinstance(payload, str):
        payload = {"url": payload}  # the bare-string form some clients send
    if not isinstance(payload, dict):
        raise _invalid(f"{param}.{kind} must be an object", f"{param}.{kind}")
    return collect(budget, f"{param}.{kind}", payload)


def _collect_image(budget: _Budget, param: str, payload: dict[str, Any]) -> _Finish:
    item = _data_url(payload.get("url"), f"{param}.url", IMAGE_MIMES, "image")
    budget.charge_bytes(item)
    return lambda b: _finish_image(b, item)


def _finish_image(budget: _Budget, item: _Encoded) -> ImagePart:
    data = item.decode()
    _check_magic(item, sniff_image(data), "image")
    width, height = _read_header(lambda: image_size(item.kind, data), item.param)
    if width <= 0 or height <= 0:
        raise _invalid(f"image header says {width}x{height}", item.param)
    budget.charge_pixels(item.param, width, height)
    return ImagePart(item.kind, data, width, height)


def _collect_audio(budget: _Budget, param: str, payload: dict[str, Any]) -> _Finish:
    fmt = payload.get("format")
    if not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS:
        raise MediaError(
            MediaCode.UNSUPPORTED_MEDIA_TYPE,
            f"audio format must be one of {', '.join(AUDIO_FORMATS)}, got {fmt!r}",
            f"{param}.format",
        )
    data = payload.get("data")
    if not isinstance(data, str):
        raise _invalid("input_audio.data must be a base64 string", f"{param}.data")
    # Only clear URLs are refused by shape: '/' is a base64 digit (MP3 data starts "//"),
    # so a local path is left to fail as invalid base64.
    if data[:5].lower() == "data:":
        raise _invalid(
            "input_audio.data is raw base64, without a data: URL prefix", f"{param}.data"
        )
    if "://" in data[:16]:
        raise _refused_source(data, f"{param}.data", "the audio as raw base64")
    item = _Encoded(f"{param}.data", fmt.lower(), data)
    budget.charge_bytes(item)
    return lambda b: _finish_audio(b, item)


def _finish_audio(budget: _Budget, item: _Encoded) -> AudioPart:
    data = item.decode()
    _check_magic(item, sniff_audio(data), "audio")
    duration = _read_header(lambda: audio_duration(item.kind, data), item.param)
    if duration > budget.limits.max_audio_seconds:
        raise _too_large(
            f"audio is {duration:.0f} s long; the limit is {budget.limits.max_audio_seconds:g} s",
            item.param,
        )
    return AudioPart(item.kind, data, duration)


def _collect_video(budget: _Budget, param: str, payload: dict[str, Any]) -> _Finish:
    frames, file = payload.get("frames"), payload.get("file")
    if (frames is None) == (file is None):
        raise _invalid(
            "input_video takes either frames or file, never both (and not neither)", param
        )
    if file is not None:
        item = _data_url(file, f"{param}.file", VIDEO_MIMES, "video")
        budget.charge_bytes(item)
        return lambda _: _finish_video_file(item)
    if not isinstance(frames, list) or not frames:
        raise _invalid("input_video.frames must be a non-empty array", f"{param}.frames")
    if len(frames) > budget.limits.max_frames_per_video:
        raise MediaError(
            MediaCode.TOO_MANY_PARTS,
            f"a video part may have at most {budget.limits.max_frames_per_video} frames",
            f"{param}.frames",
        )
    items: list[tuple[_Encoded, float]] = []
    for i, frame in enumerate(frames):
        fparam = f"{param}.frames[{i}]"
        if not isinstance(frame, dict):
            raise _invalid("a video frame must be an object", fparam)
        image_url = frame.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        item = _data_url(url, f"{fparam}.image_url.url", IMAGE_MIMES, "video frame")
        ts = frame.get("timestamp_ms")
        if (
            isinstance(ts, bool)
            or not isinstance(ts, int | float)
            or not (math.isfinite(ts) and ts >= 0)
        ):
            raise _invalid("timestamp_ms must be a non-negative number", f"{fparam}.timestamp_ms")
        if items and ts < items[-1][1]:
            raise _invalid(
                "video frames must be in nondecreasing timestamp order", f"{fparam}.timestamp_ms"
            )
        budget.charge_bytes(item)
        items.append((item, ts))
    return lambda b: VideoPart(
        frames=tuple(VideoFrame(_finish_image(b, it), ts) for it, ts in items)
    )


def _finish_video_file(item: _Encoded) -> VideoPart:
    data = item.decode()
    _check_magic(item, sniff_video(data), "video container")
    return VideoPart(file=VideoFile(item.kind, data))


_MEDIA_COLLECTORS: dict[str, Callable[[_Budget, str, dict[str, Any]], _Finish]] = {
    "image_url": _collect_image,
    "input_audio": _collect_audio,
    "input_video": _collect_video,
}


def _data_url(url: Any, param: str, accepted: Mapping[str, str], what: str) -> _Encoded:
    """Split ``data:<mime>[;param...];base64,<payload>`` without touching the payload."""
    if not isinstance(url, str):
        raise _invalid(f"the {what} must be a data URL string", param)
    if url[:5].lower() != "data:":
        raise _refused_source(
            url, param, f"a base64 data URL (data:<mime>;base64,...) for the {what}"
        )
    comma = url.find(",")
    if comma < 0:
        raise _invalid("data URL has no ',' before its data", param)
    mime, *options = (s.strip().lower() for s in url[5:comma].split(";"))
    if "base64" not in options:
        raise _invalid("data URL must be base64-encoded (data:<mime>;base64,...)", param)
    canonical = accepted.get(mime)
    if canonical is None:
        choices = ", ".join(sorted(set(accepted.values())))
        message = f"{what} type {mime or '(none)'!r} is not accepted; use one of {choices}"
        raise MediaError(MediaCode.UNSUPPORTED_MEDIA_TYPE, message, param)
    return _Encoded(param, canonical, url[comma + 1 :])


def _refused_source(value: str, param: str, expected: str) -> MediaError:
    if value[:8].lower().startswith(("http://", "https://")):
        reason = "remote URLs are disabled"
    else:
        reason = "local paths, non-data URLs and other strings are not accepted"
    return MediaError(MediaCode.UNSUPPORTED_MEDIA_SOURCE, f"{reason}; send {expected}", param)


def _check_magic(item: _Encoded, found: str | None, what: str) -> None:
    if found != item.kind:
        actual = found or f"not a recognized {what}"
        raise _invalid(f"declared {item.kind} but the data is {actual}", item.param)


def _read_header(read: Callable[[], _T], param: str) -> _T:
    try:
        return read()
    except UnreadableHeader as exc:
        raise _invalid(f"media header cannot be read: {exc}", param) from None
