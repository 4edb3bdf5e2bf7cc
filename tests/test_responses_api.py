"""``POST /v1/responses`` (OpenAI's Responses API) on a real peer, driven with the official
``openai`` SDK: the answer is the chat route's answer to the letter, streamed or not; the
stream's events come in OpenAI's order and parse as the SDK's own types; and what is not
served is refused with a 400 naming the field. The translation itself is tested first,
without a peer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from swarm import PeerProcess, Swarm, request_json

from api.errors import BadRequest
from api.responses_output import EventStream, Shell, from_completion, response_object
from api.responses_request import chat_body, echoed

MODEL = "smollm2:135m"
QUESTION = "What is the capital of France?"

# --- the translation, without a peer ---------------------------------------------------


def test_a_body_becomes_the_chat_body_it_means() -> None:
    body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [{"role": "developer", "content": "Answer in French."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]}],  # fmt: skip
        "max_output_tokens": 9, "temperature": 0, "top_p": 0.5, "stream": True,
        "metadata": {"k": "v"}, "user": "u", "store": True, "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "include": [], "truncation": "disabled",
    }  # fmt: skip
    assert chat_body(body) == {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."},
                     {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut"}],  # fmt: skip
        "max_tokens": 9, "temperature": 0, "top_p": 0.5, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    assert chat_body({"model": MODEL, "input": "Hi"}) == {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": "text"}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "input[0].content[0].text"),
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"instructions": ["x"]}, "instructions"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": True}, "max_output_tokens"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"user": 7}, "user"),
        ({"user": "u" * 257}, "user"),  # echoed three times a stream: 20 MB went out as 60 (a review)
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # nothing but reasoning
        ({"store": "yes"}, "store"),
    ],
)
def test_what_is_not_served_is_refused_by_name(extra: dict, named: str) -> None:
    with pytest.raises(BadRequest) as refused:
        chat_body({"model": MODEL, "input": "Hi", **extra})
    assert refused.value.message.startswith(named + " "), refused.value.message


def test_a_long_conversation_of_text_parts_is_one_string_a_message() -> None:
    """The SDK's loop (``input += response.output``) sends every turn back as content parts:
    counted against the chat route's 64 media parts a request, its 33rd turn was a 400
    ``too_many_parts`` that named ``messages[64]`` (an audit from outside, 2026-12-08)."""
    turns = [item for i in range(40) for item in (
        {"role": "user", "content": [{"type": "input_text", "text": f"Q{i} "}, {"type": "input_text", "text": "more"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"A{i}"}]})]  # fmt: skip
    messages = chat_body({"model": MODEL, "input": turns})["messages"]
    assert len(messages) == 80 and messages[0] == {"role": "user", "content": "Q0 more"}
    assert messages[1] == {"role": "assistant", "content": "A0"}


def test_openai_defaults_sent_as_values_are_taken() -> None:
    """An SDK that always sends its defaults: ``text.verbosity`` ``"medium"`` was a 400."""
    chat_body({"model": MODEL, "input": "Hi", "text": {"verbosity": "medium", "format": {"type": "text"}}})


def test_an_answer_sent_back_with_its_reasoning_is_taken_without_it() -> None:
    """The SDK's conversation loop sends ``response.output`` back as input, a reasoning model's
    reasoning item with it: it was a 400 saying such items need tools (a review, 2026-12-07)."""
    earlier = [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]}]  # fmt: skip
    body = chat_body({"model": MODEL, "input": [{"role": "user", "content": "Capital?"}, *earlier,
                                                 {"role": "user", "content": "Of Italy?"}]})  # fmt: skip
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]


def test_an_answer_cut_off_while_it_reasoned_has_its_reasoning_incomplete() -> None:
    stream = EventStream(_SHELL)
    events = stream.start() + stream.feed(_chunk({"reasoning_content": "hmm"})) + stream.feed(_chunk(finish="length"))
    events += stream.feed(_USAGE) + stream.end()
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "incomplete" and [(i.type, i.status) for i in final.output] == [("reasoning", "incomplete"),
                                                                                            ("message", "incomplete")]  # fmt: skip
    _types(events)
    body = from_completion(_SHELL, {"choices": [{"finish_reason": "length", "message": {"reasoning_content": "hmm", "content": ""}}],
                                    "usage": _USAGE["usage"]})  # fmt: skip
    assert [o["status"] for o in body["output"]] == ["incomplete", "incomplete"]


def _chunk(delta: dict | None = None, finish: str | None = None, **extra: object) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


_USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
_SHELL = Shell("abc", 1, MODEL, 0.0, 1.0, {"metadata": {}, "tool_choice": "auto", "parallel_tool_calls": True})


def _types(events: list[dict]) -> list[str]:
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)  # every event is one the SDK knows, with its required fields
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return [e["type"] for e in events]


def test_reasoning_comes_as_its_own_item_before_the_message() -> None:
    stream = EventStream(_SHELL)
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "hmm"}),
              _chunk({"content": "Pa"}), _chunk({"content": "ris"}), _chunk(finish="stop"), _USAGE]  # fmt: skip
    events = stream.start() + [e for c in chunks for e in stream.feed(c)] + stream.end()
    assert _types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Paris" and [i.type for i in final.output] == ["reasoning", "message"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]


def test_a_failure_after_the_start_is_a_failed_event_and_an_empty_answer_still_a_message() -> None:
    stream = EventStream(_SHELL)
    events = stream.start() + stream.feed(_chunk({"content": "Pa"})) + stream.feed({"error": "the chain broke", "status": 503})
    events += stream.end()
    assert _types(events)[-1] == "response.failed" and events[-1]["type"] == "response.failed"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.error.message == "the chain broke"
    assert failed.output[0].status == "incomplete" and failed.output_text == "Pa"
    stream = EventStream(_SHELL)
    events = stream.start() + stream.feed(_chunk(finish="length")) + stream.feed(_USAGE) + stream.end()
    assert _types(events)[2:] == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                                  "response.content_part.done", "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# --- a real peer -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    with Swarm(tmp_path_factory.mktemp("responses")) as s:
        a = s.start("a", "--layers", "0-30")
        s.wait_ready(a, timeout=90)
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"], 20, "a complete chain", a)
        yield a
        s.wait(lambda: a.get("/health")["sessions"] == {"stage": 0, "entry": 0}, 10, "no sessions left", a)


def client(peer: PeerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=peer.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_text(peer: PeerProcess, max_tokens: int) -> str:
    reply = client(peer).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=max_tokens, temperature=0)  # fmt: skip
    return reply.choices[0].message.content


@pytest.mark.swarm
@pytest.mark.slow
def test_the_answer_is_the_chat_answer(peer: PeerProcess) -> None:
    expected = _chat_text(peer, 24)
    reply = client(peer).responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                          metadata={"trace": "t1"}, user="me", store=True)  # fmt: skip
    assert reply.output_text == expected and reply.status in ("completed", "incomplete")
    assert reply.id.startswith("resp_") and reply.output[0].id.startswith("msg_") and reply.metadata == {"trace": "t1"}
    assert reply.usage.input_tokens > 0 and reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    # The raw body is a valid Response (the SDK does not validate what it parses).
    status, raw = request_json("POST", peer.url + "/v1/responses", {"model": MODEL, "input": QUESTION, "max_output_tokens": 24,
                                                                    "temperature": 0})  # fmt: skip
    assert status == 200 and Response.model_validate(raw).output_text == expected
    # A list of message items means the same conversation as the string.
    as_items = client(peer).responses.create(model=MODEL, temperature=0, max_output_tokens=24,
                                             input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])  # fmt: skip
    assert as_items.output_text == expected


@pytest.mark.swarm
@pytest.mark.slow
def test_the_stream_spells_the_chat_answer_in_openai_order(peer: PeerProcess) -> None:
    expected = _chat_text(peer, 24)
    events = list(client(peer).responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * len(deltas), "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", kinds[-1]]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete") and len(deltas) > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == expected == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens > 0
    # Each SSE event names its type on an ``event:`` line, as OpenAI's do; no ``[DONE]``.
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "temperature": 0, "stream": True}
    lines = httpx.post(peer.url + "/v1/responses", json=body, timeout=60).text.strip().split("\n\n")
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for line in lines:
        event, data = line.split("\n")
        assert event == "event: " + adapter.validate_python(json.loads(data.removeprefix("data: "))).type


@pytest.mark.swarm
@pytest.mark.slow
def test_the_token_cap_is_incomplete(peer: PeerProcess) -> None:
    reply = client(peer).responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3 and reply.output[0].status == "incomplete"
    assert reply.output_text == _chat_text(peer, 3)


@pytest.mark.swarm
@pytest.mark.slow
def test_refusals_are_http_errors_in_the_spec_shape(peer: PeerProcess) -> None:
    c = client(peer)
    with pytest.raises(openai.BadRequestError) as tools:
        c.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "function", "name": "f", "parameters": {}}])
    assert tools.value.status_code == 400 and tools.value.response.json()["error"].startswith("tools ")
    with pytest.raises(openai.BadRequestError) as stored:
        c.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_123")
    assert "previous_response_id" in stored.value.response.json()["error"]
    with pytest.raises(openai.BadRequestError) as reasoning:
        c.responses.create(model=MODEL, input=QUESTION, reasoning={"effort": "low"})
    assert reasoning.value.response.json()["error"].startswith("reasoning ")
    # An unknown model gets the chat route's status (422, "Model not in registry") and body.
    chat_status, chat_error = request_json("POST", peer.url + "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    status, error = request_json("POST", peer.url + "/v1/responses", {"model": "nope", "input": "x"})
    assert (status, error) == (chat_status, chat_error) == (422, {"error": "model 'nope' is not in the registry"})
    for bad, named in [({"temperature": "hot"}, "temperature"), ({"stream": "yes"}, "stream"), ({"input": 3}, "input"),
                       ({"max_output_tokens": -1}, "max_output_tokens"), ({"model": 5}, "model")]:  # fmt: skip
        status, error = request_json("POST", peer.url + "/v1/responses", {"model": MODEL, "input": "x", **bad})
        assert status == 400 and error["error"].startswith(named + " "), (bad, error)
    status, error = request_json("POST", peer.url + "/v1/responses", [1])
    assert status == 400 and error == {"error": "request body must be a JSON object"}


@pytest.mark.swarm
@pytest.mark.slow
def test_a_stream_cut_short_frees_the_session_and_a_deleted_one_fails(peer: PeerProcess) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", peer.url + "/v1/responses", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(12):
            next(lines)
        assert peer.get("/health")["sessions"]["stage"] == 1, "the generation should be running"
    _wait_no_sessions(peer)
    # DELETE /sessions/resp_... stops it: the stream has started, so it ends in response.failed.
    events: list[dict] = []
    with httpx.stream("POST", peer.url + "/v1/responses", json=body, timeout=60) as response:
        lines = response.iter_lines()
        created = json.loads(next(l for l in lines if l.startswith("data: "))[6:])
        answer_id = created["response"]["id"]
        # The route of the response is told under the id the client was given (it said
        # ``chatcmpl-``, an id the client never saw: an audit, 2026-12-08).
        assert peer.get(f"/sessions/{answer_id}")["id"] == answer_id
        deleted = httpx.delete(f"{peer.url}/sessions/{answer_id}")
        assert deleted.status_code == 204
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed" and "closed" in events[-1]["response"]["error"]["message"]
    Response.model_validate(events[-1]["response"])
    _wait_no_sessions(peer)


@pytest.mark.swarm
@pytest.mark.slow
def test_a_body_of_many_text_parts_is_one_clear_refusal(peer: PeerProcess) -> None:
    """Text parts are joined, not counted against the 64 media parts: a stranger's body of
    ~600,000 one-letter parts (21 MiB, under the 24 MiB cap) costs a translation (~0.5 s in
    a worker thread) and ends in the context check's 400; the peer goes on serving."""
    parts = [{"type": "input_text", "text": "a"}] * 600_000
    status, error = request_json("POST", peer.url + "/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": parts}]},
                                 timeout=120)  # fmt: skip
    assert 400 <= status < 500 and isinstance(error.get("error"), str), (status, error)
    assert client(peer).responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0).output_text


@pytest.mark.swarm
@pytest.mark.slow
def test_openapi_lists_the_route(peer: PeerProcess) -> None:
    schema = peer.get("/openapi.json")["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["model", "input"]


def _wait_no_sessions(peer: PeerProcess) -> None:
    deadline = time.monotonic() + 10
    while peer.get("/health")["sessions"] != {"stage": 0, "entry": 0}:
        assert time.monotonic() < deadline, "sessions were not freed"
        time.sleep(0.1)



def test_any_json_is_translated_or_refused_never_an_error_of_ours() -> None:
    """What the translation lets through, the chat parser validates; neither may fail with
    anything but the spec's 400 (the fuzzer of tests/adversary finds the route by its schema)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from api.chat_request import parse_chat_request
    from api.errors import ApiError
    from api.limits import RequestLimits

    scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=4)
    anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
    keys = st.sampled_from(["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "metadata",
                            "user", "store", "text", "tools", "tool_choice", "include", "truncation", "parallel_tool_calls"])  # fmt: skip
    parts = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": anything})
    items = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                                   "content": st.text(max_size=3) | st.lists(parts | anything, max_size=2)})  # fmt: skip
    bodies = st.dictionaries(keys, anything, max_size=6).map(lambda b: {"model": MODEL, "input": "hi", **b}) | anything
    bodies |= st.lists(items, min_size=1, max_size=2).map(lambda i: {"model": MODEL, "input": i})
    limits = RequestLimits()

    @settings(max_examples=400, deadline=None, database=None)
    @given(bodies)
    def translate(body: object) -> None:
        try:
            parse_chat_request(chat_body(body), limits)
        except ApiError:
            return
        json.dumps(response_object(Shell("s", 1, MODEL, 1.0, 1.0, echoed(body)), "completed", []))  # type: ignore[arg-type]

    translate()
