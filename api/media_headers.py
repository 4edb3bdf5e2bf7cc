"""Read just enough of a media file's header to identify it and size it; decode nothing.

The API must know an image's dimensions and an audio clip's duration to enforce limits,
long before anything decodes pixels or samples (and without Pillow or ffmpeg in the request
path). Each reader trusts nothing: offsets come from the file, so a short or lying header
raises :class:`UnreadableHeader` (IndexError and struct.error are folded into it).

Sniffers return the canonical MIME type (images, video) or format (audio) that the magic
bytes prove, or None; :mod:`api.media` compares that with what the client declared.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

__all__ = [
    "UnreadableHeader",
    "audio_duration",
    "audio_sample_rate",
    "image_size",
    "sniff_audio",
    "sniff_image",
    "sniff_video",
]

_T = TypeVar("_T")


class UnreadableHeader(ValueError):
    """The header is truncated or inconsistent; the message says what was wrong."""


def _guarded(read: Callable[[bytes], _T]) -> Callable[[bytes], _T]:
    @wraps(read)
    def wrapper(data: bytes) -> _T:
        try:
            return read(data)
        except (IndexError, struct.error):
            raise UnreadableHeader("header is truncated") from None

    return wrapper


# --- images -------------------------------------------------------------------------


def sniff_image(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith(b"BM"):
        return "image/bmp"
    return None


def image_size(mime: str, data: bytes) -> tuple[int, int]:
    """(width, height) in pixels of an image whose magic bytes already matched ``mime``."""
    return _SIZE_READERS[mime](data)


@_guarded
def _png_size(data: bytes) -> tuple[int, int]:
    # The spec fixes IHDR as the first chunk: 8-byte signature, length, "IHDR", w, h.
    if data[12:16] != b"IHDR":
        raise UnreadableHeader("PNG does not start with an IHDR chunk")
    width, height = struct.unpack_from(">II", data, 16)
    return width, height


# Start-of-frame markers carry the dimensions; C4 (DHT), C8 (reserved) and CC (DAC) share
# the range but are tables, not frames.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM have no length


@_guarded
def _jpeg_size(data: bytes) -> tuple[int, int]:
    # Walk the marker segments after SOI until a frame header. EXIF thumbnails and ICC
    # profiles come first and can be large, so this skips by segment length, never scans.
    pos = 2
    while True:
        if data[pos] != 0xFF:
            raise UnreadableHeader("JPEG segment does not start with a marker")
        while data[pos] == 0xFF:  # any number of 0xFF fill bytes may precede a marker
            pos += 1
        marker = data[pos]
        pos += 1
        if marker in _JPEG_SOF:
            # length (2), sample precision (1), then height before width
            height, width = struct.unpack_from(">HH", data, pos + 3)
            return width, height
        if marker in (0xD9, 0xDA):  # EOI, or SOS: entropy-coded data without a frame header
            raise UnreadableHeader("JPEG has no frame header")
        if marker in _JPEG_STANDALONE:
            continue
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2:
            raise UnreadableHeader("JPEG segment length is invalid")
        pos += length  # the length counts its own two bytes


@_guarded
def _bmp_size(data: bytes) -> tuple[int, int]:
    # 14-byte file header, then a DIB header whose own size tells its layout.
    (dib_size,) = struct.unpack_from("<I", data, 14)
    if dib_size == 12:  # OS/2 BITMAPCOREHEADER: unsigned 16-bit dimensions
        width, height = struct.unpack_from("<HH", data, 18)
    elif dib_size >= 16:  # BITMAPINFOHEADER and its successors: signed 32-bit
        width, height = struct.unpack_from("<ii", data, 18)
    else:
        raise UnreadableHeader(f"BMP DIB header size {dib_size} is unknown")
    return width, abs(height)  # a negative height means rows are stored top-down


@_guarded
def _webp_size(data: bytes) -> tuple[int, int]:
    # RIFF, size, WEBP, then the first chunk's FourCC at 12 and its payload at 20.
    chunk = data[12:16]
    if chunk == b"VP8 ":  # lossy: 3-byte frame tag, start code, 14-bit dims (+2 scale bits)
        if data[23:26] != b"\x9d\x01\x2a":
            raise UnreadableHeader("WebP VP8 frame has no start code")
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":  # lossless: signature 0x2F, then 14-bit width-1 and height-1
        if data[20] != 0x2F:
            raise UnreadableHeader("WebP VP8L signature is missing")
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended: flags (1) + reserved (3), then 24-bit canvas w-1, h-1
        width, height = (int.from_bytes(data[o : o + 3], "little") + 1 for o in (24, 27))
        if len(data) < 30:
            raise UnreadableHeader("header is truncated")
        return width, height
    raise UnreadableHeader(f"WebP chunk {chunk!r} is unknown")


_SIZE_READERS: dict[str, Callable[[bytes], tuple[int, int]]] = {
    "image/png": _png_size,
    "image/jpeg": _jpeg_size,
    "image/bmp": _bmp_size,
    "image/webp": _webp_size,
}


# --- audio --------------------------------------------------------------------------


def sniff_audio(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or _mpeg_sync(data, 0):
        return "mp3"
    return None


def audio_duration(fmt: str, data: bytes) -> float:
    """Seconds of audio in a file whose magic bytes already matched ``fmt``."""
    return _wav_duration(data) if fmt == "wav" else _mp3_duration(data)


def audio_sample_rate(fmt: str, data: bytes) -> int:
    """Samples per second of a file whose magic bytes already matched ``fmt``. A WAV names
    any rate (1 Hz included, where each byte is a second); an MP3 frame can name only
    8-48 kHz, and this reads its first frame's."""
    return _wav_header(data)[0] if fmt == "wav" else _mp3_sample_rate(data)


def _wav_duration(data: bytes) -> float:
    _, byte_rate, data_size = _wav_header(data)
    if byte_rate == 0:
        raise UnreadableHeader("WAV byte rate is zero")
    return data_size / byte_rate


@_guarded
def _wav_header(data: bytes) -> tuple[int, int, int]:
    """(sample rate, byte rate, data size) of a WAV."""
    # RIFF chunks after "WAVE": FourCC, little-endian size, payload padded to even length.
    # "fmt " gives the rates (the byte rate is correct for PCM and compressed formats alike),
    # "data" the size.
    pos = 12
    rates: tuple[int, int] | None = None
    data_size: int | None = None
    while pos + 8 <= len(data) and (rates is None or data_size is None):
        chunk = data[pos : pos + 4]
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = pos + 8
        if chunk == b"fmt ":
            rates = struct.unpack_from("<II", data, body + 4)
        elif chunk == b"data":
            # Streaming writers leave the size 0 or 0xFFFFFFFF; then the rest of the file
            # is the audio. Never trust a size beyond the bytes actually sent.
            available = len(data) - body
            data_size = size if 0 < size <= available else available
        pos = body + size + (size & 1)
    if rates is None or data_size is None:
        raise UnreadableHeader("WAV has no fmt or data chunk")
    return rates[0], rates[1], data_size


# MPEG audio Layer III only ("mp3"); bitrates in kbit/s by index 1..14.
_L3_KBPS_MPEG1 = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_L3_KBPS_MPEG2 = (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)
_SAMPLE_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mpeg_sync(data: bytes, pos: int) -> bool:
    return data[pos : pos + 1] == b"\xff" and data[pos + 1 : pos + 2] >= b"\xe0"


def _mp3_sample_rate(data: bytes) -> int:
    _, b1, b2, _ = _mp3_first_frame(data)
    return _SAMPLE_RATES[(b1 >> 3) & 3][(b2 >> 2) & 3]


@_guarded
def _mp3_first_frame(data: bytes) -> tuple[int, int, int, int]:
    """(offset, header bytes 1-3) of the first MPEG audio Layer III frame, checked."""
    pos = 0
    if data[:3] == b"ID3":
        # ID3v2: 10-byte header, tag size in four 7-bit "syncsafe" bytes, optional footer.
        size = 0
        for byte in data[6:10]:
            size = size << 7 | (byte & 0x7F)
        pos = 10 + size + (10 if data[5] & 0x10 else 0)
    if not _mpeg_sync(data, pos):
        raise UnreadableHeader("no MPEG audio frame where the first frame should be")
    b1, b2, b3 = data[pos + 1], data[pos + 2], data[pos + 3]
    version = (b1 >> 3) & 3  # 3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5, 1: reserved
    if version == 1 or (b1 >> 1) & 3 != 1:
        raise UnreadableHeader("not MPEG audio Layer III")
    bitrate_index, rate_index = b2 >> 4, (b2 >> 2) & 3
    if bitrate_index in (0, 15) or rate_index == 3:
        raise UnreadableHeader("MP3 frame has a free-format or invalid bitrate or sample rate")
    return pos, b1, b2, b3


@_guarded
def _mp3_duration(data: bytes) -> float:
    pos, b1, b2, b3 = _mp3_first_frame(data)
    version, bitrate_index, rate_index = (b1 >> 3) & 3, b2 >> 4, (b2 >> 2) & 3
    mpeg1, mono = version == 3, b3 >> 6 == 3
    sample_rate = _SAMPLE_RATES[version][rate_index]
    # A Xing/Info tag (LAME and most VBR encoders) counts the frames exactly; it follows
    # the side information, whose size depends on version and channel mode.
    tag = pos + 4 + ((17 if mono else 32) if mpeg1 else (9 if mono else 17))
    if data[tag : tag + 4] in (b"Xing", b"Info"):
        (flags,) = struct.unpack_from(">I", data, tag + 4)
        if flags & 1:
            frames: int = struct.unpack_from(">I", data, tag + 8)[0]
            return frames * (1152 if mpeg1 else 576) / sample_rate
    # Otherwise assume constant bitrate: a VBR file without a tag (or with a Fraunhofer
    # VBRI tag, not read here) is estimated from its first frame, which may be off.
    kbps = (_L3_KBPS_MPEG1 if mpeg1 else _L3_KBPS_MPEG2)[bitrate_index]
    return (len(data) - pos) * 8 / (kbps * 1000)


# --- video --------------------------------------------------------------------------

# Classic QuickTime files may start with a bare atom instead of an ftyp box.
_QUICKTIME_ATOMS = (b"moov", b"mdat", b"wide")
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"
_EBML_DOCTYPES = {"webm": "video/webm", "matroska": "video/x-matroska"}


def sniff_video(data: bytes) -> str | None:
    box = data[4:8]
    if box == b"ftyp":  # ISO BMFF; QuickTime declares the major brand "qt  "
        return "video/quicktime" if data[8:12] == b"qt  " else "video/mp4"
    if box in _QUICKTIME_ATOMS:
        return "video/quicktime"
    if data.startswith(_EBML_MAGIC):
        try:
            return _EBML_DOCTYPES.get(_ebml_doctype(data) or "")
        except UnreadableHeader:
            return None
    return None


def _ebml_vint(data: bytes, pos: int) -> tuple[int, int]:
    """An EBML variable-length integer: leading zero bits give its length in bytes."""
    first = data[pos]
    length = 9 - first.bit_length()
    if length > 8:
        raise UnreadableHeader("EBML integer is invalid")
    value = first & (0xFF >> length)  # drop the length marker bit
    for byte in data[pos + 1 : pos + length]:
        value = value << 8 | byte
    return value, length


@_guarded
def _ebml_doctype(data: bytes) -> str | None:
    # EBML header element: size, then children (ID with its marker bits kept, size, value).
    # DocType (ID 0x4282) says "webm" or "matroska"; nothing past the header is read.
    header_size, n = _ebml_vint(data, 4)
    pos = 4 + n
    end = min(pos + header_size, len(data))
    while pos < end:
        id_length = 9 - data[pos].bit_length()
        if id_length > 4:
            raise UnreadableHeader("EBML element ID is invalid")
        element = int.from_bytes(data[pos : pos + id_length], "big")
        size, n = _ebml_vint(data, pos + id_length)
        pos += id_length + n
        if element == 0x4282:
            return data[pos : pos + size].rstrip(b"\0").decode("ascii", "replace")
        pos += size
    return None
