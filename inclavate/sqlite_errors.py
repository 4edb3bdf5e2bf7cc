"""The one shape of a store's sqlite3 errors: its own typed error, naming the store."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def sqlite_errors_as(error: Callable[[str], Exception], store: str) -> Iterator[None]:
    """Raise ``error("<store>: <what sqlite3 said>")`` for any sqlite3 error inside (a corrupt
    file, a full disk, a lock), so callers catch the store's error, never sqlite3's."""
    try:
        yield
    except sqlite3.Error as exc:
        raise error(f"{store}: {exc}") from exc
