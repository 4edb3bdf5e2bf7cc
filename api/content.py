"""The content parts of a validated chat message: what the prompt builder and engines see.

Only :mod:`api.media` constructs media parts, after checking them against the request
limits, so code holding an :class:`ImagePart` may rely on its MIME type matching its bytes
and on its dimensions. Modality names follow ``input_modalities`` in GET /api/models, plus
``video_file`` for a whole video container, which needs ffmpeg on the server
(``supports_video_files``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

__all__ = [
    "AudioPart",
    "ContentPart",
    "ImagePart",
    "Modality",
    "TextPart",
    "VideoFile",
    "VideoFrame",
    "VideoPart",
]


class Modality(StrEnum):
    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO_FRAMES = "video_frames"
    VIDEO_FILE = "video_file"


@dataclass(frozen=True)
class TextPart:
    text: str
    modality: ClassVar[Modality] = Modality.TEXT


@dataclass(frozen=True)
class ImagePart:
    mime: str
    data: bytes = field(repr=False)  # megabytes in a log line help nobody
    width: int
    height: int
    modality: ClassVar[Modality] = Modality.IMAGE


@dataclass(frozen=True)
class AudioPart:
    format: str
    """``wav`` or ``mp3``, as OpenAI's ``input_audio.format``."""
    data: bytes = field(repr=False)
    duration_s: float
    modality: ClassVar[Modality] = Modality.AUDIO


@dataclass(frozen=True)
class VideoFrame:
    image: ImagePart
    timestamp_ms: float


@dataclass(frozen=True)
class VideoFile:
    mime: str
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class VideoPart:
    """A video as frames the client extracted, or as one container file; never both."""

    frames: tuple[VideoFrame, ...] = ()
    file: VideoFile | None = None

    def __post_init__(self) -> None:
        if bool(self.frames) == (self.file is not None):
            raise ValueError("a VideoPart holds either frames or a file")

    @property
    def modality(self) -> Modality:
        return Modality.VIDEO_FILE if self.file is not None else Modality.VIDEO_FRAMES


ContentPart = TextPart | ImagePart | AudioPart | VideoPart
