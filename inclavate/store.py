"""The model store: verified GGUF files under ``$INCLAVATE_HOME/models``.

Layout, one directory per model id (``:`` becomes ``@``, which ids cannot contain)::

    models/smollm2@135m/model.gguf        only ever a file whose hash was checked
    models/smollm2@135m/verified.json     sha256, size and mtime_ns of that check
    models/smollm2@135m/model.gguf.part   a download in progress (resumable over HTTP)

The invariant that makes every reader simple: a file reaches ``model.gguf`` only by an
atomic ``os.replace`` after its hash matched, so a crash, a full disk or a bad mirror can
leave a ``.part`` behind but never a wrong or half file at the final path. ``verified.json``
lets later checks trust the file without re-hashing gigabytes: it matches as long as the
file's size and mtime_ns are unchanged (an in-place edit changes the mtime; a deliberate
edit that restores the mtime is out of scope). A stale or missing marker costs one re-hash.

Errors (all catchable as ``InclavateError``)::

    StoreError                 the store directory cannot be used (permissions, disk)
    ├── ModelNotPulled         the model is in the catalog but not on this machine
    ├── ChecksumMismatch       a downloaded file's sha256 is not the catalog's
    └── DownloadFailed         no source could deliver the file
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from inclavate.catalog import ModelSpec, load_overlay, save_overlay_entry, validate_model_id
from inclavate.download import CHUNK, FetchError, FileSource, Source, fetch, parse_source
from inclavate.durable import replace_durably
from inclavate.errors import ConfigError, InclavateError
from inclavate.gguf_info import InvalidGguf, read_gguf_info
from inclavate.progress import Progress

log = logging.getLogger(__name__)

MODEL_FILE = "model.gguf"
PART_FILE = "model.gguf.part"
MARKER_FILE = "verified.json"
LOCK_FILE = ".lock"


class StoreError(InclavateError):
    """The model store could not do what was asked."""


class ModelNotPulled(StoreError):
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        super().__init__(f"model {model_id!r} is not pulled on this machine; run: inclavate pull {model_id}")


class ChecksumMismatch(StoreError):
    def __init__(self, model_id: str, expected: str, actual: str, source: str) -> None:
        self.model_id, self.expected, self.actual, self.source = model_id, expected, actual, source
        hint = ""
        if source.startswith("file:"):
            hint = f"; if that file was changed on purpose, register it again: inclavate pull FILE --as {model_id}"
        super().__init__(f"{model_id}: file from {source} has sha256 {actual}, expected {expected}{hint}")


class DownloadFailed(StoreError):
    def __init__(self, model_id: str, failures: list[tuple[str, str]]) -> None:
        self.model_id = model_id
        self.failures = failures
        reasons = "; ".join(f"{source}: {reason}" for source, reason in failures)
        super().__init__(f"could not fetch {model_id}: {reasons}")


class PullStatus(enum.Enum):
    ALREADY_PULLED = "already pulled"
    VERIFIED = "verified the file already present"
    DOWNLOADED = "downloaded"
    REPAIRED = "corrupt file replaced"


@dataclass(frozen=True)
class PullResult:
    model_id: str
    path: Path
    sha256: str
    status: PullStatus
    verified_against_catalog: bool
    """False when the catalog has no hash: ``sha256`` is then only what was recorded."""


@dataclass(frozen=True)
class _Marker:
    sha256: str
    size: int
    mtime_ns: int
    source: str
    verified_against_catalog: bool


class ModelStore:
    """Pulled models of one ``$INCLAVATE_HOME``; safe to use from several processes."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.root = home / "models"

    def model_dir(self, model_id: str) -> Path:
        # Validated again here: the id becomes a path, so "../x" must never get this far.
        return self.root / validate_model_id(model_id).replace(":", "@")

    def path(self, spec: ModelSpec) -> Path:
        """Where the model's GGUF is (or will be) once pulled."""
        return self.model_dir(spec.model_id) / MODEL_FILE

    def is_pulled(self, spec: ModelSpec) -> bool:
        """Cheap check (two stats and a small read, no hashing) that the file is verified."""
        return self._valid_marker(spec) is not None

    def require(self, spec: ModelSpec) -> Path:
        """The verified file's path, or :class:`ModelNotPulled` saying how to get it."""
        if not self.is_pulled(spec):
            raise ModelNotPulled(spec.model_id)
        return self.path(spec)

    def pull(self, spec: ModelSpec, progress: Progress | None = None) -> PullResult:
        """Make the model present and verified, fetching only what is missing or wrong."""
        progress = progress or Progress(None)
        with self._locked(spec.model_id, progress):
            marker = self._valid_marker(spec)
            if marker is not None:
                return self._result(spec, marker, PullStatus.ALREADY_PULLED)
            final = self.path(spec)
            status = PullStatus.DOWNLOADED
            if final.exists():
                if (marker := self._check_existing(spec, progress)) is not None:
                    return self._result(spec, marker, PullStatus.VERIFIED)
                status = PullStatus.REPAIRED
            return self._result(spec, self._download(spec, progress), status)

    def register_local(self, file: Path, name: str, progress: Progress | None = None) -> ModelSpec:
        """Adopt a GGUF already on this machine as model ``name`` (an overlay entry).

        The file is hard-linked into the store (copied across filesystems; see
        ``download._link_or_copy`` for why a link): the store then serves it like any
        pulled model, and ``inclavate pull NAME`` can restore it from the original path.
        """
        progress = progress or Progress(None)
        model_id = validate_model_id(name)
        file = file.expanduser().resolve()
        if not file.is_file():
            raise ConfigError(f"{file}: no such file")
        info = read_gguf_info(file)
        load_overlay(self.home)  # a malformed overlay fails now, before any file moves
        with self._locked(model_id, progress):
            part = self.model_dir(model_id) / PART_FILE
            source = FileSource(file)
            try:
                fetch(source, part, progress)
            except FetchError as exc:
                raise DownloadFailed(model_id, [(str(source), str(exc))]) from exc
            sha = hash_file(part, progress)
            spec = ModelSpec(
                model_id=model_id, arch=info.arch, n_layers=info.n_layers, d_model=info.d_model,
                quant_type=info.quant_type, gguf_sha256=sha, sources=(str(source),), source="local",
                size_bytes=part.stat().st_size, local_path=file,
            )  # fmt: skip
            self._install(spec, part, sha, str(source), verified_against_catalog=True)
            # Inside the lock only for its OSError mapping: the overlay is shared by all
            # models, and two registrations of different names at the same instant could
            # still lose one entry (read-modify-write); a CLI-only action, so accepted.
            save_overlay_entry(self.home, spec)
        return spec

    # -- internals -------------------------------------------------------------------

    def _check_existing(self, spec: ModelSpec, progress: Progress) -> _Marker | None:
        """Re-hash a final file whose marker is missing or stale; drop it if it is wrong."""
        final = self.path(spec)
        recorded = self._read_marker(spec.model_id)
        # Without a catalog hash, the hash recorded at the first download is the reference.
        expected = spec.gguf_sha256 or (recorded.sha256 if recorded else "")
        actual = hash_file(final, progress)
        if actual == expected or (not expected and _gguf_mismatch(spec, final) is None):
            return self._write_marker(spec, actual, recorded.source if recorded else "", bool(spec.gguf_sha256))
        log.warning(
            "corrupt file detected: %s has sha256 %s, expected %s; fetching it again",
            final, actual, expected or "a GGUF matching the catalog",
        )  # fmt: skip
        (final.parent / MARKER_FILE).unlink(missing_ok=True)
        final.unlink()
        return None

    def _download(self, spec: ModelSpec, progress: Progress) -> _Marker:
        """Try each source in order; the first that yields the right file is installed."""
        part = self.model_dir(spec.model_id) / PART_FILE
        failures: list[tuple[str, str]] = []
        mismatch: ChecksumMismatch | None = None
        for text in spec.sources:
            try:
                sha = self._fetch_checked(spec, parse_source(text), part, progress)
            except FetchError as exc:
                failures.append((text, str(exc)))
                log.warning("source %s failed: %s", text, exc)
                continue
            except ChecksumMismatch as exc:
                failures.append((text, str(exc)))
                log.warning("%s", exc)
                mismatch = exc
                continue
            if not spec.gguf_sha256:
                log.warning(
                    "%s: the catalog has no sha256 for this model, so the download was not verified "
                    "against it; recorded sha256 %s as the reference for later checks",
                    spec.model_id, sha,
                )  # fmt: skip
            return self._install(spec, part, sha, text, verified_against_catalog=bool(spec.gguf_sha256))
        # A wrong file is the more alarming failure (a bad mirror or a tampered file), so
        # it wins over connection errors from other sources when both happened.
        if mismatch is not None:
            raise mismatch
        raise DownloadFailed(spec.model_id, failures)

    def _fetch_checked(self, spec: ModelSpec, source: Source, part: Path, progress: Progress) -> str:
        """Fetch into ``part`` and return its sha256; a wrong file is deleted, never kept."""
        for attempt in (1, 2):
            outcome = fetch(source, part, progress)
            sha = hash_file(part, progress)
            if not spec.gguf_sha256:
                if (problem := _gguf_mismatch(spec, part)) is not None:
                    part.unlink()
                    raise FetchError(f"downloaded file does not match the catalog: {problem}")
                return sha
            if sha == spec.gguf_sha256:
                return sha
            part.unlink()
            # Bytes kept from an earlier run are the first suspect (the file may have
            # changed on the server in between): start over once before blaming the source.
            if not outcome.resumed or attempt == 2:
                raise ChecksumMismatch(spec.model_id, spec.gguf_sha256, sha, str(source))
            log.warning("%s: resumed download has the wrong sha256; downloading it again from the start", spec.model_id)
        raise AssertionError("unreachable")

    def _install(
        self, spec: ModelSpec, part: Path, sha: str, source: str, *, verified_against_catalog: bool
    ) -> _Marker:
        final = self.path(spec)
        # Marker first: between these two steps the old marker must not vouch for the new file.
        (final.parent / MARKER_FILE).unlink(missing_ok=True)
        replace_durably(part, final)
        return self._write_marker(spec, sha, source, verified_against_catalog)

    def _write_marker(self, spec: ModelSpec, sha: str, source: str, verified_against_catalog: bool) -> _Marker:
        stat = self.path(spec).stat()
        marker = _Marker(sha, stat.st_size, stat.st_mtime_ns, source, verified_against_catalog)
        path = self.model_dir(spec.model_id) / MARKER_FILE
        tmp = path.with_name(f".{MARKER_FILE}.tmp")
        tmp.write_text(json.dumps({"model_id": spec.model_id, **asdict(marker)}, indent=2) + "\n", "utf-8")
        replace_durably(tmp, path)
        return marker

    def _read_marker(self, model_id: str) -> _Marker | None:
        try:
            data = json.loads((self.model_dir(model_id) / MARKER_FILE).read_text("utf-8"))
            data.pop("model_id", None)
            return _Marker(**data)
        except (OSError, ValueError, TypeError):
            return None  # missing or unreadable: treated like stale, costing one re-hash

    def _valid_marker(self, spec: ModelSpec) -> _Marker | None:
        marker = self._read_marker(spec.model_id)
        if marker is None:
            return None
        try:
            stat = self.path(spec).stat()
        except FileNotFoundError:
            return None
        if (stat.st_size, stat.st_mtime_ns) != (marker.size, marker.mtime_ns):
            return None
        # A catalog update that changes the hash makes the old file stale, not pulled.
        if spec.gguf_sha256 and marker.sha256 != spec.gguf_sha256:
            return None
        return marker

    def _result(self, spec: ModelSpec, marker: _Marker, status: PullStatus) -> PullResult:
        return PullResult(spec.model_id, self.path(spec), marker.sha256, status, marker.verified_against_catalog)

    @contextmanager
    def _locked(self, model_id: str, progress: Progress) -> Iterator[None]:
        """Hold the model directory's lock; store OS errors become :class:`StoreError`.

        Two processes pulling the same model would otherwise write one ``.part`` at once.
        flock is released by the kernel if the holder dies, so no stale lock survives.
        """
        directory = self.model_dir(model_id)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / LOCK_FILE, "a+b") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    progress.log(f"waiting for another process pulling {model_id} ...")
                    fcntl.flock(handle, fcntl.LOCK_EX)
                yield
        except OSError as exc:
            raise StoreError(f"model store {directory}: {exc}") from exc


def hash_file(path: Path, progress: Progress | None = None) -> str:
    """sha256 of ``path`` as lowercase hex, with progress (hashing 5 GB takes a while)."""
    progress = progress or Progress(None)
    digest = hashlib.sha256()
    with open(path, "rb") as handle, progress.task(f"verifying {path.name}", path.stat().st_size) as task:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            task.advance(len(chunk))
    return digest.hexdigest()


def _gguf_mismatch(spec: ModelSpec, path: Path) -> str | None:
    """Why ``path`` is not the model the catalog describes, or None if it plausibly is.

    Used only when the catalog has no hash: then this is all that stops, say, an HTML
    error page served with status 200 from being recorded as the model.
    """
    try:
        info = read_gguf_info(path)
    except InvalidGguf as exc:
        return exc.reason
    expected = (spec.arch, spec.n_layers, spec.d_model)
    actual = (info.arch, info.n_layers, info.d_model)
    if actual != expected:
        return f"arch/n_layers/d_model are {actual}, the catalog says {expected}"
    return None
