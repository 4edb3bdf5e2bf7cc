"""The peers this peer has met, ``<data_dir>/peers.db``: where it looks for the swarm after a
restart.

Why: what discovery learns about other peers' addresses lives in the host's memory. A peer
restarted after its ``--bootstrap`` peer moved (a new port, a new machine) or left, or a
first peer started with no ``--bootstrap`` at all, came back alone and stayed alone, though
it had been connected to a dozen peers a minute before. On start :func:`p2p.discovery.run_discovery`
dials the addresses kept here after ``--bootstrap``'s, with the same backoff; one live peer is
enough, the peer exchange finds the rest.

What is kept: only a peer's own word about its addresses, sent in the peer exchange over a
Noise-authenticated connection to it, filtered to addresses naming that peer; never what a
third peer says about someone else (a stranger could otherwise fill the book with addresses
of its choice, or of a victim).

Bounds, since identities cost nothing: at most :data:`MAX_PEERS` entries. When the book is
full, a newcomer takes the place of the entry met longest ago only if that entry has not been
met for :data:`STALE_MS`; otherwise the newcomer is not remembered, so Sybils met now cannot
push out the peers met lately. Entries not met for :data:`FORGET_MS` are dropped when the
book is opened. An entry is written again when it was last written :data:`REFRESH_MS` ago,
or :data:`MOVED_MS` ago where its addresses changed; not at every exchange (every 10 s per
neighbour while below the target degree, and as often as a hostile neighbour opens one).

It also keeps the p2p port this peer last listened on (:meth:`PeerBook.own_port`): a peer
started without ``--p2p-port`` takes it again when it is free, so the addresses the others
keep of it, in their books and in their ``--bootstrap``, stay right across its restarts, and
a swarm restarted whole finds itself again.

Tables (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)::

    peers   peer_id (pk), addrs (JSON list), last_met_ms
    own     id = 1 (one row): p2p_port
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from sqlite_utils import Database

from inclavate.sqlite_errors import sqlite_errors_as
from inclavate.errors import InclavateError
from p2p.discovery import PeerAddrs
from p2p.records import now_ms

log = logging.getLogger(__name__)

FILENAME = "peers.db"
SCHEMA_VERSION = 1
MAX_PEERS = 64
STALE_MS = 24 * 3600 * 1000
FORGET_MS = 7 * 24 * 3600 * 1000
REFRESH_MS = 10 * 60 * 1000
MOVED_MS = 60 * 1000


class PeerBookError(InclavateError):
    """The peer book cannot be opened or read (written: logged, see :meth:`PeerBook.met`)."""


def _mapped() -> AbstractContextManager[None]:
    return sqlite_errors_as(PeerBookError, "peer book")


class PeerBook:
    """Peers met, their own addresses, and when they were last met; see the module's docstring."""

    def __init__(self, path: Path, *, clock: Callable[[], int] = now_ms) -> None:
        self.path = path
        self._clock = clock
        with _mapped():
            self._db = Database(path)
            try:
                self._open()
                self._entries = {row["peer_id"]: (tuple(json.loads(row["addrs"])), row["last_met_ms"])
                                 for row in self._db.table("peers").rows}  # fmt: skip
            except BaseException:
                self._db.close()
                raise

    @classmethod
    def in_dir(cls, data_dir: Path) -> PeerBook:
        return cls(data_dir / FILENAME)

    def _open(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise PeerBookError(f"{self.path} has schema {version}, newer than this version's {SCHEMA_VERSION}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._db.atomic():
            self._db.table("peers").create({"peer_id": str, "addrs": str, "last_met_ms": int}, pk="peer_id",
                                           if_not_exists=True)  # fmt: skip
            self._db.table("own").create({"id": int, "p2p_port": int}, pk="id", if_not_exists=True)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("DELETE FROM peers WHERE last_met_ms < ?", [self._clock() - FORGET_MS])

    def close(self) -> None:
        self._db.close()

    def own_port(self) -> int | None:
        """The p2p port this peer last listened on, if it ever did."""
        with _mapped():
            row = self._db.execute("SELECT p2p_port FROM own WHERE id = 1").fetchone()
        return int(row[0]) if row is not None and 0 < row[0] < 65536 else None

    def listened_on(self, port: int) -> None:
        """This peer listens on ``port`` (logged, never raised, on a failed write: see :meth:`met`)."""
        try:
            with _mapped(), self._db.atomic():
                self._db.execute("INSERT OR REPLACE INTO own (id, p2p_port) VALUES (1, ?)", [port])
        except PeerBookError as exc:
            log.warning("could not remember this peer's p2p port: %s", exc)

    def recall(self) -> list[PeerAddrs]:
        """The peers met, the one met last first."""
        ordered = sorted(self._entries.items(), key=lambda item: item[1][1], reverse=True)
        return [PeerAddrs(peer, addrs) for peer, (addrs, _) in ordered]

    def met(self, entry: PeerAddrs) -> None:
        """``entry.peer_id`` told us its own addresses over an authenticated connection.

        A failed write is logged, never raised: the book only helps a later start find the
        swarm, and a full disk must not cost this run its discovery."""
        addrs = tuple(a for a in entry.addrs if a.endswith(f"/p2p/{entry.peer_id}"))
        if not addrs:
            return
        now = self._clock()
        known = self._entries.get(entry.peer_id)
        if known is not None and now - known[1] < (REFRESH_MS if known[0] == addrs else MOVED_MS):
            return
        evict = None
        if known is None and len(self._entries) >= MAX_PEERS:
            evict, (_, last_met) = min(self._entries.items(), key=lambda item: item[1][1])
            if now - last_met < STALE_MS:
                return  # every place holds a peer met lately: see the module's docstring
        try:
            with _mapped(), self._db.atomic():
                if evict is not None:
                    self._db.execute("DELETE FROM peers WHERE peer_id = ?", [evict])
                self._db.execute("INSERT INTO peers (peer_id, addrs, last_met_ms) VALUES (?, ?, ?) ON CONFLICT (peer_id) "
                                 "DO UPDATE SET addrs = excluded.addrs, last_met_ms = excluded.last_met_ms",
                                 [entry.peer_id, json.dumps(addrs), now])  # fmt: skip
        except PeerBookError as exc:
            log.warning("could not remember peer %s: %s", entry.peer_id, exc)
            return
        if evict is not None:
            del self._entries[evict]
        self._entries[entry.peer_id] = (addrs, now)
