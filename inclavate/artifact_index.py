"""The artifact metadata table, ``<data_dir>/artifacts/index.db`` (SQLite via sqlite-utils).

Only metadata lives here; bytes are files named by id (see :mod:`inclavate.artifacts`).
One table, created on first use (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)::

    artifacts  id (pk), media_type, size_bytes, digest, state, kind, created_at_ms,
               expires_at_ms, filename, purpose, error
               index (created_at_ms, id): the listing order and keyset cursor

Queries run on the trio thread: each touches a few rows through an index (a listing at
most ``limit + offset + 1``), in WAL mode with ``synchronous=FULL`` so that a row marked
ready is on disk before the upload's 201 goes out. Every sqlite3 error becomes
:class:`~inclavate.artifact_types.ArtifactUnavailable` here.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from sqlite_utils import Database

from inclavate.artifact_types import ArtifactMeta, ArtifactPage, ArtifactUnavailable, ListQuery, Totals
from inclavate.sqlite_errors import sqlite_errors_as

SCHEMA_VERSION = 1
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
            except BaseException:
                self._db.close()
                raise

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version != 0:
            raise ArtifactUnavailable(f"artifact index has schema {version}; this peer reads {SCHEMA_VERSION}")
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
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self._db.close()

    # -- single rows -------------------------------------------------------------------

    def insert(self, meta: ArtifactMeta) -> None:
        with _mapped(), self._db.conn:
            self._db["artifacts"].insert(meta.to_record())  # type: ignore[union-attr]

    def get(self, id_: str) -> ArtifactMeta | None:
        with _mapped():
            rows = list(self._db.query("SELECT * FROM artifacts WHERE id = ?", [id_]))
        return ArtifactMeta.from_record(rows[0]) if rows else None

    def mark_ready(self, id_: str, size_bytes: int, digest: str) -> bool:
        """Pending -> ready; False if the row is gone or no longer pending (deleted)."""
        with _mapped(), self._db.conn:
            cursor = self._db.execute(
                "UPDATE artifacts SET state = 'ready', size_bytes = ?, digest = ? WHERE id = ? AND state = 'pending'",
                [size_bytes, digest, id_],
            )
        return cursor.rowcount == 1

    def mark_failed(self, id_: str, error: str) -> bool:
        with _mapped(), self._db.conn:
            cursor = self._db.execute(
                "UPDATE artifacts SET state = 'failed', size_bytes = 0, digest = NULL, error = ? "
                "WHERE id = ? AND state = 'pending'",
                [error[:1000], id_],
            )
        return cursor.rowcount == 1

    def delete(self, id_: str) -> ArtifactMeta | None:
        with _mapped(), self._db.conn:
            rows = list(self._db.query("SELECT * FROM artifacts WHERE id = ?", [id_]))
            if not rows:
                return None
            self._db.execute("DELETE FROM artifacts WHERE id = ?", [id_])
        return ArtifactMeta.from_record(rows[0])

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
        """COUNT/SUM of live rows per kind (what ``usage`` reports)."""
        sql = f"SELECT kind, COUNT(*) AS n, COALESCE(SUM(size_bytes), 0) AS b FROM artifacts WHERE {_LIVE} GROUP BY kind"
        with _mapped():
            return {row["kind"]: Totals(row["b"], row["n"]) for row in self._db.query(sql, {"now": now})}

    def stored(self) -> Totals:
        """Every row, expired or not: what occupies the disk until the sweeper runs."""
        with _mapped():
            n, b = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM artifacts").fetchone()
        return Totals(b, n)

    def expired_ids(self, now: int, limit: int = 1000) -> list[str]:
        sql = "SELECT id FROM artifacts WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= ? LIMIT ?"
        with _mapped():
            return [row[0] for row in self._db.execute(sql, [now, limit]).fetchall()]

    def ids_in_state(self, state: str) -> set[str]:
        with _mapped():
            return {row[0] for row in self._db.execute("SELECT id FROM artifacts WHERE state = ?", [state]).fetchall()}
