"""The artifact metadata table, ``<data_dir>/artifacts/index.db`` (SQLite via sqlite-utils).

Only metadata lives here; bytes are files named by id (see :mod:`inclavate.artifacts`).
One table, created on first use (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)::

    artifacts  id (pk), media_type, size_bytes, digest, state, kind, created_at_ms,
               expires_at_ms, filename, purpose, error
               index (created_at_ms, id): the listing order and keyset cursor
               index (kind, created_at_ms, id): a listing of one kind
               index (created_at_ms, id) WHERE purpose IS NOT NULL: the Files API's listing
               index (expires_at_ms) WHERE expires_at_ms IS NOT NULL: the sweeper, usage

Queries run on the trio thread: each touches a few rows through an index (a listing at
most ``limit + offset + 1``, a sweep or ``usage`` the expired rows not yet swept), in WAL mode with ``synchronous=FULL`` so that a row marked
ready is on disk before the upload's 201 goes out. Every sqlite3 error becomes
:class:`~inclavate.artifact_types.ArtifactUnavailable` here.

Counts and sizes of every row, per kind, are kept in memory (read once at open, then moved
by each write here, the only writer): ``usage`` and the quota read them and subtract the
expired rows not yet swept, found through the expiry index. Version 1 had neither index,
and ``usage`` (a request any peer may send, ``p2p.artifacts``) scanned the whole table:
~57 ms of the event loop at 100,000 artifacts; the sweeper's scan ~6 ms a pass, and a
Files listing among generated artifacts ~22 ms (tests/test_artifact_store.py::test_index_work_does_not_grow_with_rows).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from sqlite_utils import Database

from inclavate.artifact_types import ArtifactMeta, ArtifactPage, ArtifactUnavailable, ListQuery, Totals, error_text
from inclavate.sqlite_errors import sqlite_errors_as

SCHEMA_VERSION = 2
"""2: the kind, files and expiry indexes (added to a version-1 table on open)."""
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS artifacts_kind ON artifacts (kind, created_at_ms, id)",
    "CREATE INDEX IF NOT EXISTS artifacts_files ON artifacts (created_at_ms, id) WHERE purpose IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS artifacts_expiry ON artifacts (expires_at_ms) WHERE expires_at_ms IS NOT NULL",
)
_LIVE = "(expires_at_ms IS NULL OR expires_at_ms > :now)"


def _mapped() -> AbstractContextManager[None]:
    return sqlite_errors_as(ArtifactUnavailable, "artifact index")


class ArtifactIndex:
    def __init__(self, path: Path) -> None:
        with _mapped():
            self._db = Database(path)
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._migrate()
                self._all = self._count_all()
            except BaseException:
                self._db.close()
                raise

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version not in (0, 1):
            raise ArtifactUnavailable(f"artifact index has schema {version}; this peer reads {SCHEMA_VERSION}")
        with self._db.conn:
            if version == 0:
                self._create()
            for sql in _INDEXES:
                self._db.execute(sql)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _create(self) -> None:
        self._db["artifacts"].create(  # type: ignore[union-attr]
            {
                "id": str, "media_type": str, "size_bytes": int, "digest": str, "state": str,
                "kind": str, "created_at_ms": int, "expires_at_ms": int, "filename": str,
                "purpose": str, "error": str,
            },  # fmt: skip
            pk="id",
            not_null={"media_type", "size_bytes", "state", "kind", "created_at_ms"},
            if_not_exists=True,
        )
        self._db["artifacts"].create_index(["created_at_ms", "id"], if_not_exists=True)  # type: ignore[union-attr]

    def _count_all(self) -> dict[str, Totals]:
        """Every row's count and bytes per kind (one scan, at open)."""
        sql = "SELECT kind, COUNT(*), COALESCE(SUM(size_bytes), 0) FROM artifacts GROUP BY kind"
        return {kind: Totals(b, n) for kind, n, b in self._db.execute(sql).fetchall()}

    def _count(self, kind: str, change: Totals) -> None:
        self._all[kind] = self._all.get(kind, Totals()) + change

    def close(self) -> None:
        self._db.close()

    # -- single rows -------------------------------------------------------------------

    def insert(self, meta: ArtifactMeta) -> None:
        with _mapped(), self._db.conn:
            self._db["artifacts"].insert(meta.to_record())  # type: ignore[union-attr]
        self._count(meta.kind, Totals(meta.size_bytes, 1))

    def get(self, id_: str) -> ArtifactMeta | None:
        with _mapped():
            rows = list(self._db.query("SELECT * FROM artifacts WHERE id = ?", [id_]))
        return ArtifactMeta.from_record(rows[0]) if rows else None

    def mark_ready(self, id_: str, size_bytes: int, digest: str) -> bool:
        """Pending -> ready; False if the row is gone or no longer pending (deleted)."""
        return self._settle(id_, size_bytes, "state = 'ready', size_bytes = ?, digest = ?", [size_bytes, digest])

    def mark_failed(self, id_: str, error: str) -> bool:
        return self._settle(id_, 0, "state = 'failed', size_bytes = 0, digest = NULL, error = ?", [error_text(error)])

    def _settle(self, id_: str, size_bytes: int, sets: str, params: list[object]) -> bool:
        """A pending row's ``UPDATE ... SET sets``, and its kind's bytes moved to ``size_bytes``."""
        with _mapped(), self._db.conn:
            row = self._db.execute("SELECT kind, size_bytes FROM artifacts WHERE id = ? AND state = 'pending'", [id_]).fetchone()
            if row is None:
                return False
            self._db.execute(f"UPDATE artifacts SET {sets} WHERE id = ?", [*params, id_])
        self._count(row[0], Totals(size_bytes - row[1], 0))
        return True

    def delete(self, id_: str) -> ArtifactMeta | None:
        with _mapped(), self._db.conn:
            rows = list(self._db.query("SELECT * FROM artifacts WHERE id = ?", [id_]))
            if not rows:
                return None
            self._db.execute("DELETE FROM artifacts WHERE id = ?", [id_])
        meta = ArtifactMeta.from_record(rows[0])
        self._count(meta.kind, Totals(-meta.size_bytes, -1))
        return meta

    # -- sets of rows ------------------------------------------------------------------

    def page(self, query: ListQuery, now: int) -> ArtifactPage:
        """Live rows in (created_at, id) order, DESC unless ``ascending``; one extra row
        is read to answer ``truncated`` without a COUNT."""
        where = [_LIVE]
        params: dict[str, object] = {"now": now, "limit": query.limit + 1, "offset": query.offset}
        if query.kind is not None:
            where.append("kind = :kind")
            params["kind"] = query.kind
        if query.files_only:
            where.append("purpose IS NOT NULL")
        if query.purpose is not None:
            where.append("purpose = :purpose")
            params["purpose"] = query.purpose
        if query.after is not None:
            where.append(f"(created_at_ms, id) {'>' if query.ascending else '<'} (:after_ms, :after_id)")
            params["after_ms"], params["after_id"] = query.after
        order = "ASC" if query.ascending else "DESC"
        sql = (
            f"SELECT * FROM artifacts WHERE {' AND '.join(where)} "
            f"ORDER BY created_at_ms {order}, id {order} LIMIT :limit OFFSET :offset"
        )
        with _mapped():
            rows = [ArtifactMeta.from_record(r) for r in self._db.query(sql, params)]
        return ArtifactPage(rows[: query.limit], truncated=len(rows) > query.limit)

    def totals(self, now: int) -> dict[str, Totals]:
        """COUNT/SUM of live rows per kind (what ``usage`` reports): every row's, less the
        expired rows not yet swept (through the expiry index)."""
        sql = ("SELECT kind, COUNT(*), COALESCE(SUM(size_bytes), 0) FROM artifacts INDEXED BY artifacts_expiry "
               "WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= ? GROUP BY kind")  # fmt: skip
        with _mapped():
            expired = {kind: Totals(-b, -n) for kind, n, b in self._db.execute(sql, [now]).fetchall()}
        live = {kind: t + expired.get(kind, Totals()) for kind, t in self._all.items()}
        return {kind: t for kind, t in live.items() if t.objects}

    def stored(self) -> Totals:
        """Every row, expired or not: what occupies the disk until the sweeper runs."""
        return sum(self._all.values(), Totals())

    def expired_ids(self, now: int, limit: int = 1000) -> list[str]:
        sql = "SELECT id FROM artifacts INDEXED BY artifacts_expiry WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= ? LIMIT ?"
        with _mapped():
            return [row[0] for row in self._db.execute(sql, [now, limit]).fetchall()]

    def ids_in_state(self, state: str) -> set[str]:
        with _mapped():
            return {row[0] for row in self._db.execute("SELECT id FROM artifacts WHERE state = ?", [state]).fetchall()}
