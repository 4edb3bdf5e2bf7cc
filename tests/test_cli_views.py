"""``inclavate status`` and ``inclavate chat`` rendering: pure functions over the API's JSON."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fixed_answer import answering

from inclavate.chat_cmd import Turn, pick_model, stats_line
from inclavate.cli import main
from inclavate.errors import ConfigError
from inclavate.local_swarm import free_port
from inclavate.peer_api import PeerApi, PeerRefused, PeerUnreachable, api_base, error_text, sse_events
from inclavate.swarm_view import MAX_LAYERS, coverage_strip, layer_counts, models_of, render_status, runs, shapes_of
from inclavate.terminal import printable


def node(node_id: str, start: int, end: int, state: str = "Ready", *, idle: bool = False, model: str = "m:1",
         n_layers: int = 30, tps: float = 40.0) -> dict:  # fmt: skip
    return {"node_id": node_id, "peer_id": node_id, "model_id": model, "start_layer": start, "end_layer": end,
            "n_layers": n_layers, "state": state, "idle": idle, "throughput_tps": tps, "avg_latency_ms": 3.25,
            "requests_served": 7, "uptime_s": 3725, "legacy": False}  # fmt: skip


SWARM = [node("12D3KooWaaaaaaaaaa", 0, 10), node("12D3KooWbbbbbbbbbb", 10, 20), node("12D3KooWcccccccccc", 20, 30),
         node("12D3KooWdddddddddd", 20, 30)]  # fmt: skip


def test_layer_counts_count_only_ready_nodes_that_are_not_idle() -> None:
    nodes = [*SWARM, node("x", 0, 30, "Dead"), node("y", 0, 30, "Degraded"), node("z", 0, 30, idle=True), node("j", 0, 30, "Joining")]
    counts = layer_counts(nodes, 30)
    assert counts == [1] * 20 + [2] * 10
    assert runs(counts) == [(0, 20, 1), (20, 30, 2)]


def test_a_gap_shows_as_bangs_and_in_words() -> None:
    nodes = [node("a", 0, 10), node("b", 10, 20), node("c", 20, 30, "Dead")]
    assert coverage_strip(layer_counts(nodes, 30)) == "1" * 20 + "!" * 10
    screen = render_status(nodes, "http://peer:8001")
    assert "gap at layers 20-30" in screen
    assert "(fewest replicas: 0)" in screen
    assert "chain complete" not in screen


def test_every_layer_held_by_ranges_that_do_not_meet_is_no_chain() -> None:
    """A peer restarted with other ``--layers`` (0-10, 10-20, 15-30): every layer is held, but
    no chain starts at 20, and the API refuses every chat. Before, the screen said "chain
    complete" in green, going by gaps alone."""
    nodes = [node("a", 0, 10), node("b", 10, 20), node("c", 15, 30)]
    screen = render_status(nodes, "http://peer:8001")
    assert "chain complete" not in screen
    assert "m:1  30 layers  no chain: held ranges do not meet end to start  (fewest replicas: 1)" in screen
    assert "chain complete" in render_status([*nodes, node("d", 20, 30)], "http://peer:8001")
    assert "chain complete" not in render_status([*nodes, node("d", 20, 30, idle=True)], "http://peer:8001")


def test_a_draining_node_is_shown_draining_and_serves_nothing_new() -> None:
    """After Ctrl-C a peer drains (up to --drain-timeout) and routing sends it nothing new:
    with it the only holder of 10-20 every new chat is a 503. Before, the screen said
    "3/3 nodes serving", "chain complete" and the node "Ready" all that time."""
    nodes = [node("a", 0, 10), {**node("b", 10, 20), "draining": True}, node("c", 20, 30)]
    screen = render_status(nodes, "http://peer:8001")
    assert "2/3 nodes serving" in screen
    assert "gap at layers 10-20" in screen and "chain complete" not in screen
    assert any(line.startswith("b ") and " Draining " in line for line in screen.splitlines()), screen


def test_many_layers_are_grouped_by_their_weakest_layer() -> None:
    counts = [2] * 100 + [0] + [2] * 19  # 120 layers -> 60 cells of 2 layers
    strip = coverage_strip(counts)
    assert len(strip) == 60 and strip[50] == "!" and set(strip) == {"2", "!"}
    assert coverage_strip([12, 12]) == "++"


def test_status_screen_lists_models_coverage_and_every_node() -> None:
    screen = render_status([*SWARM, node("other", 0, 4, model="tiny:1", n_layers=4)], "http://127.0.0.1:8001")
    lines = screen.splitlines()
    assert lines[0] == "Inclavate swarm at http://127.0.0.1:8001"
    assert "5 peers, 5/5 nodes serving, 2 models" in screen
    assert "m:1  30 layers  chain complete  (fewest replicas: 1)" in screen
    assert "  coverage [" + "1" * 20 + "2" * 10 + "]  1 char = 1 layer" in screen
    assert "  replicas 0-20 x1, 20-30 x2" in screen
    table = lines[lines.index(next(line for line in lines if line.startswith("NODE"))):]
    assert len(table) == 6
    assert "…aaaaaaaa  m:1     0-10    Ready  40.0   3.2" in screen
    assert "1h02m" in screen
    assert "\x1b[" not in screen


def test_what_peers_say_reaches_the_terminal_without_its_control_characters() -> None:
    """A model id, a node id or a model's text is another machine's word: an escape in it
    acted on the volunteer's terminal (the screen rewritten, the title set, with OSC 52 the
    clipboard written; an audit, 2026-12-07). Shown as U+FFFD; tabs and newlines stay."""
    hostile = "evil\x1b]52;c;cm0gLXJm\x07\x1b[2J\u202e:1"
    screen = render_status([node("12D3KooW\x1b[31mred\x9b", 0, 30, model=hostile)], "http://x\x1b[H")
    assert "\x1b" not in screen and "\x07" not in screen and "\x9b" not in screen and "\u202e" not in screen
    assert "evil\ufffd]52;c;cm0gLXJm\ufffd\ufffd[2J\ufffd:1" in screen
    assert printable("a\tb\nc\x00d\x7f") == "a\tb\nc\ufffdd\ufffd"
    turn = Turn(color=True)
    said = turn.feed({"choices": [{"delta": {"reasoning_content": "hm\x1b[8m"}}]}) + turn.feed(
        {"choices": [{"delta": {"content": "ok\x1b]52;c;eA==\x07"}}]})
    assert said == "\x1b[2m(thinking) \x1b[0m\x1b[2mhm\ufffd[8m\x1b[0m\nok\ufffd]52;c;eA==\ufffd"  # only our own dim


def test_status_colours_states_only_when_asked() -> None:
    screen = render_status([node("a", 0, 30, "Dead")], "u", color=True)
    assert "\x1b[31mDead" in screen and "\x1b[31m!" in screen


def test_status_of_an_empty_registry() -> None:
    assert render_status([], "u").endswith("No node is registered yet.")


def test_models_group_and_sort_nodes() -> None:
    models = models_of([node("b", 10, 30), node("a", 0, 10), node("z", 0, 8, model="a:1", n_layers=8)])
    assert [m.model_id for m in models] == ["a:1", "m:1"]
    assert [n["node_id"] for n in models[1].nodes] == ["a", "b"]
    assert models[1].n_layers == 30


def test_a_record_stating_another_shape_does_not_stretch_the_model() -> None:
    """A stranger's record saying ``n_layers: 100000`` drew the model as 100,000 layers, one
    long gap and "no chain", while every chat was served. The peer's ``/api/models`` states
    the shape (the catalog's for a catalog model); the records only place the nodes."""
    liar = node("liar", 0, 30, n_layers=100000)
    screen = render_status([*SWARM, liar], "u", shapes=shapes_of([{"id": "m:1", "n_layers": 30}]))
    assert "m:1  30 layers  chain complete" in screen, screen
    assert "  replicas 0-20 x1, 20-30 x2" in screen, screen  # listed, but holding nothing of this shape
    assert any(line.startswith("liar ") for line in screen.splitlines()), screen
    assert "m:1  100000 layers" in render_status([*SWARM, liar], "u")  # the records alone: before


def test_model_shapes_keep_only_well_formed_entries() -> None:
    answer = [{"id": "a:1", "n_layers": 30}, {"id": "b:1", "n_layers": "30"}, {"id": "c:1", "n_layers": True},
              {"id": "d:1", "n_layers": 0}, {"n_layers": 4}, "junk", {"id": 7, "n_layers": 4}]  # fmt: skip
    assert shapes_of(answer) == {"a:1": 30}
    assert shapes_of({"error": "no"}) == {} and shapes_of(None) == {}


def test_a_turn_separates_reasoning_from_the_answer() -> None:
    turn = Turn()
    chunk = lambda **delta: {"choices": [{"delta": delta, "finish_reason": None}]}  # noqa: E731
    printed = "".join([
        turn.feed(chunk(role="assistant", content="")),
        turn.feed(chunk(reasoning_content="Two plus ")),
        turn.feed(chunk(reasoning_content="two.")),
        turn.feed(chunk(content="4")),
        turn.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]}),
        turn.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}),
    ])  # fmt: skip
    assert printed == "(thinking) Two plus two.\n4"
    assert (turn.content, turn.reasoning, turn.finish_reason, turn.tokens) == ("4", "Two plus two.", "stop", 5)
    coloured = Turn(color=True)
    assert coloured.feed(chunk(reasoning_content="hm")) == "\x1b[2m(thinking) \x1b[0m\x1b[2mhm\x1b[0m"


def test_a_turn_reports_an_error_chunk() -> None:
    turn = Turn()
    turn.feed({"choices": [{"delta": {"content": "partial"}}]})
    turn.feed({"error": "session abc was closed", "status": 409})
    assert turn.error == "session abc was closed" and turn.content == "partial" and turn.tokens == 1
    envelope = Turn()
    envelope.feed({"error": {"message": "bad", "type": "x", "code": "x"}, "status": 400})
    assert envelope.error == "bad"


def test_stats_line_names_speed_finish_and_route() -> None:
    turn = Turn(completion_tokens=20, finish_reason="length")
    route = [{"peer_id": "12D3KooWabcdef", "start_layer": 0, "end_layer": 10}, {"peer_id": "12D3KooW123456", "start_layer": 10, "end_layer": 30}]
    assert stats_line(turn, 2.0, route) == "[20 tokens, 10.0 tok/s, finish length, route …abcdef 0-10 → …123456 10-30]"
    assert stats_line(Turn(), 0.0, None) == "[0 tokens]"


def test_sse_events_stop_at_done_and_skip_noise() -> None:
    lines = [b": comment\n", b"data: {\"a\": 1}\n", b"\n", b"data: not json\n", b"data: [1]\n", b"data: {\"b\": 2}\r\n",
             b"data: [DONE]\n", b"data: {\"c\": 3}\n"]  # fmt: skip
    assert list(sse_events(lines)) == [{"a": 1}, {"b": 2}]


def test_api_addresses_and_error_bodies() -> None:
    assert api_base("localhost:8001/") == "http://localhost:8001"
    assert api_base("http://h:1/v1") == "http://h:1"
    assert error_text(b'{"error": "no Ready chain"}') == "no Ready chain"
    assert error_text(b'{"error": {"message": "bad media", "type": "t", "code": "c"}}') == "bad media"
    assert error_text(b"<html>oops</html>") == "<html>oops</html>"


def test_something_that_is_not_http_is_unreachable_too() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]

        def answer_garbage() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

        thread = threading.Thread(target=answer_garbage, daemon=True)
        thread.start()
        with pytest.raises(PeerUnreachable, match="cannot reach the API"):
            PeerApi(f"127.0.0.1:{port}", timeout=5).get("/nodes")
        thread.join(5)


def test_an_unreachable_api_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(PeerUnreachable, match="cannot reach the API at http://127.0.0.1:.*is a peer running there"):
        PeerApi(url, timeout=2).get("/nodes")
    for argv in (["status", "--api", url], ["chat", "--api", url]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: cannot reach the API at ") and err.count("\n") == 1 and "Traceback" not in err


def test_chat_names_a_hostile_model_id_without_its_control_characters(capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Without ``--model``, chat names the first model a peer lists: that id is any record's
    word, and its escape sequence reached the terminal (a review, 2026-12-07)."""
    monkeypatch.setattr("builtins.input", lambda _prompt: (_ for _ in ()).throw(EOFError))
    with answering({"data": [{"id": "evil\x1b]52;c;eA==\x07"}]}) as url:
        assert main(["chat", "--api", url]) == 0
    err = capsys.readouterr().err
    assert "chatting with evil\ufffd]52;c;eA==\ufffd through" in err and "\x1b" not in err


# An audit from outside, 2026-12-08: well-formed JSON of another shape, and flags of no
# sensible value, were tracebacks; each is one ``error:`` line now, or a row left out.


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    assert main(argv) == 1, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("answer", [{"nodes": [node("a", 0, 30)]}, 42, ["a", "b"], None])
def test_status_refuses_a_node_list_of_another_shape(capsys: pytest.CaptureFixture[str], answer: object) -> None:
    with answering(answer) as url:
        one_error_line(capsys, ["status", "--api", url], "/nodes answered something that is not an Inclavate node list")


def test_status_draws_rows_whose_values_are_of_other_shapes() -> None:
    """NaN or Infinity uptime, a layer "zero" or null, a list as peer id, a number no float
    holds: each was a traceback. The row is listed; what it holds counts for nothing."""
    rows = [node("a", 0, 30), {**node("b", 0, 30), "uptime_s": float("nan")}, {**node("c", 0, 30), "uptime_s": float("inf")},
            {**node("d", 0, 30), "start_layer": "zero"}, {**node("e", 0, 30), "end_layer": None},
            {**node("f", 0, 30), "peer_id": ["x"], "requests_served": 10**400, "throughput_tps": float("-inf")},
            "junk", 7]  # fmt: skip
    screen = render_status(rows, "u")
    assert "6 peers, 6/6 nodes serving, 1 model" in screen, screen
    assert "m:1  30 layers  chain complete" in screen and "  replicas 0-30 x4" in screen, screen
    table = {line.split()[0]: line for line in screen.splitlines()[-6:]}
    assert table["b"].endswith(" -") and table["c"].endswith(" -") and table["a"].endswith("1h02m")
    assert " ?-30 " in table["d"] and " 0-? " in table["e"]
    assert table["f"].split()[3:6] == ["Ready", "-", "3.2"] and table["f"].split()[6] == "-"


def test_a_model_of_a_huge_stated_shape_is_clamped() -> None:
    """A model ``/api/models`` does not know, its record saying ``n_layers: 10**12``: a
    ``MemoryError`` building the counts. Clamped to the records' own bound."""
    from p2p.record_schema import MAX_LAYERS as RECORD_MAX_LAYERS

    assert MAX_LAYERS == RECORD_MAX_LAYERS
    huge = {**node("h", 0, 10**12, model="x:1"), "n_layers": 10**12}
    assert f"x:1  {MAX_LAYERS} layers" in render_status([huge], "u")
    assert len(layer_counts([huge], 10**12)) == MAX_LAYERS
    assert shapes_of([{"id": "x:1", "n_layers": 10**12}]) == {"x:1": MAX_LAYERS}
    assert models_of([huge], {"x:1": 10**12})[0].n_layers == MAX_LAYERS


def test_a_turn_skips_events_of_other_shapes() -> None:
    turn = Turn()
    said = "".join(turn.feed(event) for event in [
        {"choices": 5}, {"choices": ["x"]}, {"choices": [{"delta": "hi"}]}, {"choices": [{"delta": {"content": 5}}]},
        {"choices": [{"delta": {"reasoning_content": ["x"]}}]}, {"choices": {"0": {}}},
        {"choices": [{"delta": {"content": "ok"}, "finish_reason": 1}]},
        {"choices": [], "usage": {"completion_tokens": True}}, {"usage": {"completion_tokens": -3}},
    ])  # fmt: skip
    assert (said, turn.content, turn.reasoning, turn.finish_reason, turn.completion_tokens) == ("ok", "ok", "", "1", None)
    assert stats_line(turn, 0.0, None) == "[1 tokens, finish 1]"


@pytest.mark.parametrize("answer", [[{"id": "m:1"}], {"data": 5}, {"data": None}, "m:1"])
def test_chat_refuses_a_model_list_of_another_shape(capsys: pytest.CaptureFixture[str], answer: object) -> None:
    with answering(answer) as url:
        with pytest.raises(PeerRefused, match="/v1/models answered something that is not a model list"):
            pick_model(PeerApi(url), None)
        one_error_line(capsys, ["chat", "--api", url], "/v1/models answered something that is not a model list")


def test_chat_takes_only_string_model_ids() -> None:
    with answering({"data": [{"id": 5}, {"id": None}, "x", {"id": "m:1"}]}) as url:
        assert pick_model(PeerApi(url), None) == "m:1"


@pytest.mark.parametrize("interval", ["nan", "inf", "1e-300", "0.05", "0", "-1"])
def test_status_watch_interval_must_be_finite_and_at_least_a_tenth(capsys: pytest.CaptureFixture[str], interval: str) -> None:
    """``nan``/``inf`` were a traceback from ``time.sleep`` after the first screen; ``1e-300``
    polled the peer without pause. Refused before any request (no peer needed here)."""
    url = f"http://127.0.0.1:{free_port()}"
    one_error_line(capsys, ["status", "--watch", "--interval", interval, "--api", url], "--interval must be")


@pytest.mark.parametrize("url", ["http://[::1", "http://h:99999", "http://h:port", "ftp://h:21", "http://:8001"])
def test_a_malformed_api_url_is_one_error_line(capsys: pytest.CaptureFixture[str], url: str) -> None:
    """``http://[::1`` raised urllib's ValueError outside every handler: a traceback."""
    with pytest.raises(ConfigError, match="is not a URL like http://127.0.0.1:8001"):
        api_base(url)
    for command in ("status", "chat"):
        one_error_line(capsys, [command, "--api", url], "is not a URL like")


def test_good_api_urls_still_pass() -> None:
    assert api_base("[::1]:8001") == "http://[::1]:8001"
    assert api_base("https://peer.example/v1/") == "https://peer.example"


@pytest.mark.parametrize("temperature", ["nan", "-1", "5", "inf", "2.01"])
def test_chat_refuses_a_temperature_outside_the_apis_range(capsys: pytest.CaptureFixture[str], temperature: str) -> None:
    """Each was accepted, and every turn of the chat was then a 400."""
    url = f"http://127.0.0.1:{free_port()}"
    one_error_line(capsys, ["chat", "--temperature", temperature, "--api", url], "--temperature must be a number from 0 to 2")


@contextmanager
def streaming(chunks: list[bytes]) -> Iterator[tuple[str, list[dict]]]:
    """A peer whose chat streams ``chunks`` then closes the connection (``[DONE]`` only when
    a chunk says it); yields the URL and the chat bodies it was sent."""
    bodies: list[dict] = []

    class Peer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.dumps({"object": "list", "data": [{"id": "m:1"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", "100000")  # more than comes: the peer died mid-answer
            self.end_headers()
            self.wfile.write(b"".join(chunks))
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()


def chat_through(monkeypatch: pytest.MonkeyPatch, url: str, prompts: list[str]) -> int:
    said = iter(prompts)
    monkeypatch.setattr("builtins.input", lambda _prompt: next(said, None) or (_ for _ in ()).throw(EOFError))
    return main(["chat", "--api", url])


def test_an_answer_cut_off_mid_stream_is_said_and_kept_out_of_the_history(capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The connection ended after one chunk, no ``[DONE]``, no finish reason: the partial
    answer was shown as a whole one and sent back as the assistant's turn."""
    with streaming([b'data: {"choices":[{"delta":{"content":"par"}}]}\n\n']) as (url, bodies):
        assert chat_through(monkeypatch, url, ["first", "second"]) == 0
    err = capsys.readouterr().err
    assert err.count("error: the answer was cut off (the connection to http://127.0.0.1:") == 2, err
    assert [m["content"] for m in bodies[1]["messages"]] == ["second"]


def test_an_answer_ending_with_done_or_a_finish_reason_is_whole(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    for chunks in ([b'data: {"choices":[{"delta":{"content":"all"}}]}\n\n', b"data: [DONE]\n\n"],
                   [b'data: {"choices":[{"delta":{"content":"all"},"finish_reason":"stop"}]}\n\n']):
        with streaming(chunks) as (url, bodies):
            assert chat_through(monkeypatch, url, ["first", "second"]) == 0
        assert "error" not in capsys.readouterr().err
        assert [m["content"] for m in bodies[1]["messages"]] == ["first", "all", "second"]
    events = sse_events([b"data: {}\n", b"data: [DONE]\n"])
    assert (list(events), events.done) == ([{}], True)
    events = sse_events([b"data: {}\n"])
    assert (list(events), events.done) == ([{}], False)
