"""A neighbour's answer to our registry sync (``/inclavate/registry-sync/1``) is hostile input
we asked for: we ask on every connection, so a stranger can make us read one as often as it
reconnects. What it may cost us is bounded: records repeated in one answer are decoded once, a
long answer is applied with the event loop still turning, and a reconnecting neighbour is not
asked again at once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import TracebackType

import trio
from registry_helpers import signed

from inclavate.types import PeerId
from p2p.gossip import RegistryService
from p2p.identity import Identity
from p2p.records import legacy_node_id
from p2p.registry import Liveness, Verdict

NOW = 1_000_000
ME, MALLORY = Identity.generate(), Identity.generate()


class _Answer:
    """A sync stream whose far end answers ``payload``."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    async def __aenter__(self) -> _Answer:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        return None

    async def send(self, data: bytes, timeout: float) -> None:
        return None

    async def receive(self, timeout: float) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.payload


class _Neighbour:
    """A host whose every neighbour answers a sync with ``records``."""

    def __init__(self, records: list[str]) -> None:
        self.payload = json.dumps({"records": records}).encode()
        self.asked = 0

    async def new_stream(self, peer: PeerId, protocol: str, *, timeout: float, max_frame_size: int) -> _Answer:
        self.asked += 1
        return _Answer(self.payload)


def _service(host: object) -> RegistryService:
    return RegistryService(host, ME, Liveness(), clock=lambda: NOW)  # type: ignore[arg-type]


async def _pull_counting_turns(service: RegistryService) -> tuple[int, int]:
    """(records accepted, turns another task got while the answer was applied)."""
    turns = 0
    async with trio.open_nursery() as nursery:

        async def other_work() -> None:
            nonlocal turns
            while True:
                await trio.lowlevel.checkpoint()
                turns += 1

        nursery.start_soon(other_work)
        accepted = await service.sync_with(MALLORY.peer_id)
        nursery.cancel_scope.cancel()
    return accepted, turns


async def test_a_record_repeated_in_a_sync_answer_is_decoded_once() -> None:
    one = signed(MALLORY, 0, 10, seq=NOW, ts_ms=NOW).encode().decode()
    service = _service(_Neighbour([one] * 2000))
    decoded = 0
    decode = service._decode

    def counting(data: bytes):  # type: ignore[no-untyped-def]
        nonlocal decoded
        decoded += 1
        return decode(data)

    service._decode = counting  # type: ignore[method-assign]
    accepted, _ = await _pull_counting_turns(service)
    assert (accepted, decoded) == (1, 1)
    assert service.drops[Verdict.DUPLICATE] == 1999


async def test_a_long_sync_answer_leaves_the_event_loop_turning() -> None:
    """Before, the whole answer was decoded and applied in one turn: thousands of records
    from throw-away signers held every other task (forward frames, heartbeats) for seconds."""
    records = [signed(MALLORY, 0, 10, node_id=legacy_node_id(MALLORY.peer_id, f"n{i}"), relayed=True,
                      seq=NOW, ts_ms=NOW).encode().decode() for i in range(60)]  # fmt: skip
    for _ in range(4):
        signer = Identity.generate()
        records += [signed(signer, 0, 10, seq=NOW, ts_ms=NOW).encode().decode()]
    service = _service(_Neighbour(records))
    accepted, turns = await _pull_counting_turns(service)
    assert accepted == len(records)
    assert turns >= len(records)  # a turn for the rest of the peer between every two records
    assert len(service.table) == len(records)


@dataclass
class _Event:
    peer: PeerId
    connected: bool = True


async def test_a_neighbour_that_reconnects_is_not_synced_with_again_at_once() -> None:
    host = _Neighbour([])
    service = _service(host)
    synced: list[str] = []

    async def sync_with(peer: str) -> int:
        synced.append(peer)
        return 0

    service.sync_with = sync_with  # type: ignore[method-assign]
    other = Identity.generate().peer_id
    send, receive = trio.open_memory_channel[_Event](16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._sync_on_connect, receive, nursery)
        for peer in (MALLORY.peer_id, MALLORY.peer_id, other, MALLORY.peer_id):
            await send.send(_Event(peer))
        await send.aclose()
    assert synced == [MALLORY.peer_id, other]
