"""``/v1/files`` with the official ``openai`` SDK, and what the SDK would never send."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
import trio
from artifact_api_helpers import raw_http, serve_store

from api.limits import RequestLimits


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=90)


async def in_thread(fn):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(fn)


async def test_openai_sdk_files_round_trip(tmp_path: Path) -> None:
    data = os.urandom(200_000)
    async with serve_store(tmp_path) as (base, _):
        sdk = client(base)
        created = await in_thread(lambda: sdk.files.create(file=("my-voice.wav", data, "audio/wav"), purpose="user_data"))
        assert created.object == "file" and created.bytes == len(data)
        assert created.filename == "my-voice.wav" and created.purpose == "user_data"
        listed = await in_thread(lambda: list(sdk.files.list()))
        assert [f.id for f in listed] == [created.id]
        assert (await in_thread(lambda: sdk.files.retrieve(created.id))).bytes == len(data)
        content = await in_thread(lambda: sdk.files.content(created.id))
        assert content.read() == data
        # a file is an artifact: same id, same bytes, kind uploaded, filename and purpose shown
        meta = await in_thread(lambda: httpx.get(f"{base}/v1/artifacts/{created.id}/meta").json())
        assert meta["kind"] == "uploaded" and meta["filename"] == "my-voice.wav" and meta["purpose"] == "user_data"
        assert meta["media_type"] == "audio/wav"
        deleted = await in_thread(lambda: sdk.files.delete(created.id))
        assert deleted.deleted is True and deleted.id == created.id
        with pytest.raises(openai.NotFoundError):
            await in_thread(lambda: sdk.files.retrieve(created.id))
        with pytest.raises(openai.NotFoundError):
            await in_thread(lambda: sdk.files.content(created.id))
        with pytest.raises(openai.NotFoundError):
            await in_thread(lambda: sdk.files.delete(created.id))


async def test_purposes_are_validated(tmp_path: Path) -> None:
    async with serve_store(tmp_path) as (base, _):
        sdk = client(base)
        for purpose in ["assistants", "user_data", "vision"]:
            await in_thread(lambda p=purpose: sdk.files.create(file=("a.png", b"\x89PNG", "image/png"), purpose=p))
        for purpose in ["fine-tune", "batch", "evals", "nonsense"]:
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(lambda p=purpose: sdk.files.create(file=("a.jsonl", b"{}", "application/jsonl"), purpose=p))
            assert purpose in str(info.value.body)
        names = await in_thread(lambda: [f.purpose for f in sdk.files.list(purpose="vision")])
        assert names == ["vision"]
        # nothing was stored for the refused uploads
        assert len(await in_thread(lambda: list(sdk.files.list()))) == 3
        assert not any((tmp_path / "artifacts" / "tmp").iterdir())


async def test_listing_pages_with_the_sdk_cursor(tmp_path: Path) -> None:
    async with serve_store(tmp_path) as (base, _):
        sdk = client(base)
        ids = [
            (await in_thread(lambda i=i: sdk.files.create(file=(f"{i}.txt", b"x", "text/plain"), purpose="user_data"))).id
            for i in range(5)
        ]
        walked = await in_thread(lambda: [f.id for f in sdk.files.list(limit=2)])  # auto-pages with `after`
        assert sorted(walked) == sorted(ids) and len(walked) == 5
        first = await in_thread(lambda: sdk.files.list(limit=2))
        assert first.has_more is True and len(first.data) == 2
        ascending = await in_thread(lambda: [f.id for f in sdk.files.list(order="asc")])
        assert ascending == list(reversed(walked))
        # a native artifact is not a Files-API upload: not listed, but readable as a file
        native = (await in_thread(lambda: httpx.post(f"{base}/v1/artifacts", content=b"raw"))).json()["id"]
        assert native not in await in_thread(lambda: [f.id for f in sdk.files.list()])
        assert (await in_thread(lambda: sdk.files.retrieve(native))).filename == native


async def test_downloads_are_inert_attachments(tmp_path: Path) -> None:
    async with serve_store(tmp_path) as (base, _):
        sdk = client(base)
        for filename, media_type, served in [
            ("page.html", "text/html", "application/octet-stream"),
            ("pic.svg", "image/svg+xml", "application/octet-stream"),
            ("clip.wav", "audio/wav", "audio/wav"),
            ("notes.txt", "text/plain", "text/plain; charset=utf-8"),
        ]:
            created = await in_thread(lambda f=filename, m=media_type: sdk.files.create(file=(f, b"<b>hi</b>", m), purpose="user_data"))
            response = await in_thread(lambda c=created: httpx.get(f"{base}/v1/files/{c.id}/content"))
            assert response.status_code == 200 and response.content == b"<b>hi</b>"
            assert response.headers["content-type"] == served, filename
            assert response.headers["x-content-type-options"] == "nosniff"
            assert response.headers["content-disposition"].startswith("attachment; ")


async def test_filenames_cannot_escape_or_inject(tmp_path: Path) -> None:
    async with serve_store(tmp_path) as (base, _):
        sdk = client(base)
        for hostile, shown in [("../../../etc/passwd", "passwd"), ("..\\..\\win.ini", "win.ini"), ("..", "file"),
                               ('evil"\r\nSet-Cookie: a=b.wav', None), ("ünï cødé.wav", "ünï cødé.wav")]:  # fmt: skip
            created = await in_thread(lambda h=hostile: sdk.files.create(file=(h, b"data", "audio/wav"), purpose="user_data"))
            assert created.filename == shown or (shown is None and "\r" not in created.filename)
            response = await in_thread(lambda c=created: httpx.get(f"{base}/v1/files/{c.id}/content"))
            assert "set-cookie" not in response.headers and "\r" not in response.headers["content-disposition"]
        assert not (tmp_path / "etc").exists() and not (tmp_path.parent / "win.ini").exists()
        assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == ["index.db", "index.db-shm", "index.db-wal", "objects", "tmp"]


async def test_malformed_uploads_are_400(tmp_path: Path) -> None:
    async with serve_store(tmp_path) as (base, _):
        url = f"{base}/v1/files"

        def post(**kwargs: object) -> httpx.Response:
            return httpx.post(url, timeout=30, **kwargs)  # type: ignore[arg-type]

        cases = [
            dict(data={"purpose": "user_data"}),  # no file
            dict(files={"file": ("a.wav", b"x", "audio/wav")}),  # no purpose
            dict(content=b"purpose=user_data", headers={"Content-Type": "application/x-www-form-urlencoded"}),
            dict(content=b"{}", headers={"Content-Type": "application/json"}),
            dict(content=b"garbage", headers={"Content-Type": "multipart/form-data; boundary=xyz"}),
            dict(content=b"--xyz\r\nNo-Disposition: 1\r\n\r\nx\r\n--xyz--\r\n", headers={"Content-Type": "multipart/form-data; boundary=xyz"}),
            dict(content=b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n" + b"x" * 1000,
                 headers={"Content-Type": "multipart/form-data; boundary=xyz"}),  # ends mid-part
            dict(content=b"--xyz\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n" + b"u" * 10_000 + b"\r\n--xyz--\r\n",
                 headers={"Content-Type": "multipart/form-data; boundary=xyz"}),  # a field too long
            dict(content=b"--xyz\r\nX: " + b"h" * 200_000 + b"\r\n\r\n",
                 headers={"Content-Type": "multipart/form-data; boundary=xyz"}),  # endless part headers
            dict(files={"file": ("a.wav", b"x", "audio/wav"), "other": ("b", b"y")}, data={"purpose": "user_data"}),
            dict(files={"file": ("a.wav", b"x", "not a type")}, data={"purpose": "user_data"}),
        ]  # fmt: skip
        for i, kwargs in enumerate(cases):
            response = await in_thread(lambda k=kwargs: post(**k))
            assert response.status_code == 400, (i, response.text)
            assert isinstance(response.json()["error"], str)
        assert (await in_thread(lambda: httpx.get(f"{base}/v1/files"))).json()["data"] == []
        assert not any((tmp_path / "artifacts" / "tmp").iterdir())


async def test_a_truncated_upload_says_so_and_keeps_nothing(tmp_path: Path) -> None:
    """A body that stops before its closing boundary (inside the file, or after whole parts)
    was a 400 naming the decoder's state ("cannot parse beyond State.PART"); it now says the
    body is truncated, as transcriptions do (one reader, ``api.multipart``), and the file
    written meanwhile is dropped."""
    whole = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
             b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n' + b"d" * 300_000 + b"\r\n--b--\r\n")  # fmt: skip
    async with serve_store(tmp_path) as (base, _):
        headers = {"Content-Type": "multipart/form-data; boundary=b"}
        for cut in (whole[:200_000], whole[: whole.rindex(b"--b--")], whole[: whole.rindex(b"\r\n--b--")]):
            response = await in_thread(lambda c=cut: httpx.post(f"{base}/v1/files", content=c, headers=headers))
            assert response.status_code == 400 and "truncated" in response.json()["error"], response.text
        assert (await in_thread(lambda: httpx.get(f"{base}/v1/files"))).json()["data"] == []
        assert not any((tmp_path / "artifacts" / "tmp").iterdir())
        assert not any((tmp_path / "artifacts" / "objects").iterdir())


async def test_control_characters_leave_filenames(tmp_path: Path) -> None:
    body = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a\x07b\x1b[31m.wav"\r\n\r\ndata\r\n--b--\r\n')  # fmt: skip
    async with serve_store(tmp_path) as (base, _):
        headers = {"Content-Type": "multipart/form-data; boundary=b"}
        created = await in_thread(lambda: httpx.post(f"{base}/v1/files", content=body, headers=headers))
        assert created.status_code == 201 and created.json()["filename"] == "ab[31m.wav"


async def test_purpose_after_the_file_is_checked_before_anything_is_kept(tmp_path: Path) -> None:
    body = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
            + b"w" * 300_000 + b"\r\n--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--b--\r\n")  # fmt: skip
    async with serve_store(tmp_path) as (base, _):
        headers = {"Content-Type": "multipart/form-data; boundary=b"}
        refused = await in_thread(lambda: httpx.post(f"{base}/v1/files", content=body, headers=headers))
        assert refused.status_code == 400 and "batch" in refused.json()["error"]
        ok = await in_thread(lambda: httpx.post(f"{base}/v1/files", content=body.replace(b"batch", b"vision"), headers=headers))
        assert ok.status_code == 201 and ok.json()["purpose"] == "vision" and ok.json()["bytes"] == 300_000
        listed = (await in_thread(lambda: httpx.get(f"{base}/v1/files"))).json()["data"]
        assert [f["id"] for f in listed] == [ok.json()["id"]]


async def test_file_cap_is_413(tmp_path: Path) -> None:
    async with serve_store(tmp_path, limits=RequestLimits(max_file_bytes=50_000)) as (base, _):
        sdk = client(base)
        with pytest.raises(openai.APIStatusError) as info:
            await in_thread(lambda: sdk.files.create(file=("big.wav", b"x" * 50_001, "audio/wav"), purpose="user_data"))
        assert info.value.status_code == 413
        lying = b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: 99999999999\r\n\r\n"
        assert (await in_thread(lambda: raw_http(base, lying))).startswith(b"HTTP/1.1 413")
        await in_thread(lambda: sdk.files.create(file=("ok.wav", b"x" * 50_000, "audio/wav"), purpose="user_data"))


async def test_unknown_and_malformed_file_ids(tmp_path: Path) -> None:
    async with serve_store(tmp_path) as (base, store):
        sdk = client(base)
        with pytest.raises(openai.NotFoundError):
            await in_thread(lambda: sdk.files.retrieve("1deaf021-07a3-407c-9d6f-1af47c23db18"))
        with pytest.raises(openai.BadRequestError):
            await in_thread(lambda: sdk.files.retrieve("file-abc123"))
        with pytest.raises(openai.BadRequestError):
            await in_thread(lambda: sdk.files.list(after="not-an-id"))
        with pytest.raises(openai.BadRequestError):  # OpenAI's range is 1-10000
            await in_thread(lambda: sdk.files.list(limit=10_001))
        async with store.begin(kind="generated", pending=True) as writer:
            response = await in_thread(lambda: httpx.get(f"{base}/v1/files/{writer.id}/content"))
            assert response.status_code == 409
            assert (await in_thread(lambda: sdk.files.retrieve(writer.id))).status == "uploaded"
            await writer.abort()


async def test_file_content_ranges_clamp_past_the_end(tmp_path: Path) -> None:
    data = os.urandom(1000)
    async with serve_store(tmp_path) as (base, _):
        sdk = client(base)
        created = await in_thread(lambda: sdk.files.create(file=("a.bin", data, "application/octet-stream"), purpose="user_data"))
        url = f"{base}/v1/files/{created.id}/content"
        part = await in_thread(lambda: httpx.get(url, headers={"Range": "bytes=990-2000"}))
        assert part.status_code == 206 and part.content == data[990:]
        assert part.headers["content-range"] == "bytes 990-999/1000"
        refused = await in_thread(lambda: httpx.get(url, headers={"Range": "bytes=1000-2000"}))
        assert refused.status_code == 416 and refused.headers["content-range"] == "bytes */1000"
