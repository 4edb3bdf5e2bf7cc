"""Admin commands between peers: signed by the peer that authenticated the admin.

An operator talks to one peer's REST API with ``X-Admin-Token``. When the command concerns a
node held by another peer, the token never leaves the first peer: instead that peer signs the
command with its own key and sends it over ``/inclavate/admin/1``. A receiver obeys only
commands signed by peers it trusts for administration (itself, and ``--admin-peer`` ids),
recently (bounded clock skew), once (nonces are remembered) and only when it names this peer
as its ``recipient`` (a command captured on its way to one peer cannot be replayed to
another); anything else is refused and logged.

Frames: request = JSON ``{"command": "<canonical JSON>", "sig": "<base64>"}``; answer = JSON
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import trio

from inclavate.errors import InclavateError
from inclavate.types import PeerId
from inclavate.untrusted import Malformed, as_dict, parse_json, read_dict, read_int, read_str
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost
from p2p.identity import Identity, verify

log = logging.getLogger(__name__)

PROTOCOL = "/inclavate/admin/1"
MAX_SKEW_MS = 60_000
_NONCE_MEMORY_S = 300.0
_MAX_NONCES = 10_000
_MAX_FRAME = 64 * 1024

Action = Literal["reassign", "set_state", "force_remove", "erase_generation"]
_ACTIONS = frozenset(("reassign", "set_state", "force_remove", "erase_generation"))


class AdminRefused(P2PError):
    """The target peer refused or could not run the command (the reason is in the message)."""


@dataclass(frozen=True)
class AdminCommand:
    action: Action
    target: str
    """The node the command is about."""
    issuer: PeerId
    recipient: PeerId
    """The one peer meant to run it."""
    args: dict[str, Any] = field(default_factory=dict)
    ts_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    nonce: str = field(default_factory=lambda: secrets.token_hex(16))

    def payload(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


def encode_command(command: AdminCommand, identity: Identity) -> bytes:
    if command.issuer != identity.peer_id:
        raise ValueError("a command is signed by its issuer")
    payload = command.payload()
    return json.dumps({"command": payload.decode(), "sig": base64.b64encode(identity.sign(payload)).decode()}).encode()


def decode_command(data: bytes) -> AdminCommand:
    """Parse and check the signature (against the issuer's PeerID); trust is the caller's."""
    try:
        envelope = parse_json(data, max_bytes=_MAX_FRAME, max_depth=2)
        payload = read_str(envelope, "command", max_len=_MAX_FRAME).encode()
        signature = base64.b64decode(read_str(envelope, "sig", max_len=128), validate=True)
        body = parse_json(payload, max_bytes=_MAX_FRAME, max_depth=4)
        command = AdminCommand(
            action=read_str(body, "action", max_len=32, choices=_ACTIONS),  # type: ignore[arg-type]
            target=read_str(body, "target", max_len=256),
            issuer=PeerId(read_str(body, "issuer", max_len=128)),
            recipient=PeerId(read_str(body, "recipient", max_len=128)),
            args=read_dict(body, "args", max_len=16),
            ts_ms=read_int(body, "ts_ms", lo=0, hi=2**53),
            nonce=read_str(body, "nonce", max_len=64),
        )
    except Malformed as exc:
        raise AdminRefused(f"malformed admin command: {exc}") from None
    except (binascii.Error, ValueError):
        raise AdminRefused("malformed admin command: sig is not base64") from None
    if not verify(command.issuer, payload, signature):
        raise AdminRefused("admin command signature does not match its issuer")
    return command


Executor = Callable[[AdminCommand], Awaitable[dict[str, Any]]]


class AdminService:
    def __init__(self, host: P2PHost, identity: Identity, trusted: Iterable[str], execute: Executor) -> None:
        self.host = host
        self.identity = identity
        self.trusted = {PeerId(p) for p in trusted} | {identity.peer_id}
        self.execute = execute
        self._seen: dict[str, float] = {}

    def start(self) -> None:
        # The default cap (8 per peer): an admin peer sends one command per operator request.
        self.host.set_stream_handler(PROTOCOL, self._serve, max_frame_size=_MAX_FRAME)

    def command(self, action: Action, target: str, recipient: PeerId, **args: Any) -> AdminCommand:
        return AdminCommand(action, target, self.identity.peer_id, recipient, args)

    async def send(self, peer: PeerId, command: AdminCommand, timeout: float = 180.0) -> dict[str, Any]:
        """Run ``command`` on ``peer`` (or here); raises :class:`AdminRefused` with its reason."""
        if command.recipient != peer:
            raise ValueError("a command is sent only to the recipient it names")
        if peer == self.identity.peer_id:
            answer = await self._obey(command)
        else:
            try:
                stream = await self.host.new_stream(peer, PROTOCOL, timeout=10.0, max_frame_size=_MAX_FRAME)
                async with stream:
                    await stream.send(encode_command(command, self.identity), timeout=10.0)
                    answer = as_dict(parse_json(await stream.receive(timeout=timeout), max_bytes=_MAX_FRAME), "answer")
            except (P2PError, ValueError) as exc:  # Malformed is a ValueError: any shape but an object
                raise AdminRefused(f"peer {peer} did not run the command: {exc}") from exc
        if not answer.get("ok"):
            raise AdminRefused(str(answer.get("error", "refused")))
        return answer

    async def _serve(self, stream: FramedStream, remote: PeerId) -> None:
        data = await stream.receive(timeout=10.0)
        try:
            command = decode_command(data)
            answer = await self._obey(command)
        except AdminRefused as exc:
            # Any identity may send one, as often as it likes: refusals are the sender's to
            # read, and at warning level they were a flood of the stranger's text in our log.
            log.debug("refused an admin command from %s: %s", remote, exc)
            answer = {"ok": False, "error": str(exc)}
        await stream.send(json.dumps(answer).encode(), timeout=10.0)

    async def _obey(self, command: AdminCommand) -> dict[str, Any]:
        now = time.time()
        if command.issuer not in self.trusted:  # answered, not logged (see _serve)
            raise AdminRefused(f"peer {command.issuer} is not trusted for administration here (the peer holding "
                               f"the node trusts it once started with --admin-peer {command.issuer})")  # fmt: skip
        if command.recipient != self.identity.peer_id:
            log.warning("refused %s of %s: addressed to %s, not to this peer", command.action, command.target, command.recipient)
            raise AdminRefused("admin command is addressed to another peer")
        if abs(now * 1000 - command.ts_ms) > MAX_SKEW_MS:
            raise AdminRefused("admin command is stale or from the future")
        self._seen = {n: t for n, t in self._seen.items() if now - t < _NONCE_MEMORY_S}
        if len(self._seen) >= _MAX_NONCES:
            raise AdminRefused("too many admin commands in the last minutes; try again later")
        if command.nonce in self._seen:
            raise AdminRefused("admin command replayed")
        self._seen[command.nonce] = now
        log.info("admin: %s %s %s (issued by %s)", command.action, command.target, command.args, command.issuer)
        try:
            with trio.fail_after(300):
                return {"ok": True, **await self.execute(command)}
        except InclavateError as exc:
            raise AdminRefused(str(exc)) from exc
