"""The swarm's artifacts seen from one peer: its own store, and every other peer's over
``/inclavate/artifacts/2``. The API talks only to this (``PeerContext.artifacts()``).

Where an id lives: its owner tag (:mod:`inclavate.owner_ids`) names the peer, so a read,
a meta or a delete goes straight to the owner: locally when the tag is ours, else to the
registry peer(s) carrying that tag. No lookup protocol, no replicated index. An id whose
tag matches no known peer is 404; an owner that is known but does not answer is 503 (the
artifact may well exist; a 404 would tell a client it is gone for good).

Listing and usage are swarm-wide, as the spec's semantics ask: with no accounts every
request is the single local principal, and "the caller's own artifacts" are all of them,
wherever they are stored. A page is a k-way merge in two steps: each live peer returns the
sort keys of its first ``offset + limit`` rows in the spec's order (created_at DESC, id
DESC), the merged keys ``offset .. offset + limit`` make the page, and each peer is then
asked for the rows of its own on it (a contiguous run of its order: after the key before
it). Keys are at most ~61 bytes whatever the row; shipping whole rows for the merge needed
``offset + limit`` rows from each peer, up to 20 KiB each, where only ``limit`` are
served; ``truncated`` is true when any peer had more. The order is total (ids are unique),
so offsets stay stable across requests. A peer that has not answered its keys within
:data:`KEYS_SHARE_S` of the listing's start, or its rows within :data:`PEER_TIMEOUT_S`, is
left out of that page (logged), rather than
failing the whole listing; a row deleted between the steps is left out too. Usage sums the peers' COUNT/SUM totals; its ceilings are the
sum of the peers' own (a store's quota guards its owner's disk), 0 if any peer has none.
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import trio

from inclavate.artifact_types import (
    ArtifactMeta,
    ArtifactNotFound,
    ArtifactPage,
    SWARM_LIST_WINDOW,
    ArtifactUnavailable,
    BadArtifactRequest,
    KeyPage,
    ListQuery,
    SortKey,
    Usage,
)
from inclavate.artifacts import ArtifactRead, ArtifactStore, read_whole
from inclavate.errors import InclavateError
from inclavate.owner_ids import owner_candidates, owner_tag, parse_id, tag_of

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 5.0
"""The longest a peer may hold a listing (both its steps) or a usage total."""
KEYS_SHARE_S = PEER_TIMEOUT_S / 2
"""A listing's first step (the keys) ends this long after the listing began, however
late some peer is: the rows step then has the rest, at least as long. With one deadline
for both, a peer answering its keys just in time left the honest peers no time for their
rows; with ``PEER_TIMEOUT_S`` each, it held every listing twice that
(tests/test_artifact_swarm.py::test_a_peer_slow_at_both_steps_of_a_listing_holds_it_at_most_peer_timeout_s)."""

T = TypeVar("T")


class RemoteStores(Protocol):
    """Other peers' stores (``p2p.artifacts.RemoteArtifacts``)."""

    async def meta(self, peer: str, id_: str) -> ArtifactMeta: ...
    async def open(self, peer: str, id_: str, range_header: str | None) -> ArtifactRead: ...
    async def delete(self, peer: str, id_: str) -> None: ...
    async def list(self, peer: str, query: ListQuery) -> ArtifactPage: ...
    async def keys(self, peer: str, query: ListQuery) -> KeyPage: ...
    async def usage(self, peer: str) -> Usage: ...


class SwarmArtifacts:
    def __init__(
        self,
        store: ArtifactStore,
        remote: RemoteStores | None = None,
        known_peers: Callable[[], list[str]] = list,
        live_peers: Callable[[], list[str]] = list,
    ) -> None:
        """``known_peers``: every peer in the registry (owner lookup); ``live_peers``: those
        not Dead (listing and usage). Both may include this peer; it is filtered out."""
        self.store = store
        self._remote = remote
        self._known = known_peers
        self._live = live_peers
        self._own_tag = owner_tag(store.owner)

    # -- one artifact, wherever it lives ------------------------------------------------

    async def meta(self, id_: str) -> ArtifactMeta:
        return await self._at_owner(id_, lambda: _async(self.store.meta, id_), lambda p: self._remote_().meta(p, id_))

    async def open(self, id_: str, range_header: str | None = None) -> ArtifactRead:
        """A ready artifact's bytes (ArtifactNotReady, Range errors, ArtifactNotFound)."""
        return await self._at_owner(
            id_, lambda: self.store.open(id_, range_header), lambda p: self._remote_().open(p, id_, range_header)
        )

    async def read_all(self, id_: str, max_bytes: int) -> tuple[ArtifactMeta, bytes]:
        """A whole artifact in memory, for small inputs (a generator's clip, a prompt)."""
        read = await self.open(id_)
        return read.meta, await read_whole(read, max_bytes)

    async def delete(self, id_: str) -> None:
        async def local() -> None:
            await self.store.delete(id_)

        await self._at_owner(id_, local, lambda p: self._remote_().delete(p, id_))

    async def _at_owner(
        self, id_: str, local: Callable[[], Awaitable[T]], remote: Callable[[str], Awaitable[T]]
    ) -> T:
        id_ = parse_id(id_)
        me = self.store.owner
        others = [p for p in owner_candidates(id_, self._known()) if p != me] if self._remote else []
        attempts: list[Callable[[], Awaitable[T]]] = [local] if tag_of(id_) == self._own_tag else []
        attempts += [functools.partial(remote, p) for p in others]
        unreachable: ArtifactUnavailable | None = None
        for attempt in attempts:
            try:
                return await attempt()
            except ArtifactNotFound:
                continue
            except ArtifactUnavailable as exc:
                unreachable = exc
        if unreachable is not None:
            raise ArtifactUnavailable(f"artifact {id_} is held by a peer that does not answer now: {unreachable}")
        raise ArtifactNotFound(f"no artifact {id_}")

    def _remote_(self) -> RemoteStores:
        assert self._remote is not None
        return self._remote

    # -- the whole swarm ---------------------------------------------------------------

    def _other_live_peers(self) -> list[str]:
        if self._remote is None:
            return []
        return sorted(set(self._live()) - {self.store.owner})

    async def list(self, query: ListQuery) -> ArtifactPage:
        peers = self._other_live_peers()
        if not peers:
            return self.store.list(query)
        window = query.offset + query.limit
        if window > SWARM_LIST_WINDOW:
            raise BadArtifactRequest(
                f"offset + limit may reach at most {SWARM_LIST_WINDOW} rows in a swarm-wide listing; "
                "narrow it with kind, or delete what is no longer needed"
            )
        per_peer = ListQuery(window, 0, query.kind, query.files_only, query.purpose, query.after, query.ascending)
        began = trio.current_time()
        own = self.store.list(per_peer)
        keyed = await self._gather(peers, lambda p: _paired(p, self._remote_().keys(p, per_peer)), began + KEYS_SHARE_S)
        sources: list[tuple[str | None, list[SortKey]]] = [(None, [m.sort_key() for m in own.artifacts])]
        sources += [(peer, page.keys) for peer, page in keyed]
        merged = list(heapq.merge(*([(key, i) for key in keys] for i, (_, keys) in enumerate(sources)),
                                  reverse=not query.ascending))  # fmt: skip
        chosen = merged[query.offset : window]
        rows = {(m.sort_key(), 0): m for m in own.artifacts}
        source_of = {peer: i for i, (peer, _) in enumerate(sources) if peer is not None}
        asks = {peer: q for peer, keys in sources if peer and (q := self._rows_query(per_peer, keys, chosen, source_of[peer]))}
        for peer, page in await self._gather(list(asks), lambda p: _paired(p, self._remote_().list(p, asks[p])),
                                             began + PEER_TIMEOUT_S):  # fmt: skip
            rows.update(((m.sort_key(), source_of[peer]), m) for m in page.artifacts)
        truncated = len(merged) > window or own.truncated or any(page.truncated for _, page in keyed)
        return ArtifactPage([rows[entry] for entry in chosen if entry in rows], truncated)

    @staticmethod
    def _rows_query(per_peer: ListQuery, keys: list[SortKey], chosen: list[tuple[SortKey, int]], source: int) -> ListQuery | None:
        """What to ask source ``source`` (whose listed ``keys`` are in order) for its rows on
        the page ``chosen``: a contiguous run of its own order, so ``limit`` rows after the
        key before the first (or after ``per_peer``'s own cursor); None if it has none there."""
        mine = [key for key, i in chosen if i == source]
        if not mine:
            return None
        first = keys.index(mine[0])
        after = keys[first - 1] if first else per_peer.after
        return ListQuery(len(mine), 0, per_peer.kind, per_peer.files_only, per_peer.purpose, after, per_peer.ascending)

    async def usage(self) -> Usage:
        own = self.store.usage()
        others = await self._gather(self._other_live_peers(), lambda p: self._remote_().usage(p),
                                    trio.current_time() + PEER_TIMEOUT_S)  # fmt: skip
        total = own
        for u in others:
            total = Usage(
                generated=total.generated + u.generated, uploaded=total.uploaded + u.uploaded,
                max_bytes=total.max_bytes + u.max_bytes if total.max_bytes and u.max_bytes else 0,
                max_objects=total.max_objects + u.max_objects if total.max_objects and u.max_objects else 0,
                default_ttl_hours=own.default_ttl_hours,
            )  # fmt: skip
        return total

    async def _gather(self, peers: list[str], ask: Callable[[str], Awaitable[T]], deadline: float) -> list[T]:
        """Ask every peer at once; those that fail or have not answered by ``deadline`` (on
        trio's clock) are left out (logged)."""
        results: list[T] = []

        async def one(peer: str) -> None:
            with trio.move_on_at(deadline):
                try:
                    results.append(await ask(peer))
                except InclavateError as exc:  # nothing may escape the nursery as a group
                    log.warning("artifact listing: peer %s left out: %s", peer, exc)
                return
            log.warning("artifact listing: peer %s left out: no answer in time", peer)

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)
        return results


async def _paired(peer: str, answer: Awaitable[T]) -> tuple[str, T]:
    return peer, await answer


async def _async(fn: Callable[[str], T], arg: str) -> T:
    return fn(arg)
