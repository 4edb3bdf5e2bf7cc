"""Multimodal content validation: header readers on hand-built files, limits, error envelopes.

Every file here is built byte by byte with struct/zlib/wave, so the tests need no image or
audio library; the readers were also cross-checked once against Pillow, LAME and ffmpeg output.
"""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib
from typing import Any

import pytest

from api.chat_request import ChatRequest, parse_chat_request
from api.content import AudioPart, ImagePart, Modality, TextPart, VideoPart
from api.errors import MediaCode, MediaError
from api.limits import MIB, RequestLimits
from api.media import require_modalities
from api.media_headers import (
    UnreadableHeader,
    audio_duration,
    image_size,
    sniff_audio,
    sniff_image,
    sniff_video,
)

# --- tiny real files ------------------------------------------------------------------


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload)
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png(w: int, h: int, *, pixels: bool = True) -> bytes:
    """A valid RGB PNG; without pixels only IHDR+IEND (big sizes stay cheap to build)."""
    ihdr = _png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    idat = _png_chunk(b"IDAT", zlib.compress(b"\0" * ((1 + 3 * w) * h))) if pixels else b""
    return b"\x89PNG\r\n\x1a\n" + ihdr + idat + _png_chunk(b"IEND", b"")


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def jpeg(w: int, h: int, *, sof: int = 0xC0, exif: int = 0) -> bytes:
    """SOI, JFIF APP0, an optional large APP1, DQT, SOF, a fill byte, SOS, EOI."""
    app0 = _segment(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0")
    app1 = _segment(0xE1, b"Exif\0\0" + b"\xff" * exif) if exif else b""
    dqt = _segment(0xDB, b"\0" + bytes(64))
    frame = _segment(sof, struct.pack(">BHHB", 8, h, w, 3) + b"\x01\x11\x00" * 3)
    sos = _segment(0xDA, b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00")
    return b"\xff\xd8" + app0 + app1 + dqt + b"\xff" + frame + sos + b"\x00" * 4 + b"\xff\xd9"


def bmp(w: int, h: int, *, core: bool = False) -> bytes:
    if core:
        dib = struct.pack("<IHHHH", 12, w, h, 1, 24)
    else:
        dib = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, 0, 2835, 2835, 0, 0)
    pixels = b"\0" * 4
    header = struct.pack("<2sIHHI", b"BM", 14 + len(dib) + len(pixels), 0, 0, 14 + len(dib))
    return header + dib + pixels


def _riff(form: bytes, chunks: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + form + chunks


def webp(w: int, h: int, kind: str) -> bytes:
    if kind == "VP8 ":
        payload = b"\x10\x02\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", w, h) + bytes(8)
    elif kind == "VP8L":
        payload = b"\x2f" + struct.pack("<I", (w - 1) | (h - 1) << 14) + bytes(4)
    else:  # VP8X: flags, reserved, 24-bit canvas size minus one
        payload = b"\x10\0\0\0" + (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    return _riff(b"WEBP", kind.encode() + struct.pack("<I", len(payload)) + payload)


def wav(seconds: float, rate: int = 1000) -> bytes:
    """Real PCM written by the stdlib; 8-bit mono at a low rate keeps long clips small."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(rate)
        w.writeframes(b"\x80" * round(seconds * rate))
    return buf.getvalue()


# MPEG-1 Layer III, 128 kbit/s, 44.1 kHz, joint stereo, no CRC: a frame is 417 bytes.
MP3_FRAME_HEADER = b"\xff\xfb\x90\x44"
MP3_FRAME = MP3_FRAME_HEADER + bytes(413)


def id3(size: int = 20) -> bytes:
    syncsafe = bytes((size >> s) & 0x7F for s in (21, 14, 7, 0))
    return b"ID3\x04\x00\x00" + syncsafe + bytes(size)


def mp3_cbr(frames: int, *, tag: bool = True) -> bytes:
    return (id3() if tag else b"") + MP3_FRAME * frames


def mp3_xing(frame_count: int) -> bytes:
    """One Info frame (the Xing tag sits after 32 bytes of stereo side info) and one frame."""
    body = bytes(32) + b"Info" + struct.pack(">II", 1, frame_count)
    return id3() + MP3_FRAME_HEADER + body + bytes(413 - len(body)) + MP3_FRAME


def ftyp(brand: bytes) -> bytes:
    return struct.pack(">I4s4sI", 24, b"ftyp", brand, 0x200) + brand + b"mp41" + bytes(16)


def ebml(doctype: bytes) -> bytes:
    # EBMLVersion 1, then DocType, in an EBML header element of one-byte vint size.
    children = b"\x42\x86\x81\x01" + b"\x42\x82" + bytes([0x80 | len(doctype)]) + doctype
    return b"\x1a\x45\xdf\xa3" + bytes([0x80 | len(children)]) + children + bytes(16)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{b64(data)}"


def image(mime: str, data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(mime, data)}}


def audio(fmt: str, data: bytes) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def frames(*stamps: float, data: bytes | None = None) -> dict[str, Any]:
    url = data_url("image/png", data or png(2, 2))
    items = [{"image_url": {"url": url}, "timestamp_ms": t} for t in stamps]
    return {"type": "input_video", "input_video": {"frames": items}}


def video_file(mime: str, data: bytes) -> dict[str, Any]:
    return {"type": "input_video", "input_video": {"file": data_url(mime, data)}}


def parse(*parts: Any, limits: RequestLimits | None = None, role: str = "user") -> ChatRequest:
    body = {"model": "m", "messages": [{"role": role, "content": list(parts)}]}
    return parse_chat_request(body, limits or RequestLimits())


def refused(*parts: Any, limits: RequestLimits | None = None, role: str = "user") -> MediaError:
    with pytest.raises(MediaError) as info:
        parse(*parts, limits=limits, role=role)
    return info.value


# --- header readers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "mime", "size"),
    [
        (png(3, 2), "image/png", (3, 2)),
        (jpeg(640, 480), "image/jpeg", (640, 480)),
        (jpeg(17, 9, sof=0xC2), "image/jpeg", (17, 9)),  # progressive
        (jpeg(800, 600, exif=60_000), "image/jpeg", (800, 600)),  # SOF after a big APP1
        (bmp(5, 7), "image/bmp", (5, 7)),
        (bmp(5, -7), "image/bmp", (5, 7)),  # top-down rows
        (bmp(300, 200, core=True), "image/bmp", (300, 200)),
        (webp(321, 123, "VP8 "), "image/webp", (321, 123)),
        (webp(16383, 2, "VP8L"), "image/webp", (16383, 2)),
        (webp(20000, 30000, "VP8X"), "image/webp", (20000, 30000)),
    ],
)
def test_image_headers(data: bytes, mime: str, size: tuple[int, int]) -> None:
    assert sniff_image(data) == mime
    assert image_size(mime, data) == size


@pytest.mark.parametrize(
    ("mime", "data"),
    [
        ("image/png", png(3, 2)[:20]),
        ("image/jpeg", jpeg(4, 4)[:30]),
        ("image/jpeg", b"\xff\xd8\xff\xda\x00\x02"),  # scan data before any frame header
        ("image/bmp", b"BM" + bytes(12) + struct.pack("<I", 8) + bytes(8)),
        ("image/webp", webp(4, 4, "VP8 ")[:24]),
        ("image/webp", _riff(b"WEBP", b"ALPH" + bytes(12))),
    ],
)
def test_image_header_unreadable(mime: str, data: bytes) -> None:
    with pytest.raises(UnreadableHeader):
        image_size(mime, data)


def test_audio_headers() -> None:
    assert sniff_audio(wav(2.5)) == "wav"
    assert audio_duration("wav", wav(2.5)) == pytest.approx(2.5)
    assert audio_duration("wav", wav(1, rate=44100)) == pytest.approx(1)
    for data in (mp3_cbr(10), mp3_cbr(10, tag=False), mp3_xing(100)):
        assert sniff_audio(data) == "mp3"
    # CBR: 10 frames of 1152 samples at 44.1 kHz; the estimate uses bytes / bitrate.
    assert audio_duration("mp3", mp3_cbr(10)) == pytest.approx(10 * 417 * 8 / 128_000)
    assert audio_duration("mp3", mp3_xing(1000)) == pytest.approx(1000 * 1152 / 44100)


def test_wav_streaming_size_falls_back_to_the_bytes_sent() -> None:
    data = bytearray(wav(2.0))
    data[40:44] = struct.pack("<I", 0xFFFFFFFF)  # the data chunk's size, as a live writer leaves it
    assert audio_duration("wav", bytes(data)) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("fmt", "data"),
    [
        ("wav", _riff(b"WAVE", b"LIST" + struct.pack("<I", 4) + b"INFO")),  # no fmt/data
        ("mp3", id3() + b"\x00" * 8),  # no frame after the tag
        ("mp3", b"\xff\xfd\x90\x44" + bytes(100)),  # Layer II, not an mp3
        ("mp3", b"\xff\xfb\x00\x44" + bytes(100)),  # free-format bitrate
    ],
)
def test_audio_header_unreadable(fmt: str, data: bytes) -> None:
    with pytest.raises(UnreadableHeader):
        audio_duration(fmt, data)


@pytest.mark.parametrize(
    ("data", "mime"),
    [
        (ftyp(b"isom"), "video/mp4"),
        (ftyp(b"mp42"), "video/mp4"),
        (ftyp(b"qt  "), "video/quicktime"),
        (struct.pack(">I4s", 8, b"moov") + bytes(16), "video/quicktime"),
        (ebml(b"webm"), "video/webm"),
        (ebml(b"matroska"), "video/x-matroska"),
        (ebml(b"other"), None),
        (b"\x1a\x45\xdf\xa3\x00", None),  # invalid vint: not a container we know
        (b"GIF89a" + bytes(20), None),
    ],
)
def test_video_sniffing(data: bytes, mime: str | None) -> None:
    assert sniff_video(data) == mime


# --- parts through parse_chat_request -------------------------------------------------


def test_every_modality_parses_into_typed_parts() -> None:
    request = parse(
        {"type": "text", "text": "compare"},
        image("image/png", png(4, 3)),
        image("image/jpg", jpeg(10, 20)),  # common alias for image/jpeg
        audio("wav", wav(1.5)),
        audio("MP3", mp3_cbr(5)),
        frames(0, 1000, 1000),
        video_file("video/webm", ebml(b"webm")),
    )
    text, png_part, jpeg_part, wav_part, mp3_part, video, file = request.messages[0].parts
    assert text == TextPart("compare")
    assert isinstance(png_part, ImagePart)
    assert (png_part.mime, png_part.width, png_part.height) == ("image/png", 4, 3)
    assert png_part.data == png(4, 3)
    assert isinstance(jpeg_part, ImagePart) and jpeg_part.mime == "image/jpeg"
    assert isinstance(wav_part, AudioPart) and wav_part.duration_s == pytest.approx(1.5)
    assert isinstance(mp3_part, AudioPart) and mp3_part.format == "mp3"
    assert isinstance(video, VideoPart) and [f.timestamp_ms for f in video.frames] == [
        0,
        1000,
        1000,
    ]
    assert isinstance(file, VideoPart) and file.file is not None and file.file.mime == "video/webm"
    assert request.modalities() == {"text", "image", "audio", "video_frames", "video_file"}
    assert "data=" not in repr(png_part)  # bytes stay out of logs


def test_bare_string_image_url_and_unpadded_base64_are_accepted() -> None:
    url = data_url("image/png", png(1, 1)).rstrip("=")
    request = parse({"type": "image_url", "image_url": url})
    part = request.messages[0].parts[0]
    assert isinstance(part, ImagePart) and part.data == png(1, 1)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("https://example.com/cat.png", "remote URLs are disabled"),
        ("http://127.0.0.1/cat.png", "remote URLs are disabled"),
        ("file:///etc/passwd", "local paths"),
        ("/home/me/cat.png", "local paths"),
        (b64(png(1, 1)), "local paths"),  # bare base64 is not a data URL either
    ],
)
def test_non_data_urls_are_refused(url: str, fragment: str) -> None:
    err = refused({"type": "image_url", "image_url": {"url": url}})
    assert err.code is MediaCode.UNSUPPORTED_MEDIA_SOURCE
    assert fragment in err.message and "data URL" in err.message
    assert err.param == "messages[0].content[0].image_url.url"
    assert err.status == 400


def test_declared_mime_must_match_magic_bytes() -> None:
    err = refused({"type": "text", "text": "x"}, image("image/png", jpeg(2, 2)))
    assert err.code is MediaCode.INVALID_MEDIA
    assert err.message == "declared image/png but the data is image/jpeg"
    assert err.param == "messages[0].content[1].image_url.url"
    assert refused(audio("wav", mp3_cbr(3))).message == "declared wav but the data is mp3"
    err = refused(video_file("video/mp4", ebml(b"webm")))
    assert (err.code, err.param) == (
        MediaCode.INVALID_MEDIA,
        "messages[0].content[0].input_video.file",
    )
    assert refused(video_file("video/webm", ebml(b"matroska"))).code is MediaCode.INVALID_MEDIA
    assert refused(video_file("video/quicktime", ftyp(b"isom"))).code is MediaCode.INVALID_MEDIA
    assert "not a recognized image" in refused(image("image/bmp", b"GIF89a" + bytes(30))).message


@pytest.mark.parametrize(
    ("part", "code", "param"),
    [
        (image("image/gif", b"GIF89a"), MediaCode.UNSUPPORTED_MEDIA_TYPE, ".image_url.url"),
        (image("image/svg+xml", b"<svg/>"), MediaCode.UNSUPPORTED_MEDIA_TYPE, ".image_url.url"),
        (video_file("video/avi", b"RIFF"), MediaCode.UNSUPPORTED_MEDIA_TYPE, ".input_video.file"),
        (audio("flac", b"fLaC"), MediaCode.UNSUPPORTED_MEDIA_TYPE, ".input_audio.format"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png,abc"}},
            MediaCode.INVALID_MEDIA,
            ".image_url.url",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64"}},
            MediaCode.INVALID_MEDIA,
            ".image_url.url",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}},
            MediaCode.INVALID_MEDIA,
            ".image_url.url",
        ),
        ({"type": "image_url", "image_url": {"url": 7}}, MediaCode.INVALID_MEDIA, ".image_url.url"),
        ({"type": "image_url"}, MediaCode.INVALID_MEDIA, ".image_url"),
        (
            {
                "type": "input_audio",
                "input_audio": {"format": "wav", "data": "data:audio/wav;base64,AA"},
            },
            MediaCode.INVALID_MEDIA,
            ".input_audio.data",
        ),
        (
            {"type": "input_audio", "input_audio": {"format": "wav", "data": "https://x/a.wav"}},
            MediaCode.UNSUPPORTED_MEDIA_SOURCE,
            ".input_audio.data",
        ),
        (
            {"type": "input_audio", "input_audio": {"format": "wav"}},
            MediaCode.INVALID_MEDIA,
            ".input_audio.data",
        ),
        ({"type": "file", "file": {}}, MediaCode.INVALID_MEDIA, ".type"),
        ({"type": ["x"]}, MediaCode.INVALID_MEDIA, ".type"),  # unhashable: was a 500
        ({"type": {"image_url": 1}}, MediaCode.INVALID_MEDIA, ".type"),
        ({"text": "no type"}, MediaCode.INVALID_MEDIA, ".type"),
        ("just a string", MediaCode.INVALID_MEDIA, ""),
        (image("image/png", png(3, 2)[:20]), MediaCode.INVALID_MEDIA, ".image_url.url"),
        (image("image/png", png(0, 5, pixels=False)), MediaCode.INVALID_MEDIA, ".image_url.url"),
        (audio("mp3", id3() + bytes(8)), MediaCode.INVALID_MEDIA, ".input_audio.data"),
    ],
)
def test_malformed_parts(part: Any, code: MediaCode, param: str) -> None:
    err = refused(part)
    assert (err.code, err.param, err.status) == (code, "messages[0].content[0]" + param, 400)


def test_video_takes_frames_or_file_never_both() -> None:
    both = {
        "frames": frames(0)["input_video"]["frames"],
        "file": data_url("video/mp4", ftyp(b"isom")),
    }
    payloads: list[dict[str, Any]] = [both, {}, {"frames": []}, {"frames": "x"}]
    for payload in payloads:
        err = refused({"type": "input_video", "input_video": payload})
        assert err.code is MediaCode.INVALID_MEDIA
    assert "never both" in refused({"type": "input_video", "input_video": both}).message


def test_video_frames_must_not_go_back_in_time() -> None:
    err = refused(frames(0, 500, 499))
    assert err.code is MediaCode.INVALID_MEDIA
    assert err.param == "messages[0].content[0].input_video.frames[2].timestamp_ms"
    bad_stamps: list[Any] = [-1, "0", None, True]
    for bad in bad_stamps:
        assert str(refused(frames(bad)).param).endswith("frames[0].timestamp_ms")


def test_media_only_from_the_user() -> None:
    err = refused(image("image/png", png(1, 1)), role="system")
    assert (err.code, err.param) == (MediaCode.INVALID_MEDIA, "messages[0].content[0]")
    assert parse({"type": "text", "text": "ok"}, role="system").messages[0].parts == (
        TextPart("ok"),
    )


# --- limits ---------------------------------------------------------------------------


def test_default_limits_are_the_spec_numbers() -> None:
    limits = RequestLimits()
    assert (limits.max_body_bytes, limits.max_item_bytes, limits.max_total_media_bytes) == (
        24 * MIB,
        8 * MIB,
        16 * MIB,
    )
    assert (limits.max_content_parts, limits.max_media_items, limits.max_frames_per_video) == (
        64,
        16,
        16,
    )
    assert limits.max_decoded_frames_per_file == 240
    assert (limits.max_image_pixels, limits.max_total_pixels) == (16_000_000, 32_000_000)
    assert limits.max_audio_seconds == 300


def test_counts_are_limits_with_400() -> None:
    text = {"type": "text", "text": "x"}
    parse(*[text] * 64)
    err = refused(*[text] * 65)
    assert (err.code, err.status, err.param) == (
        MediaCode.TOO_MANY_PARTS,
        400,
        "messages[0].content[64]",
    )
    one = image("image/png", png(1, 1))
    parse(*[one] * 16)
    err = refused(*[one] * 17)
    assert (err.code, err.status, err.param) == (
        MediaCode.TOO_MANY_MEDIA,
        400,
        "messages[0].content[16]",
    )
    parse(frames(*range(16)))
    err = refused(frames(*range(17)))
    assert (err.code, err.param) == (
        MediaCode.TOO_MANY_PARTS,
        "messages[0].content[0].input_video.frames",
    )


def test_counts_span_all_messages() -> None:
    one = image("image/png", png(1, 1))
    body = {"model": "m", "messages": [{"role": "user", "content": [one] * 9}] * 2}
    with pytest.raises(MediaError) as info:
        parse_chat_request(body, RequestLimits())
    assert info.value.param == "messages[1].content[7]"


def test_byte_limits_are_413_and_checked_before_decoding() -> None:
    limits = RequestLimits(max_item_bytes=1000, max_total_media_bytes=1500)
    parse(image("image/bmp", bmp(1, 1) + bytes(1000 - 62)), limits=limits)
    err = refused(image("image/png", bytes(1001)), limits=limits)  # not even a PNG: never decoded
    assert (err.code, err.status) == (MediaCode.MEDIA_TOO_LARGE, 413)
    assert err.param == "messages[0].content[0].image_url.url"
    garbage = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "!" * 1400}}
    assert refused(garbage, limits=limits).code is MediaCode.MEDIA_TOO_LARGE
    err = refused(audio("wav", wav(0.8)), audio("wav", wav(0.8)), limits=limits)
    assert (err.code, err.param) == (
        MediaCode.MEDIA_TOO_LARGE,
        "messages[0].content[1].input_audio.data",
    )
    # A count error wins over a broken item earlier in the request: counts come first.
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}
    assert refused(broken, *[image("image/png", png(1, 1))] * 16).code is MediaCode.TOO_MANY_MEDIA


def test_pixel_limits() -> None:
    parse(image("image/png", png(4000, 4000, pixels=False)))
    err = refused(image("image/png", png(4001, 4000, pixels=False)))
    assert (err.code, err.status) == (MediaCode.MEDIA_TOO_LARGE, 413)
    assert "per image" in err.message
    big = image("image/webp", webp(4000, 4000, "VP8X"))
    parse(big, big)
    err = refused(big, big, image("image/bmp", bmp(1, 1)))
    assert err.param == "messages[0].content[2].image_url.url"
    # Video frames count toward the total as images do.
    err = refused(big, big, frames(0, data=png(1, 1, pixels=False)))
    assert err.param == "messages[0].content[2].input_video.frames[0].image_url.url"


def test_audio_duration_limit() -> None:
    parse(audio("wav", wav(300)))
    err = refused(audio("wav", wav(301)))
    assert (err.code, err.status) == (MediaCode.MEDIA_TOO_LARGE, 413)
    long_mp3 = mp3_xing(round(301 * 44100 / 1152))
    assert refused(audio("mp3", long_mp3)).code is MediaCode.MEDIA_TOO_LARGE


# --- modalities -----------------------------------------------------------------------


def test_require_modalities() -> None:
    request = parse({"type": "text", "text": "x"}, image("image/png", png(1, 1)))
    require_modalities(request, {"text", "image"})
    require_modalities(request, [Modality.IMAGE])  # text needs no declaring
    with pytest.raises(MediaError) as info:
        require_modalities(request, {"text"})
    err = info.value
    assert (err.code, err.status, err.param) == (
        MediaCode.UNSUPPORTED_MODALITY,
        400,
        "messages[0].content[1]",
    )
    assert err.body() == {
        "error": {
            "message": "unsupported modality: image; model 'm' accepts text",
            "type": "unsupported_modality",
            "param": "messages[0].content[1]",
            "code": "unsupported_modality",
        }
    }


def test_video_file_without_ffmpeg_says_to_send_frames() -> None:
    request = parse(video_file("video/mp4", ftyp(b"isom")))
    with pytest.raises(MediaError) as info:
        require_modalities(request, {"image", "video_frames"})
    assert "ffmpeg" in info.value.message and "frames" in info.value.message
    require_modalities(parse(frames(0)), {"video_frames"})
