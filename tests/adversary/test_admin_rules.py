"""Admin commands between peers name their recipient; the token stays out of argv if asked."""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from inclavate.config import ADMIN_TOKEN_ENV
from inclavate.errors import ConfigError
from inclavate.peer_cmd import admin_token
from p2p.admin import AdminCommand, AdminRefused, AdminService, decode_command, encode_command
from p2p.identity import Identity

OPERATOR = Identity.generate()
ME = Identity.generate()
OTHER = Identity.generate()


def service(runs: list[AdminCommand]) -> AdminService:
    async def execute(command: AdminCommand) -> dict[str, Any]:
        runs.append(command)
        return {}

    return AdminService(None, ME, [OPERATOR.peer_id], execute)  # type: ignore[arg-type]


async def test_a_command_for_another_peer_is_refused() -> None:
    runs: list[AdminCommand] = []
    meant_for_other = AdminCommand("set_state", OTHER.peer_id, OPERATOR.peer_id, OTHER.peer_id, {"state": "idle"})
    captured = decode_command(encode_command(meant_for_other, OPERATOR))  # replayed to us
    with pytest.raises(AdminRefused, match="another peer"):
        await service(runs)._obey(captured)
    ours = AdminCommand("set_state", ME.peer_id, OPERATOR.peer_id, ME.peer_id, {"state": "idle"})
    assert await service(runs)._obey(decode_command(encode_command(ours, OPERATOR))) == {"ok": True}
    assert runs == [ours]


async def test_a_stranger_s_commands_are_answered_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Any identity may send signed commands, as fast as it likes: each refusal was a warning
    carrying the stranger's text, 780 KB of log in 3 s (an audit, 2026-12-07)."""
    stranger = Identity.generate()
    command = AdminCommand("reassign", "n1\nwarning: forged", stranger.peer_id, ME.peer_id, {})
    with caplog.at_level("INFO"), pytest.raises(AdminRefused, match="not trusted"):
        await service([])._obey(decode_command(encode_command(command, stranger)))
    assert caplog.records == []


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000,
        b'{"command": 1, "sig": ""}',
        json.dumps({"command": json.dumps({"action": "reassign"}), "sig": ""}).encode(),
        json.dumps({"command": "[" * 5000, "sig": ""}).encode(),
    ],
)
def test_malformed_admin_frames_are_refused_not_raised(data: bytes) -> None:
    with pytest.raises(AdminRefused):
        decode_command(data)


def test_a_command_without_a_recipient_does_not_decode() -> None:
    body = {"action": "set_state", "target": "x", "issuer": OPERATOR.peer_id, "args": {}, "ts_ms": 1, "nonce": "n"}
    payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    frame = json.dumps({"command": payload.decode(), "sig": base64.b64encode(OPERATOR.sign(payload)).decode()}).encode()
    with pytest.raises(AdminRefused, match="recipient"):
        decode_command(frame)


def args(token: str | None = None, file: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(admin_token=token, admin_token_file=file)


def test_admin_token_from_argv_file_or_environment(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text("from-file\n")
    assert admin_token(args("from-argv", file), {ADMIN_TOKEN_ENV: "from-env"}) == "from-argv"
    assert admin_token(args(None, file), {ADMIN_TOKEN_ENV: "from-env"}) == "from-file"
    assert admin_token(args(), {ADMIN_TOKEN_ENV: "from-env"}) == "from-env"
    assert admin_token(args(), {}) is None
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        admin_token(args(None, tmp_path / "empty"), {})
    with pytest.raises(ConfigError, match="cannot read"):
        admin_token(args(None, tmp_path / "missing"), {})


@pytest.mark.parametrize("answer", [b"[]", b'"ok"', b"[" * 5000 + b"]" * 5000, b"\xff", b'{"ok": true'])
async def test_an_answer_that_is_not_an_object_is_a_refusal(answer: bytes) -> None:
    """The recipient's answer is a stranger's bytes like any other: a shape we cannot read is
    the command refused, never an exception escaping into the admin route (a 500)."""

    class Stream:
        async def __aenter__(self) -> Stream:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def send(self, data: bytes, timeout: float) -> None:
            return None

        async def receive(self, timeout: float) -> bytes:
            return answer

    class Host:
        async def new_stream(self, peer: str, protocol: str, **_: object) -> Stream:
            return Stream()

    admin = AdminService(Host(), OPERATOR, [], lambda command: None)  # type: ignore[arg-type]
    with pytest.raises(AdminRefused, match="did not run the command"):
        await admin.send(OTHER.peer_id, admin.command("set_state", OTHER.peer_id, OTHER.peer_id, state="idle"))
