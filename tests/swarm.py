"""Real peers in separate processes on 127.0.0.1, for swarm tests.

A thin layer over :class:`inclavate.local_swarm.LocalSwarm`: peers use the shared test home
(the model is pulled once), small KV caches and one thread each, and a failing test prints
every peer's log tail.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import DEFAULT_MODEL, TEST_HOME

from inclavate.local_swarm import LocalSwarm, PeerProcess, SwarmError, request_json

__all__ = ["PeerProcess", "Swarm", "SwarmError", "request_json", "stage_sessions"]

# Several peers share 2 cores in CI: one thread each and small KV caches.
PEER_DEFAULTS = ["--threads", "1", "--context", "512", "--max-sessions", "4", "--no-mdns", "--p2p-host", "127.0.0.1"]


class Swarm(LocalSwarm):
    def __init__(self, tmp_path: Path, *, extra_args: list[str] | None = None) -> None:
        super().__init__(tmp_path, [*PEER_DEFAULTS, *(extra_args or [])], {"INCLAVATE_HOME": str(TEST_HOME)})

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.stop_all()
        if exc_type is not None:
            for peer in self.peers:
                print(f"----- {peer.name} (port {peer.api_port}) -----\n{peer.log_tail()}", file=sys.stderr)

    def start(self, name: str, *args: str, bootstrap: PeerProcess | None = None,  # type: ignore[override]
              model: str = DEFAULT_MODEL, env: dict[str, str] | None = None) -> PeerProcess:  # fmt: skip
        return super().start(name, model, *args, bootstrap=bootstrap, env=env)


def stage_sessions(peer: PeerProcess) -> int:
    """Sessions holding KV cache in ``peer``'s stage (-1 while it does not answer)."""
    try:
        return peer.get("/health")["sessions"]["stage"]
    except OSError:
        return -1
