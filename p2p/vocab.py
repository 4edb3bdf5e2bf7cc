"""``/inclavate/vocab/1``: the metadata of a model (its vocabulary and chat template) for a peer
that serves the API for a model it holds no layers of.

The answer is a tensor-less GGUF (megabytes, not the weights' gigabytes) that llama.cpp loads
``vocab_only``. Request: one frame of JSON ``{"model_id": ...}``. Answer: one frame, ``b"\\0"``
followed by the GGUF, or ``b"\\1"`` followed by a UTF-8 error message.

The file carries the chat template this peer will run, so it is never taken on a sender's
word. Each holder announces, in its signed record, the sha256 of the model file it serves
(``model_sha256``) and of the vocab-only file derived from it (``vocab_sha256``; the
derivation is deterministic, so honest holders of one file agree). :func:`choose_vocab`
asks only holders whose model hash is the catalog's (when this peer's catalog knows the
model) and takes the vocab hash most distinct holders announce; :func:`fetch_vocab` refuses,
and does not cache, bytes that do not hash to it. A liar then has to outvote every honest
holder of the model, not just answer first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import trio

from inclavate.durable import replace_durably
from inclavate.gguf_meta import GgufFormatError, read_metadata
from inclavate.types import PeerId
from inclavate.untrusted import Malformed, parse_json, read_str
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost
from p2p.registry import NodeView

log = logging.getLogger(__name__)

PROTOCOL = "/inclavate/vocab/1"
MAX_VOCAB_BYTES = 32 * 1024 * 1024
"""The largest vocab-only file accepted (262k-token vocabularies with merges are ~10 MB)."""
_OK, _ERR = b"\0", b"\1"


class VocabUnavailable(P2PError):
    """No peer could provide the model's vocabulary."""


def serve_vocab(host: P2PHost, local_vocab: Callable[[str], Path | None]) -> None:
    """Answer vocabulary requests with ``local_vocab(model_id)`` (None: we do not have it).

    Every answer is one shared bytes object (the file's last state read): each answer read
    and copied its own, held until its asker read it, and 32 unread requests from 8
    identities held 500 MiB (an audit, 2026-12-07). A limit on answers at once instead let
    one stranger's unread requests refuse every honest fetch (a review, the same day)."""
    answers: dict[tuple[str, int, int], bytes] = {}  # at most one: the file last asked for
    reading = trio.Lock()  # answers that arrive during a read wait for it, not read again

    async def answer_of(path: Path) -> bytes:
        async with reading:
            stat = await trio.to_thread.run_sync(path.stat)
            key = (str(path), stat.st_mtime_ns, stat.st_size)
            answer = answers.get(key)
            if answer is None:
                answer = _OK + await trio.to_thread.run_sync(path.read_bytes)
                answers.clear()
                answers[key] = answer
            return answer

    async def handle(stream: FramedStream, remote: PeerId) -> None:
        try:
            model_id = read_str(parse_json(await stream.receive(timeout=10.0), max_bytes=4096), "model_id", max_len=256)
        except Malformed:
            await stream.send(_ERR + b"malformed request", timeout=10.0)
            return
        path = await trio.to_thread.run_sync(local_vocab, model_id)
        if path is None:
            await stream.send(_ERR + f"this peer does not hold {model_id}".encode(), timeout=10.0)
            return
        await stream.send(await answer_of(path), timeout=60.0)

    # A peer fetches one vocabulary per model it serves or routes, rarely several at once;
    # each answer holds a file (up to 32 MiB) until read.
    host.set_stream_handler(PROTOCOL, handle, max_frame_size=MAX_VOCAB_BYTES, max_streams_per_peer=4)


@dataclass(frozen=True)
class VocabSource:
    sha256: str
    """The vocab-only file's hash the chosen holders announce."""
    peers: tuple[PeerId, ...]


def choose_vocab(views: Iterable[NodeView], model_id: str, model_sha256: str = "") -> VocabSource:
    """Which vocab file to fetch, and from whom (see the module docstring).

    ``model_sha256`` is the catalog's hash of the model ("" when this peer's catalog does
    not know it: then every holder's claim counts). Raises :class:`VocabUnavailable`."""
    claims: dict[str, set[PeerId]] = {}
    for view in views:
        r = view.record
        if r.model_id != model_id or view.state != "Ready" or not r.vocab_sha256:
            continue
        if model_sha256 and r.model_sha256 != model_sha256:
            continue  # a holder of some other file: its template is not this model's
        claims.setdefault(r.vocab_sha256, set()).add(PeerId(r.peer_id))
    if not claims:
        raise VocabUnavailable(f"no Ready holder of {model_id} announces a verifiable vocabulary yet")
    votes = Counter({sha: len(peers) for sha, peers in claims.items()})
    sha = max(votes, key=lambda h: (votes[h], h))
    return VocabSource(sha, tuple(sorted(claims[sha])))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


async def fetch_vocab(host: P2PHost, model_id: str, source: VocabSource, dest: Path) -> Path:
    """Fetch the vocabulary hashing to ``source.sha256`` from the first of its peers that
    sends it, into ``dest``; nothing that fails the hash is written."""
    failures = []
    for peer in source.peers:
        try:
            stream = await host.new_stream(peer, PROTOCOL, timeout=5.0, max_frame_size=MAX_VOCAB_BYTES)
            async with stream:
                await stream.send(json.dumps({"model_id": model_id}).encode(), timeout=10.0)
                answer = await stream.receive(timeout=60.0)
        except P2PError as exc:
            failures.append(f"{peer}: {exc}")
            continue
        if answer[:1] != _OK:
            failures.append(f"{peer}: {answer[1:200].decode(errors='replace')}")
            continue
        data = answer[1:]
        if hashlib.sha256(data).hexdigest() != source.sha256:
            log.warning("%s sent a vocabulary of %s that does not match its announced sha256; refused", peer, model_id)
            failures.append(f"{peer}: sent a file that does not match the announced sha256")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        await trio.to_thread.run_sync(tmp.write_bytes, data)
        try:
            read_metadata(tmp)
        except GgufFormatError as exc:
            tmp.unlink(missing_ok=True)
            failures.append(f"{peer}: sent an invalid file ({exc})")
            continue
        replace_durably(tmp, dest)
        log.info("fetched the vocabulary of %s from %s (sha256 %s)", model_id, peer, source.sha256[:16])
        return dest
    raise VocabUnavailable(f"no peer provided the vocabulary of {model_id}: " + "; ".join(failures or ["no peer serves it"]))
