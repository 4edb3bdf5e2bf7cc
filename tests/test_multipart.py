"""The streaming multipart reader: exact bytes whatever the chunking, bounded everything."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from api.multipart import MAX_PARTS, MultipartError, MultipartReader

CT = "multipart/form-data; boundary=XyZ"


def body(*parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--XyZ\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + b"--XyZ--\r\n"


async def pieces(data: bytes, sizes: list[int]) -> AsyncIterator[bytes]:
    i = 0
    for size in sizes:
        if i >= len(data):
            break
        yield data[i : i + size]
        i += size
    if i < len(data):
        yield data[i:]


async def read_all(data: bytes, sizes: list[int]) -> list[tuple[str, str | None, bytes]]:
    out = []
    async for part in MultipartReader(pieces(data, sizes), CT):
        out.append((part.name, part.filename, b"".join([c async for c in part])))
    return out


@pytest.mark.parametrize("chunking", ["whole", "bytes", "odd", "random"])
async def test_parts_are_exact_however_the_body_is_cut(chunking: str) -> None:
    rng = random.Random(7)
    # Boundary-like bytes inside. What follows them is fixed: after a CR or an LF (1 draw in
    # 128 of random bytes) the boundary would really end the part, as werkzeug accepts bare
    # line ends, and RFC 2046 forbids a delimiter inside the data.
    file_bytes = rng.randbytes(200_000) + b"\r\n--XyZx" + rng.randbytes(1000) + b"\r\n--Xy"
    data = body(("purpose", None, b"user_data"), ("file", "a.wav", file_bytes))
    sizes = {
        "whole": [len(data)],
        "bytes": [1] * 300 + [len(data)],
        "odd": [7, 13, 65537, 3] * 10,
        "random": [rng.randint(1, 70_000) for _ in range(200)],
    }[chunking]
    assert await read_all(data, sizes) == [("purpose", None, b"user_data"), ("file", "a.wav", file_bytes)]


async def test_an_unread_part_is_skipped() -> None:
    data = body(("a", None, b"skip me"), ("b", None, b"keep"))
    names = []
    async for part in MultipartReader(pieces(data, [5] * 100), CT):
        names.append(part.name)
        if part.name == "b":
            assert await part.text() == "keep"
    assert names == ["a", "b"]


@pytest.mark.parametrize(
    "content_type",
    [None, "", "application/json", "multipart/form-data", "multipart/form-data; boundary=" + "b" * 71,
     "multipart/mixed; boundary=XyZ", "multipart/form-data; boundary=ü"],
)  # fmt: skip
def test_content_types_without_a_usable_boundary_are_refused(content_type: str | None) -> None:
    with pytest.raises(MultipartError):
        MultipartReader(pieces(b"", []), content_type)


async def test_too_many_parts_are_refused() -> None:
    data = body(*[(f"f{i}", None, b"x") for i in range(MAX_PARTS + 1)])
    with pytest.raises(MultipartError):
        await read_all(data, [len(data)])


async def test_a_field_is_bounded_and_must_be_text() -> None:
    with pytest.raises(MultipartError):
        async for part in MultipartReader(pieces(body(("purpose", None, b"x" * 5000)), [1000] * 10), CT):
            await part.text()
    with pytest.raises(MultipartError):
        async for part in MultipartReader(pieces(body(("purpose", None, b"\xff\xfe")), [100]), CT):
            await part.text()


async def test_truncated_bodies_are_refused() -> None:
    data = body(("file", "a", b"y" * 10_000))
    for cut in (10, 60, 5000, len(data) - 5):
        with pytest.raises(MultipartError):
            await read_all(data[:cut], [1000] * 20)
