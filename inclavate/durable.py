"""Renaming a written file into place so that it survives a crash *and* a power cut.

``os.replace`` alone is atomic but not durable: after a power cut the directory may hold the
new name pointing at blocks that were never written (a zero-length or partial model, slice,
key or marker that then passes for a finished one). The data is flushed before the rename
and the directory after it, so the name appears only once the bytes it names are on disk.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's) data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, dest: Path) -> None:
    """``os.replace(tmp, dest)`` with ``tmp``'s bytes on disk first and the rename after."""
    fsync_path(tmp)
    os.replace(tmp, dest)
    fsync_path(dest.parent)
