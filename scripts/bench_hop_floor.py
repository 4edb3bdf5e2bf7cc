"""The floor under a hop inside one trio process: the same engines and sockets as a chain of
peers, with less and less of the peer's code around them.

Three layer ranges pass a decode step over loopback TCP inside one process, on trio, as in
``scripts/bench_hop.py``, in four forms measured in turns, round by round, so that the
machine's drift cancels out of their differences:

- ``blocking``: ``os.write``, then ``os.read`` at once, every range computed in the step's
  own task, no wait and no scheduler turn (loopback TCP has delivered the bytes when the
  write returns): the system calls alone, what a hop that never went back to trio between
  its frames would pay (a native path, or a blocking read on a thread of its own);
- ``raw``: wait until the socket is readable, ``os.read``, compute, ``os.write`` (float16
  hidden states, a 4-byte token home): what trio and the kernel cost, nothing of ours;
- ``framed``: the same over the direct data plane's stream (:class:`p2p.sealed.SealedStream`
  over :class:`p2p.framing.FramedStream`: length-prefixed, sealed frames);
- ``framed+wire``: and every frame a :class:`p2p.wire.Forward` (or ``Result``) encoded and
  decoded as between peers.

Each round also runs the three engine calls directly; a form's hop is its median step time
above that, divided by the three frames that cross a socket. ``scripts/bench_hop.py`` then
adds what a peer adds (forward service, checks, admission, stage, kept outputs)::

    PYTHONSAFEPATH=1 PYTHONPATH=<tree> taskset -c 0 python scripts/bench_hop_floor.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from inclavate import tensors
from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.gguf_info import read_gguf_info
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, NodeId, PeerId, SessionId
from node.engine import BatchItem, EngineConfig, LayerEngine
from node.engines import load_engine
from node.sampling import SamplingParams
from p2p import wire
from p2p.framing import FramedStream
from p2p.routing import Hop
from p2p.sealed import KEY_BYTES, SealedStream

FORMS = ("blocking", "raw", "framed", "framed+wire")
LINK_FRAMES = 3
GREEDY = SamplingParams(0.0, 1.0, 0)


@dataclass
class _End:
    """One end of a link: how a form reads and writes a frame on it."""

    receive: Callable[[], Awaitable[bytes]]
    send: Callable[[bytes], None]


async def _socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    dialer = trio.socket.socket()
    await dialer.connect(listener.getsockname())
    accepted, _ = await listener.accept()
    listener.close()
    return trio.SocketStream(dialer), trio.SocketStream(accepted)


def _raw_end(stream: trio.SocketStream, *, wait: bool) -> _End:
    """Raw bytes on the socket; ``wait=False`` reads at once, with no checkpoint (the
    ``blocking`` form: the frame is already there)."""
    sock = stream.socket

    async def receive() -> bytes:
        if wait:
            await trio.lowlevel.wait_readable(sock)
        return os.read(sock.fileno(), 1 << 16)

    return _End(receive, lambda data: _write_all(sock.fileno(), data))


def _write_all(fd: int, data: bytes) -> None:
    assert os.write(fd, data) == len(data), "a decode step's frame fits the socket's buffer"


def _sealed_end(stream: trio.SocketStream, key: bytes, dialer: bool) -> _End:
    sealed = SealedStream(FramedStream.over_socket(stream), key, dialer=dialer, remote_peer=PeerId("bench"))

    def send(data: bytes) -> None:
        assert sealed.send_nowait(data), "an idle link takes a decode step's frame in place"

    return _End(lambda: sealed.receive(timeout=float("inf")), send)


async def _link(form: str) -> tuple[_End, _End]:
    """(sending end, receiving end) of one link in ``form``."""
    a, b = await _socket_pair()
    if form in ("raw", "blocking"):
        return _raw_end(a, wait=form == "raw"), _raw_end(b, wait=form == "raw")
    key = os.urandom(KEY_BYTES)
    return _sealed_end(a, key, dialer=True), _sealed_end(b, key, dialer=False)


class _Chain:
    """One form's chain: the entry computes the first range in place and sends on; a task per
    later range reads, computes and sends on; the last sends the token home."""

    def __init__(self, form: str, engines: list[LayerEngine], route: tuple[Hop, ...]) -> None:
        self.form, self.engines, self.route = form, engines, route
        self.session = SessionId(f"chain-{form}")
        self.codec = form == "framed+wire"
        self.pos = 0
        self.links: list[tuple[_End, _End]] = []

    async def start(self, nursery: trio.Nursery) -> None:
        self.links = [await _link(self.form) for _ in range(LINK_FRAMES)]
        if self.form == "blocking":
            return  # the step computes every range itself
        for index in (1, 2):
            nursery.start_soon(self._serve, index, self.links[index - 1][1], self.links[index][0])

    def _encode(self, index: int, msg: wire.Forward | None, out: Any) -> bytes:
        engine = self.engines[index]
        if self.codec:
            assert msg is not None
            if engine.info.is_last:
                return wire.encode(wire.Result(msg.req_id, msg.session_id, int(np.argmax(out.logits[-1]))))
            return wire.encode(wire.Forward(msg.req_id, msg.session_id, msg.start_pos, msg.route[1:], msg.reply_to,
                                            msg.sampling, hidden=tensors.encode(out.hidden, "f16")))  # fmt: skip
        if engine.info.is_last:
            return int(np.argmax(out.logits[-1])).to_bytes(4, "little")
        return out.hidden.astype(np.float16).tobytes()

    async def _serve(self, index: int, inbound: _End, outbound: _End) -> None:
        while True:
            outbound.send(self._hop(index, await inbound.receive()))

    def _hop(self, index: int, data: bytes) -> bytes:
        """A later range's part of a step: the frame it got in, the frame it sends on."""
        msg = None
        if self.codec:
            decoded = wire.decode(data)
            assert isinstance(decoded, wire.Forward) and decoded.hidden is not None
            msg, pos, hidden = decoded, decoded.start_pos, tensors.decode(decoded.hidden)
        else:
            pos, hidden = self.pos, np.frombuffer(data, np.float16).astype(np.float32).reshape(1, -1)
        out = self.engines[index].forward([BatchItem(self.session, pos, hidden=hidden)])[0]
        return self._encode(index, msg, out)

    async def step(self, req: int, token: int) -> int:
        tokens = np.array([token], np.int32)
        msg = wire.Forward(req, self.session, self.pos, self.route, self.route[0].peer_id, GREEDY, tokens=tokens)
        out = self.engines[0].forward([BatchItem(self.session, self.pos, tokens=tokens)])[0]
        self.links[0][0].send(self._encode(0, msg, out))
        if self.form == "blocking":
            for index in (1, 2):
                self.links[index][0].send(self._hop(index, await self.links[index - 1][1].receive()))
        data = await self.links[2][1].receive()
        self.pos += 1
        if self.codec:
            result = wire.decode(data)
            assert isinstance(result, wire.Result) and result.token is not None
            return result.token
        return int.from_bytes(data, "little")


async def measure(model_path: Any, model_id: str, n_layers: int, rounds: int) -> dict[str, float]:
    third = n_layers // 3
    ranges = [LayerRange(0, third), LayerRange(third, 2 * third), LayerRange(2 * third, n_layers)]
    engines = [load_engine("llamacpp", model_id=ModelId(model_id), model_path=model_path, layers=layers,
                           config=EngineConfig(n_threads=1)) for layers in ranges]  # fmt: skip
    peers = [PeerId(f"bench-{i}") for i in range(3)]
    route = tuple(Hop(NodeId(peer), peer, layers) for peer, layers in zip(peers, ranges))

    def engines_alone(chain: _Chain, token: int) -> int:
        """The chain's step made by direct calls, on a session of its own at the same
        position (attention's cost grows with the position)."""
        alone, pos = SessionId(f"alone-{chain.form}"), chain.pos - 1
        out = engines[0].forward([BatchItem(alone, pos, tokens=np.array([token], np.int32))])[0]
        out = engines[1].forward([BatchItem(alone, pos, hidden=out.hidden)])[0]
        out = engines[2].forward([BatchItem(alone, pos, hidden=out.hidden)])[0]
        assert out.logits is not None
        return int(np.argmax(out.logits[-1]))

    added: dict[str, list[float]] = {form: [] for form in FORMS}
    async with trio.open_nursery() as nursery:
        chains = [_Chain(form, engines, route) for form in FORMS]
        for chain in chains:
            await chain.start(nursery)
        tokens = {chain.form: 1 for chain in chains}
        alone_tokens = dict(tokens)
        for i in range(rounds + 30):  # the first 30 warm the links and caches up
            for chain in chains[i % len(chains):] + chains[: i % len(chains)]:  # each form first in turn
                started = time.perf_counter()
                tokens[chain.form] = await chain.step(i, tokens[chain.form])
                between = time.perf_counter()
                alone_tokens[chain.form] = engines_alone(chain, alone_tokens[chain.form])
                if i >= 30:
                    added[chain.form].append((between - started) - (time.perf_counter() - between))
        nursery.cancel_scope.cancel()
    for engine in engines:
        engine.close()
    return {form: statistics.median(values) * 1e3 / LINK_FRAMES for form, values in added.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--rounds", type=int, default=200, help="decode steps per form (each session holds at most 2,048 positions)")
    args = parser.parse_args()
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    pulled = ModelStore(home).pull(spec)
    n_layers = read_gguf_info(pulled.path).n_layers
    figures = trio.run(measure, pulled.path, spec.model_id, n_layers, args.rounds)
    print(f"bench_hop_floor: {args.model}, 3 ranges of {n_layers // 3} layers in one trio process, 1 engine thread, "
          f"{args.rounds} decode steps per form, in turns (pid {os.getpid()})")  # fmt: skip
    for form, ms in figures.items():
        print(f"  {form:12} {ms:.3f} ms a hop above the engine calls alone")
    print("what a peer adds on top: scripts/bench_hop.py (--stripped: its own layers alone)")


if __name__ == "__main__":
    main()
