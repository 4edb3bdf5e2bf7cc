"""``inclavate peer`` refuses bad setups with one clear line, before doing any work."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_HOME
from swarm import Swarm


def peer(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INCLAVATE_HOME": str(TEST_HOME)}
    cmd = [sys.executable, "-m", "inclavate", "peer", "--no-mdns", "--data-dir", str(tmp_path / "d"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def test_a_busy_api_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = peer("--model", "smollm2:135m", "--api-port", str(port), tmp_path=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot serve the API")
    assert "Traceback" not in result.stderr


def test_an_api_host_that_does_not_resolve_points_at_the_host_not_the_port(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = peer("--model", "smollm2:135m", "--api-port", str(port), "--api-host", "no-such-host.invalid", tmp_path=tmp_path)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot serve the API on no-such-host.invalid:{port}"), last
    assert last.endswith("(check --api-host)"), last


def test_an_unknown_model_is_one_line(tmp_path: Path) -> None:
    result = peer("--model", "no:such", "--api-port", "0", tmp_path=tmp_path)
    assert result.returncode == 1 and "error: unknown model 'no:such'" in result.stderr
    assert "Traceback" not in result.stderr


def test_what_the_catalog_can_judge_is_refused_before_the_data_dir_or_any_port(tmp_path: Path) -> None:
    """An audit from outside: ``--layers 0-99`` (a 30-layer model) was refused only after the
    API and p2p were up (and a 10 s join wait with --bootstrap), and an unknown ``--model``
    left a data dir with an identity behind (with the default one, $INCLAVATE_HOME/peer-8001)."""
    result = peer("--model", "smollm2:135m", "--layers", "0-99", "--api-port", "0", tmp_path=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: --layers 0-99 exceeds the model's 30 layers"
    assert "API on" not in result.stderr and not (tmp_path / "d").exists()
    result = peer("--model", "no:such", "--api-port", "0", tmp_path=tmp_path)
    assert result.returncode == 1 and "error: unknown model 'no:such'" in result.stderr
    assert not (tmp_path / "d").exists()


def test_a_failed_start_keeps_the_data_dir_it_found(tmp_path: Path) -> None:
    """A --p2p-host this machine does not have fails after the identity and stores were
    opened: one line, and the data dir keeps what it held. (Nothing is removed after a failed
    start: a data dir may hold the model store, $INCLAVATE_HOME itself; a review, 2026-12-08.)"""
    keys = []
    for _ in range(2):
        result = peer("--model", "smollm2:135m", "--api-port", "0", "--p2p-host", "192.0.2.1", tmp_path=tmp_path)
        assert result.returncode == 1 and "error: could not listen on" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        keys.append((tmp_path / "d" / "identity.key").read_bytes())
    assert keys[0] == keys[1]  # the identity the first start made is the second's


def test_an_api_host_this_machine_does_not_have_points_at_the_host() -> None:
    """Before: ``--api-host 8.8.8.8`` said "(choose another --api-port)"."""
    from inclavate.peer import _api_bind_fix

    with socket.socket() as probe:
        with pytest.raises(OSError) as err:
            probe.bind(("192.0.2.1", 0))
    assert _api_bind_fix(err.value) == "check --api-host"
    assert _api_bind_fix(socket.gaierror(-2, "Name or service not known")) == "check --api-host"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with socket.socket() as probe:
            with pytest.raises(OSError) as err:
                probe.bind(busy.getsockname())
    assert _api_bind_fix(err.value) == "choose another --api-port"


def test_bad_flags_are_usage_errors(tmp_path: Path) -> None:
    for args in (["--model", "smollm2:135m", "--layers", "5-2"], ["--model", "smollm2:135m", "--legacy"]):
        result = peer(*args, tmp_path=tmp_path)
        assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr
    result = peer("--model", "smollm2:135m", "--decode-lanes", "0", tmp_path=tmp_path)
    assert result.returncode == 1 and "error: --decode-lanes must be between 1 and 16" in result.stderr, result.stderr
    for value in ("3", "0"):
        result = peer("--model", "smollm2:135m", "--threads", "2", "--step-threads", value, tmp_path=tmp_path)
        assert result.returncode == 1 and "error: --step-threads must be between 1 and --threads (2)" in result.stderr, result.stderr


def test_a_swarms_step_threads_past_its_cores_are_refused_before_any_work(tmp_path: Path) -> None:
    env = {**os.environ, "INCLAVATE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "inclavate", "swarm", "--step-threads", str(len(os.sched_getaffinity(0)) + 1)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1 and "error: --step-threads must be between 1 and the" in result.stderr, result.stderr
    assert not (tmp_path / "home").exists()


def test_a_port_out_of_range_is_a_usage_error_naming_its_flag(tmp_path: Path) -> None:
    """Before: ``--api-port 70000`` died in a bind's ``OverflowError`` traceback, and
    ``--direct-port 99999`` ran a peer without direct links (every hop over libp2p)."""
    for flag, value in (("--api-port", "70000"), ("--p2p-port", "-1"), ("--direct-port", "99999"),
                        ("--direct-port", "-2"), ("--api-port", "http")):  # fmt: skip
        result = peer("--model", "smollm2:135m", flag, value, tmp_path=tmp_path)
        assert result.returncode == 2, (flag, value, result.stderr)
        assert f"argument {flag}: " in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "d").exists()


def test_a_swarm_whose_ports_would_pass_65535_is_refused_before_any_work(tmp_path: Path) -> None:
    env = {**os.environ, "INCLAVATE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "inclavate", "swarm", "--api-port", "65534", "--peers", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "error: 3 peers need API ports 65534..65536: choose an --api-port of at most 65533" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "home").exists()


def test_a_data_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    """Before: a ``FileNotFoundError`` (or ``NotADirectoryError``) traceback."""
    (tmp_path / "a-file").write_text("")
    for data_dir in ("/proc/no-such-dir", str(tmp_path / "a-file" / "d")):
        result = peer("--model", "smollm2:135m", "--api-port", "0", "--data-dir", data_dir, tmp_path=tmp_path)
        assert result.returncode == 1, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: cannot use {data_dir} as the data dir: "), last
        assert "Traceback" not in result.stderr


def test_a_bootstrap_that_names_no_peer_is_a_usage_error(tmp_path: Path) -> None:
    """``--bootstrap 127.0.0.1:PORT`` or a multiaddr without ``/p2p/PEER_ID``: before, the peer
    created its identity, opened its stores, then died with "error: not a peer id:
    '127.0.0.1:44393'", which names neither the flag nor what it wants."""
    a_peer = "12D3KooWLNW2mGR1eiHqFAKJZ5wfr2ersoJAQrvUmNAPQTkuuWNq"
    # The last two were accepted here and then failed every dial: the flag is read as
    # P2PHost.connect reads it (p2p.host.parse_peer_addr), which wants an address before
    # /p2p/ and /p2p/ last.
    for addr in ("127.0.0.1:44393", "/ip4/127.0.0.1/tcp/44393", "/ip4/127.0.0.1/tcp/44393/p2p/nonsense",
                 f"/p2p/{a_peer}", f"/ip4/127.0.0.1/tcp/44393/p2p/{a_peer}/p2p-circuit"):
        result = peer("--model", "smollm2:135m", "--api-port", "0", "--bootstrap", addr, tmp_path=tmp_path)
        assert result.returncode == 2, result.stderr
        assert f"argument --bootstrap: {addr!r} is not a peer's multiaddr" in result.stderr, result.stderr
        assert "/ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "d").exists()


def test_help_says_where_the_p2p_port_comes_from(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --p2p-port a peer takes the port of its last run where free; before, --help still
    said "default: any free port"."""
    from inclavate.cli import main

    assert main(["peer", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "any free port" not in text.split("--p2p-port P2P_PORT", 1)[1].split("--bootstrap", 1)[0]
    assert "the port of this data dir's last run where free" in text


def test_a_logged_failure_of_ours_carries_its_traceback_and_a_librarys_one_line() -> None:
    """A peer's log is what a bug report holds: ``log.exception`` in our packages keeps the
    traceback; a library's (hypercorn's, for a stranger's broken request) stays one line."""
    import logging

    from inclavate.cli import _CliFormatter

    def formatted(logger: str) -> str:
        try:
            raise KeyError("lost")
        except KeyError:
            record = logging.getLogger(logger).makeRecord(logger, logging.ERROR, __file__, 1, "handling failed", (),
                                                          sys.exc_info())  # fmt: skip
        return _CliFormatter().format(record)

    ours = formatted("p2p.forward")
    stamped = _CliFormatter(timestamps=True).format(logging.getLogger("p2p").makeRecord("p2p", logging.WARNING, __file__, 1, "late", (), None))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} warning: late", stamped), stamped
    assert ours.startswith("error: handling failed\nTraceback") and "KeyError: 'lost'" in ours
    assert formatted("hypercorn.error") == "error: handling failed: KeyError('lost')"


def test_a_stranger_s_text_in_the_log_neither_starts_a_line_nor_reaches_the_terminal() -> None:
    """Log arguments carry other machines' words (an admin command's target, a node's
    answer): a flood of refused admin commands put 4,026 raw escape bytes (a clipboard write,
    a screen clear) and 1,342 forged log lines on a peer's stderr (an audit, 2026-12-07)."""
    import logging

    from inclavate.cli import _CliFormatter

    target = "n1\nwarning: forged line of ours\x1b]52;c;cm0gLXJm\x07\x1b[2J"
    record = logging.getLogger("p2p.admin").makeRecord("p2p.admin", logging.WARNING, __file__, 1,
                                                       "refused %s of %s", ("reassign", target), None)  # fmt: skip
    line = _CliFormatter().format(record)
    assert "\n" not in line and "\x1b" not in line and "\x07" not in line
    assert line == "warning: refused reassign of n1\ufffdwarning: forged line of ours\ufffd]52;c;cm0gLXJm\ufffd\ufffd[2J"
    refused = ValueError("the registry says n\nwarning: forged line")  # an exception's text is a frame's too
    for fmt in ("refusing: %s", "refusing: %r"):
        record = logging.getLogger("p2p.forward").makeRecord("p2p.forward", logging.INFO, __file__, 1, fmt, (refused,), None)
        assert "\n" not in _CliFormatter().format(record)
    record = logging.getLogger("p2p").makeRecord("p2p", logging.INFO, __file__, 1, "%d of %.1f", (3, 2.5), None)
    assert _CliFormatter().format(record) == "3 of 2.5"


def test_libp2ps_warnings_reach_the_peer_log_as_one_stamped_line(capsys: pytest.CaptureFixture[str]) -> None:
    """py-libp2p sets its logger ``propagate = False`` with no handler (unless LIBP2P_DEBUG is
    set), so its warnings went to Python's last-resort handler: bare, unstamped and several
    lines each ("Failed to open stream to peer ...:" then "  Error: ...", "  Protocols: ...",
    "  Registry Stats: None"), printed in a volunteer's terminal whenever a neighbour left."""
    import logging

    from inclavate.cli import _configure_logging
    import p2p.host  # noqa: F401  (imports libp2p, whose import configures its logging)

    _configure_logging(0, timestamps=True)
    # (Not a failed stream or dial: those show at debug only, ``p2p.host._dial_failure_kept_quiet``.)
    message = "Failed to negotiate with peer X:\n  Error: handshake read failed\n  Protocols: ['/p/1']"
    logging.getLogger("libp2p.host.basic_host").error(message)
    logging.getLogger("libp2p.network.swarm").info("chatter below the level")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(r"(\S+ \S+ )?error: Failed to negotiate with peer X: Error: handshake read failed; "
                        r"Protocols: \['/p/1'\]", lines[0]), lines  # fmt: skip


def test_inclavate_debug_logs_one_module_at_debug(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``INCLAVATE_DEBUG=p2p.pace`` (what ``scripts/bench_pace`` reads a peer's steps from)
    logs that module's debug lines and nobody else's."""
    import logging

    from inclavate.cli import DEBUG_ENV, _configure_logging

    pace = logging.getLogger("p2p.pace")
    monkeypatch.setattr(pace, "level", pace.level)  # restored after the test
    monkeypatch.setenv(DEBUG_ENV, "p2p.pace")
    _configure_logging(0)
    pace.debug("a step")
    logging.getLogger("p2p.chain").debug("not this")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("a step"), lines  # stamped if an earlier test added the handler so


@pytest.mark.swarm
@pytest.mark.slow
def test_a_data_dir_a_running_peer_holds_is_refused_with_one_line(tmp_path: Path) -> None:
    """Two peers given one ``--data-dir`` share an identity: before, the second started, its
    record of other layers replaced the first's in the registry (the first's range showed as
    a gap, chats failed), it announced Dead under the first's PeerID when it stopped, and it
    overwrote the p2p port kept in the first's peer book. It must stop at once, saying why,
    and leave the first alone; the directory is free again once the first has exited."""
    with Swarm(tmp_path / "swarm") as swarm:
        first = swarm.start("a")
        swarm.multiaddr(first)  # it answers: it holds its data directory
        second = peer("--model", "smollm2:135m", "--api-port", "0", "--p2p-host", "127.0.0.1", "--data-dir", str(first.data_dir),
                      tmp_path=tmp_path)  # fmt: skip
        assert second.returncode == 1, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: {first.data_dir} is in use by another peer (pid {first.process.pid})"), last
        assert "Traceback" not in second.stderr
        # The same command again, as after a Ctrl-C while the first still drains: before, it
        # said "cannot serve the API ... (choose another --api-port)", and another port means
        # another default data directory, so another identity and an empty peer book.
        again = peer("--model", "smollm2:135m", "--api-port", str(first.api_port), "--p2p-host", "127.0.0.1",
                     "--data-dir", str(first.data_dir), tmp_path=tmp_path)  # fmt: skip
        assert again.returncode == 1, again.stderr
        assert again.stderr.strip().splitlines()[-1].startswith(f"error: {first.data_dir} is in use by another peer"), again.stderr
        assert first.alive()
        swarm.signal(first, signal.SIGKILL)
        first.process.wait(10)
        again = swarm.start("a")  # the same data directory, after a kill -9: free
        swarm.multiaddr(again)


def test_a_peer_raises_its_open_files_limit_towards_the_hard_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A desktop's 1,024 descriptors are shared by libp2p, stores, models and the API."""
    import resource

    from inclavate.peer_cmd import raise_open_files_limit

    limits = {"now": (1024, 524288)}
    monkeypatch.setattr(resource, "getrlimit", lambda _which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _which, value: limits.update(now=value))
    assert raise_open_files_limit(ceiling=65536) == 65536 and limits["now"] == (65536, 524288)
    limits["now"] = (1024, 4096)
    assert raise_open_files_limit(ceiling=65536) == 4096 and limits["now"] == (4096, 4096)
    limits["now"] = (100000, 524288)  # already above the ceiling: never lowered
    assert raise_open_files_limit(ceiling=65536) == 100000 and limits["now"] == (100000, 524288)
