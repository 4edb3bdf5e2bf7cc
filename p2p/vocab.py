"""``/inclavate/vocab/1``: the metadata of a model (its vocabulary and chat template) for a peer
that serves the API for a model it holds no layers of.

The answer is a tensor-less GGUF (megabytes, not the weights' gigabytes) that llama.cpp loads
``vocab_only``. Request: one frame of JSON ``{"model_id": ...}``. Answer: one frame, ``b"\\0"``
followed by the GGUF, or ``b"\\1"`` followed by a UTF-8 error message.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import trio

from inclavate.gguf_meta import GgufFormatError, read_metadata
from inclavate.types import PeerId
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost

log = logging.getLogger(__name__)

PROTOCOL = "/inclavate/vocab/1"
MAX_VOCAB_BYTES = 64 * 1024 * 1024
_OK, _ERR = b"\0", b"\1"


class VocabUnavailable(P2PError):
    """No peer could provide the model's vocabulary."""


def serve_vocab(host: P2PHost, local_vocab: Callable[[str], Path | None]) -> None:
    """Answer vocabulary requests with ``local_vocab(model_id)`` (None: we do not have it)."""

    async def handle(stream: FramedStream, remote: PeerId) -> None:
        try:
            model_id = str(json.loads(await stream.receive(timeout=10.0))["model_id"])
        except (ValueError, KeyError, TypeError):
            await stream.send(_ERR + b"malformed request", timeout=10.0)
            return
        path = await trio.to_thread.run_sync(local_vocab, model_id)
        if path is None:
            await stream.send(_ERR + f"this peer does not hold {model_id}".encode(), timeout=10.0)
            return
        data = await trio.to_thread.run_sync(path.read_bytes)
        await stream.send(_OK + data, timeout=60.0)

    host.set_stream_handler(PROTOCOL, handle, max_frame_size=MAX_VOCAB_BYTES)


async def fetch_vocab(host: P2PHost, model_id: str, peers: list[PeerId], dest: Path) -> Path:
    """Fetch the vocabulary from the first of ``peers`` that has it, into ``dest``."""
    failures = []
    for peer in peers:
        try:
            stream = await host.new_stream(peer, PROTOCOL, timeout=5.0, max_frame_size=MAX_VOCAB_BYTES)
            async with stream:
                await stream.send(json.dumps({"model_id": model_id}).encode(), timeout=10.0)
                answer = await stream.receive(timeout=60.0)
        except P2PError as exc:
            failures.append(f"{peer}: {exc}")
            continue
        if answer[:1] != _OK:
            failures.append(f"{peer}: {answer[1:].decode(errors='replace')}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        await trio.to_thread.run_sync(tmp.write_bytes, answer[1:])
        try:
            read_metadata(tmp)
        except GgufFormatError as exc:
            tmp.unlink(missing_ok=True)
            failures.append(f"{peer}: sent an invalid file ({exc})")
            continue
        os.replace(tmp, dest)
        log.info("fetched the vocabulary of %s from %s", model_id, peer)
        return dest
    raise VocabUnavailable(f"no peer provided the vocabulary of {model_id}: " + "; ".join(failures or ["no peer serves it"]))
