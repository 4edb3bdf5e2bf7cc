"""The swarm's artifacts seen from one peer: its own store, and every other peer's over
``/inclavate/artifacts/2``. The API talks only to this (``PeerContext.artifacts()``).

Where an id lives: its owner tag (:mod:`inclavate.owner_ids`) names the peer, so a read,
a meta or a delete goes straight to the owner: locally when the tag is ours, else to the
registry peer(s) carrying that tag (its whole 60 bits; a legacy id's 32 when none does).
No lookup protocol, no replicated index. An id whose tag matches no known peer is 404; an
owner that is known but does not answer is 503 (the artifact may well exist; a 404 would
tell a client it is gone for good).

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
failing the whole listing; a row deleted between the steps is left out too. Peers are
asked a bounded number at a time, and their keys merged into the best ``offset + limit``
as they arrive (:class:`KeyWindow`): what a listing holds does not grow with the number of
identities in the registry; which peers are asked first when not all can be is
:meth:`inclavate.fan_out.FanOut.order`. Usage sums the peers' COUNT/SUM totals; its ceilings are the
sum of the peers' own (a store's quota guards its owner's disk), 0 if any peer has none.
"""

from __future__ import annotations

import functools
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
from inclavate.fan_out import AskBudget, FanOut, keep_best, listing_budget
from inclavate.owner_ids import Owners, owner_candidates, parse_id
from p2p.artifact_wire import row_allowance

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 5.0
"""The longest a peer may hold a listing (both its steps) or a usage total."""
KEYS_SHARE_S = PEER_TIMEOUT_S / 2
"""A listing's first step (the keys) ends this long after the listing began, however
late some peer is: the rows step then has the rest, at least as long. With one deadline
for both, a peer answering its keys just in time left the honest peers no time for their
rows; with ``PEER_TIMEOUT_S`` each, it held every listing twice that
(tests/test_artifact_swarm.py::test_a_peer_slow_at_both_steps_of_a_listing_holds_it_at_most_peer_timeout_s)."""

ROW_BYTES_PER_LISTING = 32 * 2**20
"""The rows one listing's rows step may hold, all peers together: each peer's rows request
allows its count of rows on the page times its share (:func:`p2p.artifact_wire.row_allowance`,
never less than the longest honest row). Allowing each row ``MAX_ROW_BYTES`` (~20 KiB),
a Files page of 10 000 rows could hold 200 MB per listing."""

T = TypeVar("T")


class RemoteStores(Protocol):
    """Other peers' stores (``p2p.artifacts.RemoteArtifacts``)."""

    async def meta(self, peer: str, id_: str) -> ArtifactMeta: ...
    async def open(self, peer: str, id_: str, range_header: str | None) -> ArtifactRead: ...
    async def delete(self, peer: str, id_: str) -> None: ...
    async def list(self, peer: str, query: ListQuery, owners: Owners, row_bytes: int = ...) -> ArtifactPage: ...
    async def key_answer(self, peer: str, query: ListQuery) -> bytes: ...
    async def decode_keys(self, peer: str, raw: bytes, query: ListQuery, owners: Owners) -> KeyPage: ...
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
        self.fan_out = FanOut("artifact listing")
        """Asks peers in turns; :meth:`FanOut.sibling` shares its asks-in-flight limit."""

    # -- one artifact, wherever it lives ------------------------------------------------

    async def meta(self, id_: str) -> ArtifactMeta:
        return await self._at_owner(
            id_, lambda id_: _async(self.store.meta, id_), lambda p, id_: self._remote_().meta(p, id_)
        )

    async def open(self, id_: str, range_header: str | None = None) -> ArtifactRead:
        """A ready artifact's bytes (ArtifactNotReady, Range errors, ArtifactNotFound)."""
        return await self._at_owner(
            id_, lambda id_: self.store.open(id_, range_header), lambda p, id_: self._remote_().open(p, id_, range_header)
        )

    async def read_all(self, id_: str, max_bytes: int) -> tuple[ArtifactMeta, bytes]:
        """A whole artifact in memory, for small inputs (a generator's clip, a prompt)."""
        read = await self.open(id_)
        return read.meta, await read_whole(read, max_bytes)

    async def delete(self, id_: str) -> None:
        async def local(id_: str) -> None:
            await self.store.delete(id_)

        await self._at_owner(id_, local, lambda p, id_: self._remote_().delete(p, id_))

    async def _at_owner(
        self, id_: str, local: Callable[[str], Awaitable[T]], remote: Callable[[str, str], Awaitable[T]]
    ) -> T:
        """``local(id)`` or ``remote(peer, id)`` with the canonical id: a UUID is case-insensitive,
        and an owner describes its artifact by the canonical id, which the asker checks against
        the id it asked about (an uppercase id through another peer was a 503)."""
        id_ = parse_id(id_)
        me = self.store.owner
        candidates = owner_candidates(id_, [me, *self._known()])
        attempts: list[Callable[[], Awaitable[T]]] = [functools.partial(local, id_)] if me in candidates else []
        if self._remote is not None:
            attempts += [functools.partial(remote, p, id_) for p in candidates if p != me]
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
        """Every other live peer, in the order a fan-out asks them (:meth:`FanOut.order`)."""
        if self._remote is None:
            return []
        return self.fan_out.order(set(self._live()) - {self.store.owner})

    async def list(self, query: ListQuery) -> ArtifactPage:
        """One page of the swarm's artifacts (the module's docstring), in one of this peer's
        listing turns (:meth:`FanOut.gate`: :class:`~inclavate.fan_out.ListingsBusy` when
        none comes free in time)."""
        peers = self._other_live_peers()
        if not peers:
            return self.store.list(query)
        window = query.offset + query.limit
        if window > SWARM_LIST_WINDOW:
            raise BadArtifactRequest(
                f"offset + limit may reach at most {SWARM_LIST_WINDOW} rows in a swarm-wide listing; "
                "narrow it with kind, or delete what is no longer needed"
            )
        async with self.fan_out.gate.turn():
            return await self._list_swarm(query, peers, window)

    async def _list_swarm(self, query: ListQuery, peers: list[str], window: int) -> ArtifactPage:
        per_peer = ListQuery(window, 0, query.kind, query.files_only, query.purpose, query.after, query.ascending)
        began = trio.current_time()
        owners = Owners([self.store.owner, *self._known(), *peers])  # whose ids a peer may list
        own = self.store.list(per_peer)
        kept = KeyWindow(window, descending=not query.ascending)
        kept.add([m.sort_key() for m in own.artifacts], None)
        truncated = own.truncated

        def take_keys(peer: str, page: KeyPage) -> None:
            nonlocal truncated
            truncated = truncated or page.truncated
            kept.add(page.keys, peer)

        budget: AskBudget[KeyPage] = AskBudget(listing_budget(window), window, lambda page: len(page.keys))
        remote = self._remote_()
        await self.fan_out.ask(peers, lambda p: remote.key_answer(p, per_peer), take_keys, began + KEYS_SHARE_S, budget,
                               decode=lambda p, raw: remote.decode_keys(p, raw, per_peer, owners))  # fmt: skip
        chosen = kept.entries[query.offset :]
        rows = {(m.sort_key(), 0): m for m in own.artifacts}
        asks = kept.row_queries(query.offset, per_peer)
        row_bytes = row_allowance(len(chosen), ROW_BYTES_PER_LISTING)

        answered: set[str] = set()

        def take_rows(peer: str, page: ArtifactPage) -> None:
            source = kept.source_of[peer]
            rows.update(((m.sort_key(), source), m) for m in page.artifacts)
            answered.add(peer)

        await self.fan_out.ask(list(asks), lambda p: self._remote_().list(p, asks[p], owners, row_bytes), take_rows,
                               began + PEER_TIMEOUT_S)  # fmt: skip
        # Peers that answered rows on this page (placing keys costs nothing), the page's
        # first rows' peers remembered last, so asked first.
        self.fan_out.remember([p for p in reversed(asks) if p in answered])
        return ArtifactPage([rows[entry] for entry in chosen if entry in rows], truncated or kept.overflow)

    async def usage(self) -> Usage:
        total = own = self.store.usage()

        def take(peer: str, u: Usage) -> None:
            nonlocal total
            total = Usage(
                generated=total.generated + u.generated, uploaded=total.uploaded + u.uploaded,
                max_bytes=total.max_bytes + u.max_bytes if total.max_bytes and u.max_bytes else 0,
                max_objects=total.max_objects + u.max_objects if total.max_objects and u.max_objects else 0,
                default_ttl_hours=own.default_ttl_hours,
            )  # fmt: skip

        await self.fan_out.ask(self._other_live_peers(), lambda p: self._remote_().usage(p), take,
                            trio.current_time() + PEER_TIMEOUT_S)  # fmt: skip
        return total

class KeyWindow:
    """The best ``size`` sort keys of a listing so far, each with the peer that listed it
    (None: this peer), merged in as each answer arrives: a listing holds O(``size``) keys
    whatever the number of peers answering, where keeping every answer until the merge held
    ``size`` per peer."""

    def __init__(self, size: int, descending: bool) -> None:
        self.size, self.descending = size, descending
        self.entries: list[tuple[SortKey, int]] = []
        """In the listing's order; the int names the source (0: this peer)."""
        self.source_of: dict[str, int] = {}
        self._peers: list[str | None] = []
        self.overflow = False
        """Whether a key fell past ``size``: there are more rows than the window."""

    def add(self, keys: list[SortKey], peer: str | None) -> None:
        """Merge one source's ``keys`` (in the listing's order) in, keeping the best ``size``."""
        source = len(self._peers)
        self._peers.append(peer)
        if peer is not None:
            self.source_of[peer] = source
        if keep_best(self.entries, ((key, source) for key in keys), self.size, descending=self.descending):
            self.overflow = True

    def row_queries(self, offset: int, per_peer: ListQuery) -> dict[str, ListQuery]:
        """What to ask each peer with rows on the page (the entries from ``offset``): a
        contiguous run of its own order, its count of rows after the key it listed just
        before them (all its keys ahead of the page are kept too: they rank higher), or
        after ``per_peer``'s own cursor; the page's first rows' peers first."""
        before: dict[int, SortKey] = {}
        for key, source in self.entries[:offset]:
            before[source] = key
        counts: dict[int, int] = {}
        for _, source in self.entries[offset:]:
            counts[source] = counts.get(source, 0) + 1
        asks: dict[str, ListQuery] = {}
        for source, count in counts.items():
            peer = self._peers[source]
            if peer is not None:
                after = before.get(source, per_peer.after)
                asks[peer] = ListQuery(count, 0, per_peer.kind, per_peer.files_only, per_peer.purpose, after,
                                       per_peer.ascending)  # fmt: skip
        return asks


async def _async(fn: Callable[[str], T], arg: str) -> T:
    return fn(arg)
