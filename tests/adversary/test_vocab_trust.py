"""Vocabulary (and chat template) files fetched from peers are verified before use: only
holders of the catalog's model file are asked, the hash most holders announce wins, and
bytes that do not match are refused and never cached."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import trio
from registry_helpers import view

from inclavate.types import PeerId
from node.gguf_slice import write_vocab_only
from p2p.host import open_host
from p2p.identity import Identity
from p2p.vocab import VocabSource, VocabUnavailable, choose_vocab, fetch_vocab, serve_vocab

MODEL_SHA = "a" * 64
GOOD, EVIL = "1" * 64, "2" * 64


def holder(name: str, vocab: str, model_sha: str = MODEL_SHA, state: str = "Ready"):  # type: ignore[no-untyped-def]
    return view(name, 0, 30, state, model_sha256=model_sha, vocab_sha256=vocab)


def test_the_hash_most_holders_of_the_catalog_file_announce_wins() -> None:
    views = [holder("h1", GOOD), holder("h2", GOOD), holder("liar", EVIL)]
    assert choose_vocab(views, "m:1", MODEL_SHA) == VocabSource(GOOD, (PeerId("h1"), PeerId("h2")))
    # Holders of another file are not asked, however many they are.
    sybils = [holder(f"s{i}", EVIL, model_sha="b" * 64) for i in range(5)]
    assert choose_vocab([holder("h1", GOOD), *sybils], "m:1", MODEL_SHA).sha256 == GOOD
    # Not Ready, or no hash announced yet: not a source.
    with pytest.raises(VocabUnavailable):
        choose_vocab([holder("j", GOOD, state="Joining"), holder("n", "")], "m:1", MODEL_SHA)


@pytest.mark.slow
async def test_a_peer_serving_other_bytes_is_refused_and_nothing_is_cached(tmp_path: Path, smollm2) -> None:
    honest_file = write_vocab_only(smollm2.path, tmp_path / "honest.gguf")
    good_sha = hashlib.sha256(honest_file.read_bytes()).hexdigest()
    evil_file = tmp_path / "evil.gguf"
    evil_file.write_bytes(honest_file.read_bytes().replace(b"im_start", b"im_stArt"))  # a doctored template
    dest = tmp_path / "cache" / "vocab.gguf"
    with trio.fail_after(60):
        async with open_host(Identity.generate()) as honest, open_host(Identity.generate()) as evil, \
                open_host(Identity.generate()) as me:  # fmt: skip
            serve_vocab(honest, lambda _model: honest_file)
            serve_vocab(evil, lambda _model: evil_file)
            for peer in (honest, evil):
                await me.connect(peer.multiaddrs()[0])
            # The liar is asked first and refused; the honest copy is taken.
            source = VocabSource(good_sha, (evil.peer_id, honest.peer_id))
            assert await fetch_vocab(me, "m:1", source, dest) == dest
            assert hashlib.sha256(dest.read_bytes()).hexdigest() == good_sha
            dest.unlink()
            with pytest.raises(VocabUnavailable, match="does not match"):
                await fetch_vocab(me, "m:1", VocabSource(good_sha, (evil.peer_id,)), dest)
            assert not dest.exists() and not any(dest.parent.iterdir())


async def test_vocabulary_answers_share_one_copy_however_many_strangers_ask(tmp_path: Path) -> None:
    """Each answer read and copied the file for itself, held until its asker read it: 32
    unread requests from 8 identities held 500 MiB (an audit, 2026-12-07). Every answer is
    now one shared bytes object, and unread ones refuse no honest fetch."""
    from p2p.vocab import PROTOCOL

    big = tmp_path / "vocab.gguf"
    big.write_bytes(b"v" * (4 << 20))  # more than a stream's window: an unread answer waits
    reads: list[int] = []

    def local_vocab(_model: str) -> Path:
        reads.append(1)
        return big

    read_bytes = Path.read_bytes
    counted: list[Path] = []

    def counting(path: Path) -> bytes:
        counted.append(path)
        time.sleep(0.3)  # a slow disk: answers asked during a read must wait for it, not read again
        return read_bytes(path)

    with trio.fail_after(60), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "read_bytes", counting)
        async with open_host(Identity.generate()) as holder, open_host(Identity.generate()) as asker:
            serve_vocab(holder, local_vocab)
            await asker.connect(holder.multiaddrs()[0])
            unread = []
            for _ in range(3):  # with the one below, as many as one peer may open at once
                stream = await asker.new_stream(holder.peer_id, PROTOCOL, timeout=10, max_frame_size=8 << 20)
                await stream.send(b'{"model_id": "m:1"}', timeout=10)
                unread.append(stream)
            await trio.sleep(0.5)  # the holder starts every answer, and waits on their readers
            another = await asker.new_stream(holder.peer_id, PROTOCOL, timeout=10, max_frame_size=8 << 20)
            await another.send(b'{"model_id": "m:1"}', timeout=10)
            answer = await another.receive(timeout=30)
            assert answer[:1] == b"\0" and len(answer) == (4 << 20) + 1
            assert len(reads) == 4 and counted == [big]  # four answers, one read of the file
            for stream in unread:
                await stream.reset()
