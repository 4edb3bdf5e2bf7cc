"""``inclavate swarm`` as a user runs it: with ``--replicas`` the swarm outlives its peers. A
killed peer's range is still held, and once every holder of a range is killed a spare moves
there (healing), the swarm serving the same answers all along."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import DEFAULT_MODEL, TEST_HOME

from inclavate.local_swarm import free_port, request_json
from inclavate.ports import port_in_use

READY = re.compile(r"(peer-\d+): layers (\d+-\d+) ready, API (\S+), pid (\d+)")
TOKEN = "a-token-for-this-test"


def _four_free_ports() -> int:
    while True:
        port = free_port()
        if all(port_in_use("127.0.0.1", port + i) is None for i in range(1, 4)):
            return port


def _lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


def _until(lines: queue.Queue[str], pattern: str, deadline: float, seen: list[str]) -> re.Match[str]:
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        seen.append(line)
        if match := re.search(pattern, line):
            return match


def _chat(url: str, within_s: float = 0) -> str:
    """A greedy answer from ``url``; retried for up to ``within_s`` while the swarm heals (a
    range without a live holder is a 503 meanwhile)."""
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    deadline = time.monotonic() + within_s
    while True:
        status, answer = request_json("POST", url + "/v1/chat/completions", body, timeout=60)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert status == 200, answer
    return answer["choices"][0]["message"]["content"]


def test_a_swarm_with_replicas_outlives_its_peers_and_heals() -> None:
    port = _four_free_ports()
    swarm = subprocess.Popen(
        [sys.executable, "-m", "inclavate", "swarm", "--peers", "2", "--replicas", "2", "--api-port", str(port),
         "--admin-token", TOKEN],
        env={**os.environ, "INCLAVATE_HOME": str(TEST_HOME)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_lines, args=(swarm.stderr, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        logs = Path(_until(lines, r"\(logs in (.+)\)", deadline, seen)[1])
        ready = [_until(lines, READY.pattern, deadline, seen) for _ in range(4)]
        peers = {m[1]: (m[2], m[3], int(m[4])) for m in ready}
        logged = {name: (logs / f"{name}.log").stat().st_size for name in ("peer-1", "peer-2")}  # this run's end from here
        assert [layers for layers, _, _ in peers.values()] == ["0-15", "0-15", "15-30", "15-30"]
        entry = peers["peer-1"][1]
        before = _chat(entry)
        # An admin request to any peer acts on a node another one holds: they trust each other.
        _, far = request_json("GET", peers["peer-4"][1] + "/health")
        status, answer = request_json("PATCH", f"{entry}/admin/nodes/{far['peer_id']}/state", {"state": "ready"},
                                      headers={"X-Admin-Token": TOKEN})  # fmt: skip
        assert status == 200, answer

        os.kill(peers["peer-4"][2], signal.SIGKILL)
        _until(lines, r"peer-4 exited", time.monotonic() + 30, seen)
        assert _chat(entry) == before  # through peer-3 now
        assert swarm.poll() is None

        os.kill(peers["peer-3"][2], signal.SIGKILL)  # layers 15-30 have no holder left
        _until(lines, r"peer-3 exited", time.monotonic() + 30, seen)
        assert _chat(entry, within_s=120) == before  # peer-2 moved there
        assert swarm.poll() is None
        os.killpg(swarm.pid, signal.SIGINT)  # a terminal's Ctrl-C
        assert swarm.wait(timeout=60) == 0
        # Each peer was told once, and drained: in the terminal's process group it had the
        # Ctrl-C, then the swarm's SIGTERM as a second signal, "leaving now" (an audit, 2026-12-08).
        for name, size in logged.items():
            with open(logs / f"{name}.log", "rb") as log:
                log.seek(size)
                end = log.read().decode(errors="replace")
            assert "received: stopping" in end and "leaving now" not in end, end
    except (queue.Empty, AssertionError):
        print("".join(seen), file=sys.stderr)
        raise
    finally:
        if swarm.poll() is None:
            os.killpg(swarm.pid, signal.SIGINT)
            try:
                swarm.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(swarm.pid, signal.SIGKILL)
                swarm.wait()
        reader.join(timeout=10)  # the pipe's end: the swarm and its peers are gone
        assert swarm.stderr is not None
        swarm.stderr.close()
        shutil.rmtree(TEST_HOME / f"swarm-{port}", ignore_errors=True)  # one per port: not left to pile up


def test_a_taken_api_port_is_refused_before_any_peer_starts() -> None:
    """Before, the first peer's readiness probe could find another swarm's peer on that port
    and report this swarm ready; only then did its own peer exit."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "inclavate", "swarm", "--api-port", str(port)],
                              env={**os.environ, "INCLAVATE_HOME": str(TEST_HOME)}, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0
    assert f"API port {port} is taken" in done.stderr
    assert not READY.search(done.stderr)


def test_peers_outside_one_to_the_models_layers_are_refused_naming_peers(tmp_path, monkeypatch, capsys) -> None:
    """An audit from outside: ``--peers 0|-2|31`` printed "starting 0 peers", then an error
    about ``--ranges`` (a flag of `generate`); ``--peers 1000000`` asked for a negative --api-port."""
    from inclavate import cli

    monkeypatch.setenv("INCLAVATE_HOME", str(tmp_path / "home"))
    for peers in ("0", "-2", "31", "1000000"):
        assert cli.main(["swarm", "--peers", peers]) == 1
        err = capsys.readouterr().err
        assert err.strip() == "error: --peers must be between 1 and 30 (the layers of smollm2:135m)", err
    assert not (tmp_path / "home").exists()


def test_swarms_on_other_api_ports_keep_their_own_work_dirs(tmp_path, monkeypatch, capsys) -> None:
    """Before: every swarm of one $INCLAVATE_HOME used ``swarm/``, so a second one on another
    --api-port failed on the first's data-dir locks, with 40 lines of old logs and advice to
    give a --data-dir (swarm has none)."""
    from inclavate import cli, swarm_cmd

    class Started(Exception):
        pass

    workdirs = []

    def open_swarm(workdir, *args, **kw):
        workdirs.append(workdir)
        raise Started

    class Store:
        def __init__(self, home) -> None:
            pass

        def pull(self, spec, progress) -> None:
            pass

    monkeypatch.setenv("INCLAVATE_HOME", str(tmp_path))
    monkeypatch.setattr(swarm_cmd, "open_swarm", open_swarm)
    monkeypatch.setattr(swarm_cmd, "ModelStore", Store)
    for port in (18501, 18511):
        try:
            cli.main(["swarm", "--api-port", str(port)])
        except Started:
            pass
    assert workdirs == [tmp_path / "swarm-18501", tmp_path / "swarm-18511"]
    assert f"(logs in {tmp_path / 'swarm-18511'})" in capsys.readouterr().err


def test_a_peers_log_tail_shows_only_this_run(tmp_path, monkeypatch) -> None:
    """A peer's log is appended to across runs: before, a peer killed with -9 was shown with the
    last run's "SIGINT received: stopping ... leaving now" lines, as if it had stopped politely."""
    from inclavate import local_swarm

    class Child:
        returncode = None

        def __init__(self, cmd, *, stdout, **kw) -> None:
            stdout.write(b"this run's line\n")

        def poll(self) -> None:
            return None

    monkeypatch.setattr(local_swarm.subprocess, "Popen", Child)
    swarm = local_swarm.LocalSwarm(tmp_path)
    (tmp_path / "peer-1.log").write_text("an earlier run's line\nSIGINT received: stopping\n")
    peer = swarm.start("peer-1", DEFAULT_MODEL, api_port=18501)
    tail = peer.log_tail().splitlines()
    assert tail[0].startswith(local_swarm.RUN_MARKER) and tail[1:] == ["this run's line"], tail
    assert "an earlier run's line" in peer.log_path.read_text()  # kept, for the story of a crash
