"""``/v1/generations`` and ``/v1/audio/*`` served in process over the real generators, a
real job table and a real artifact store; the official ``openai`` SDK for the audio routes.
Every error status the spec lists for these routes is asserted here."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import openai
import pytest
import trio
from generation_harness import ADMIN_TOKEN, CHAT_MODEL, Served, serve_generations
from speech_checks import SENTENCE, SENTENCE_MAX_WER, rms, tone_wav, wav_facts, word_error_rate

from api.errors import error_headers
from api.routes_audio import _JobDidNotComplete
from inclavate.artifact_types import QuotaExceeded
from inclavate.generation_settings import GenerationSettings
from inclavate.job_runner import RunnerConfig

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"This is sentence number {n} of a long reading." for n in range(1, 40))
UNKNOWN_ID = "1deaf021-07a3-407c-9d6f-1af47c23db18"


@pytest.fixture
async def served(tmp_path: Path, speech_generators: dict):  # type: ignore[no-untyped-def]
    async with serve_generations(tmp_path, speech_generators) as s:
        yield s


def client(s: Served) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=s.url, timeout=60)


def sdk(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


async def submit(http: httpx.AsyncClient, **body: object) -> dict:
    response = await http.post("/v1/generations", json={"model": "piper:joe", "modality": "audio", **body})
    assert response.status_code == 202, response.text
    return response.json()


def pcm_wav(seconds: float = 0.25, format_tag: int = 1) -> bytes:
    """A mono 16 kHz 16-bit WAV of silence. Another ``format_tag`` names a codec no decoder
    has: the header still reads, the samples do not decode."""
    rate, block = 16000, 2
    samples = bytes(int(rate * seconds) * block)
    fmt = struct.pack("<HHIIHH", format_tag, 1, rate, rate * block, block, 16)
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body


async def transcribe(http: httpx.AsyncClient, clip: bytes, media_type: str = "audio/wav", **fields: str) -> httpx.Response:
    return await http.post("/v1/audio/transcriptions", files={"file": ("clip", clip, media_type)},
                           data={"model": "whisper:tiny.en", **fields})  # fmt: skip


async def uploaded_objects(http: httpx.AsyncClient) -> int:
    return (await http.get("/v1/artifacts/usage")).json()["uploaded"]["objects"]


def assert_error_shape(response: httpx.Response, status: int) -> str:
    """The spec's error format: a JSON object whose ``error`` is a string (the message)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert isinstance(body, dict) and isinstance(body["error"], str) and body["error"]
    return body["error"]


async def wait_state(http: httpx.AsyncClient, job_id: str, states: tuple[str, ...], timeout: float = 60) -> dict:
    with trio.fail_after(timeout):
        while True:
            job = (await http.get(f"/v1/generations/{job_id}")).json()
            if job["state"] in states:
                return job
            await trio.sleep(0.05)


async def test_capabilities_list_both_real_generators(served: Served) -> None:
    async with client(served) as http:
        body = (await http.get("/v1/generations/capabilities")).json()
    by_model = {g["model"]: g for g in body["generators"]}
    assert set(by_model) == {"piper:joe", "whisper:tiny.en"}
    assert by_model["piper:joe"]["builtin_voices"] == ["joe"] and by_model["piper:joe"]["requires_speaker"] is False
    assert "voices" not in by_model["piper:joe"] and "requires_reference_text" not in by_model["piper:joe"]
    assert by_model["whisper:tiny.en"]["kind"] == "understand" and by_model["whisper:tiny.en"]["input_modalities"] == ["audio"]


async def test_openai_sdk_speech_then_transcription_round_trip(served: Served) -> None:
    api = sdk(served)
    speech = await trio.to_thread.run_sync(lambda: api.audio.speech.with_raw_response.create(
        model="piper:joe", voice="joe", input=SENTENCE, response_format="wav"))  # fmt: skip
    clip = speech.content
    assert speech.headers["content-type"] == "audio/wav"
    rate, channels, width, seconds = wav_facts(clip)
    assert rate == 22050 and channels == 1 and width == 2 and 1.0 < seconds < 6.0
    assert rms(clip) > 0.02
    artifact_id, job_id = speech.headers["x-dppan-artifact-id"], speech.headers["x-dppan-job-id"]
    meta = served.artifacts.meta(artifact_id)
    assert meta.kind == "generated" and meta.media_type == "audio/wav" and meta.size_bytes == len(clip)
    job = served.jobs.get(job_id)
    assert job is not None and job.state == "completed" and job.output_artifacts == (artifact_id,)

    transcript = await trio.to_thread.run_sync(lambda: api.audio.transcriptions.create(
        model="whisper:tiny.en", file=("hello.wav", clip, "audio/wav")))  # fmt: skip
    assert word_error_rate(SENTENCE, transcript.text) <= SENTENCE_MAX_WER, transcript.text
    plain = await trio.to_thread.run_sync(lambda: api.audio.transcriptions.with_raw_response.create(
        model="whisper:tiny.en", file=("hello.wav", clip, "audio/wav"), response_format="text"))  # fmt: skip
    assert plain.headers["content-type"].startswith("text/plain")
    assert word_error_rate(SENTENCE, plain.text) <= SENTENCE_MAX_WER
    text_artifact = served.artifacts.meta(plain.headers["x-dppan-artifact-id"])
    assert text_artifact.kind == "generated" and text_artifact.media_type.startswith("text/plain")
    # Re-fetched as the spec says, the transcript is text: its recorded type carries a charset,
    # which a lookup of the whole string missed (octet-stream; 2026-12-07, an audit from outside).
    async with client(served) as http:
        again = await http.get(f"/v1/artifacts/{text_artifact.id}")
    assert again.headers["content-type"] == "text/plain; charset=utf-8" and again.text == plain.text


async def test_speech_max_duration_truncates(served: Served) -> None:
    async with client(served) as http:
        response = await http.post("/v1/audio/speech", json={"model": "piper:joe", "input": LONG_TEXT[:200],
                                                              "max_duration_seconds": 1.5})  # fmt: skip
    assert response.status_code == 200
    assert wav_facts(response.content)[3] == pytest.approx(1.5, abs=1 / 22050)


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"input": "hi"}, 400, "model is required"),
        ({"model": "piper:joe"}, 400, "input is required"),
        ({"model": "piper:joe", "input": "hi", "response_format": "mp3"}, 400, "wav only"),
        ({"model": "piper:joe", "input": "hi", "voice": "alloy"}, 400, "unknown voice 'alloy'; voices here: joe"),
        ({"model": "piper:joe", "input": "hi", "speed": 4}, 400, "speed must be within 0.5-2.0"),
        ({"model": "piper:joe", "input": "hi", "speaker_artifact": UNKNOWN_ID}, 400, "speaker_unsupported"),
        ({"model": "piper:joe", "input": "hi", "reference_text": "hi"}, 400, "reference_text"),
        ({"model": "piper:joe", "input": "hi", "language": "fr"}, 400, "speaks en"),
        ({"model": "piper:joe", "input": "hi", "stream_format": "sse"}, 400, "stream_format 'sse' is not available"),
        ({"model": "piper:joe", "input": "..."}, 400, "nothing to speak"),  # a failed job, a 500, before
        ({"model": "piper:joe", "input": "a\u0000b"}, 400, "NUL character"),  # crashed the job in espeak
        ({"model": "nobody:tts", "input": "hi"}, 422, "no speech generator"),
        ({"model": "whisper:tiny.en", "input": "hi"}, 422, "no speech generator"),
    ],
)
async def test_speech_errors(served: Served, body: dict, status: int, message: str) -> None:
    async with client(served) as http:
        response = await http.post("/v1/audio/speech", json=body)
    assert response.status_code == status and message in response.json()["error"]


async def test_speech_wait_bound_is_a_504_naming_the_job_that_keeps_running(tmp_path: Path, speech_generators: dict) -> None:
    settings = GenerationSettings(speech_sync_timeout_s=0.05)
    async with serve_generations(tmp_path, speech_generators, settings=settings) as served, client(served) as http:
        response = await http.post("/v1/audio/speech", json={"model": "piper:joe", "input": SENTENCE})
        assert response.status_code == 504
        job_id = response.headers["x-dppan-job-id"]
        assert job_id in response.json()["error"] and response.json()["job_id"] == job_id
        assert (await wait_state(http, job_id, ("completed",)))["output_artifacts"]


async def test_the_sdk_does_not_retry_a_wait_that_ran_out_nor_a_failed_job(tmp_path: Path, speech_generators: dict) -> None:
    """OpenAI's SDK retries every 5xx twice unless told not to: a speech call whose wait ran
    out (504, the job keeps running) submitted three jobs, and a 507 re-uploaded the clip
    three times (an audit, 2026-12-07). Such answers say ``x-should-retry: false``."""
    settings = GenerationSettings(speech_sync_timeout_s=0.05)
    async with serve_generations(tmp_path, speech_generators, settings=settings) as served, client(served) as http:
        api = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=2)
        with pytest.raises(openai.InternalServerError) as raised:
            await trio.to_thread.run_sync(lambda: api.audio.speech.create(model="piper:joe", voice="joe", input=SENTENCE))
        assert raised.value.response.status_code == 504 and raised.value.response.headers["x-should-retry"] == "false"
        jobs = (await http.get("/v1/generations")).json()["generations"]
        assert len(jobs) == 1, [j["state"] for j in jobs]
    # The failed job's 500 and the full store's 507 say the same (neither frees by retrying).
    failed = {"id": "j", "state": "failed", "error_code": "engine_error", "error_message": "boom"}
    for exc in (_JobDidNotComplete(failed), QuotaExceeded("the store is full")):
        assert error_headers(exc)["x-should-retry"] == "false"
    assert "x-should-retry" not in error_headers(_JobDidNotComplete({**failed, "state": "expired"}))  # a retry may run
    assert "x-should-retry" not in error_headers(RuntimeError("a bug: a retry may meet a fixed peer"))


@pytest.mark.parametrize(
    "body, status",
    [
        ({"input": "lofi"}, 400),
        ({"model": "minimax-music3"}, 400),
        ({"model": "minimax-music3", "input": "lofi", "response_format": "mp3"}, 400),
        ({"model": "minimax-music3", "input": "lofi", "stems": "drums"}, 400),
        ({"model": "minimax-music3", "input": "lofi", "steps": 0}, 400),
        ({"model": "minimax-music3", "input": "lofi", "duration_seconds": -3}, 400),
        ({"model": "minimax-music3", "input": "lofi", "lyrics": "[verse]\nla"}, 422),
    ],
)
async def test_music_validates_then_has_no_generator(served: Served, body: dict, status: int) -> None:
    async with client(served) as http:
        assert (await http.post("/v1/audio/music", json=body)).status_code == status


async def test_transcription_errors(served: Served, speech_generators: dict) -> None:
    wav = pcm_wav()

    async def post(files: dict | None, data: dict, headers: dict | None = None) -> httpx.Response:
        async with client(served) as http:
            return await http.post("/v1/audio/transcriptions", files=files, data=data, headers=headers)

    ok_file = {"file": ("a.wav", wav, "audio/wav")}
    assert (await post(ok_file, {})).status_code == 400  # no model
    assert (await post(None, {"model": "whisper:tiny.en"})).status_code == 400  # no file
    webm = await post({"file": ("a.webm", wav, "audio/webm")}, {"model": "whisper:tiny.en"})
    assert webm.status_code == 400 and "audio/webm" in webm.json()["error"]
    for fmt in ("verbose_json", "srt", "vtt", "xml"):
        refused = await post(ok_file, {"model": "whisper:tiny.en", "response_format": fmt})
        assert refused.status_code == 400 and fmt in refused.json()["error"]
    # Streamed transcription events do not exist here: ignored, the SDK's stream=True read the
    # JSON answer as an event stream and returned no events, losing the transcript silently.
    streamed = await post(ok_file, {"model": "whisper:tiny.en", "stream": "true"})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]
    with pytest.raises(openai.BadRequestError):
        await trio.to_thread.run_sync(lambda: list(sdk(served).audio.transcriptions.create(
            model="whisper:tiny.en", file=("a.wav", wav, "audio/wav"), stream=True)))  # fmt: skip
    junk = await post({"file": ("a.wav", b"not a wav at all" * 10, "audio/wav")}, {"model": "whisper:tiny.en"})
    assert junk.status_code == 400 and "cannot be decoded" in junk.json()["error"]
    assert (await post(ok_file, {"model": "piper:joe"})).status_code == 422
    # Above the chat body limit (24 MiB) but within a clip's 64 MiB: accepted, then judged.
    large = await post({"file": ("a.wav", b"junk" * (10 * 1024 * 1024), "audio/wav")}, {"model": "whisper:tiny.en"})
    assert large.status_code == 400 and "cannot be decoded" in large.json()["error"]
    big = await post({"file": ("a.wav", b"RIFF" + bytes(64 * 1024 * 1024 + 1024 * 1024 + 10), "audio/wav")},
                     {"model": "whisper:tiny.en"})  # fmt: skip
    assert big.status_code == 413


async def test_a_transcription_body_that_is_not_multipart_says_so(served: Served) -> None:
    """A JSON body (``{"model": ..., "file": ...}``) or a multipart type without a boundary
    was parsed as an empty form: 400 "model is required", to a client that sent the model."""
    async with client(served) as http:
        for content_type, body in (("application/json", b'{"model": "whisper:tiny.en", "file": "x"}'),
                                   ("multipart/form-data", b"--x--"), (None, b"model=whisper:tiny.en")):  # fmt: skip
            headers = {"content-type": content_type} if content_type else {}
            refused = await http.post("/v1/audio/transcriptions", content=body, headers=headers)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"] == "the body must be multipart/form-data with a boundary (fields: model, file)"


async def test_a_truncated_transcription_body_says_so_and_leaves_nothing(served: Served) -> None:
    """Quart's form parser took a body that stopped before its closing boundary as the parts
    that had arrived: cut inside the clip it answered "file is required", and a whole clip
    without the closing boundary was transcribed. Both are now a 400 saying the body is
    truncated, with nothing stored, no job, and the body budget given back."""
    async with client(served) as http:
        whole = httpx.Request("POST", "http://peer/v1/audio/transcriptions", files={"file": ("a.wav", pcm_wav(), "audio/wav")},
                              data={"model": "whisper:tiny.en"}).read()  # fmt: skip
        boundary = whole[2:whole.index(b"\r\n")]
        headers = {"content-type": f"multipart/form-data; boundary={boundary.decode()}"}
        cuts = (whole[: len(whole) // 2],  # inside the clip
                whole[: whole.rindex(b"--" + boundary)])  # every part whole, no closing boundary

        async def chunked(body: bytes) -> AsyncIterator[bytes]:  # a chunked body whose last chunk came early
            yield body

        for body in (*cuts, chunked(cuts[0])):
            refused = await http.post("/v1/audio/transcriptions", content=body, headers=headers)
            assert "truncated" in assert_error_shape(refused, 400)
        assert (await http.get("/v1/generations")).json()["generations"] == []
        assert await uploaded_objects(http) == 0
    budget = served.app.extensions["inclavate.body_budget"]
    with trio.fail_after(5):  # given back as the connection's request ends
        while budget.held:
            await trio.sleep(0.01)


async def test_refused_transcriptions_leave_no_clip_behind(tmp_path: Path, speech_generators: dict) -> None:
    """A clip may be 64 MiB and the quota may be unlimited: a refusal that kept the clip would
    let a client fill the disk with requests that all fail. Params the generator refuses are
    refused before the clip is stored; a full queue (429) deletes the stored clip again."""
    config = RunnerConfig(max_active=1, poll_s=0.1)
    async with serve_generations(tmp_path, speech_generators, config=config) as s, client(s) as http:
        for _ in range(3):
            long_prompt = await transcribe(http, pcm_wav(), prompt="x" * 5000)
            assert assert_error_shape(long_prompt, 400) == "params.prompt is longer than 4096 characters"
        assert await uploaded_objects(http) == 0
        busy = await submit(http, params={"text": LONG_TEXT})
        full = await transcribe(http, pcm_wav())
        assert "queue" in assert_error_shape(full, 429)
        assert await uploaded_objects(http) == 0 and s.artifacts.usage().uploaded.objects == 0
        await http.delete(f"/v1/generations/{busy['id']}")


@pytest.mark.parametrize(
    "clip, media_type",
    [
        (b"RIFF" + struct.pack("<I", 100) + b"WAVE" + bytes(60), "audio/wav"),  # RIFF/WAVE, no fmt or data chunk
        (pcm_wav()[:30], "audio/wav"),  # cut inside the fmt chunk
        (b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(100), "audio/mpeg"),  # an ID3 tag, then no MPEG frame
        (pcm_wav(), "audio/mpeg"),  # a WAV declared as MP3
    ],
    ids=["riff-shell", "cut-header", "id3-without-frame", "wav-as-mp3"],
)
async def test_a_container_that_cannot_be_decoded_is_a_400_before_any_job(served: Served, clip: bytes, media_type: str) -> None:
    async with client(served) as http:
        message = assert_error_shape(await transcribe(http, clip, media_type), 400)
        assert f"cannot be decoded as {media_type}" in message
        assert (await http.get("/v1/generations")).json()["generations"] == []
        assert await uploaded_objects(http) == 0


async def test_a_clip_whose_samples_do_not_decode_is_a_400_and_keeps_nothing(served: Served) -> None:
    """The header reads (so the check before the job lets it through) but the decoder has no
    codec for it: the job fails with input_unreadable, which is the client's clip, not a 500."""
    async with client(served) as http:
        response = await transcribe(http, pcm_wav(format_tag=0x1234))
        assert "input_unreadable" in assert_error_shape(response, 400)
        assert response.json()["error_code"] == "input_unreadable"
        job = (await http.get(f"/v1/generations/{response.json()['job_id']}")).json()
        assert (job["state"], job["error_code"]) == ("failed", "input_unreadable")
        assert await uploaded_objects(http) == 0


async def test_a_clip_at_an_implausible_rate_or_too_long_is_refused_before_it_is_decoded(tmp_path: Path,
                                                                                          speech_generators: dict) -> None:  # fmt: skip
    """An audit (2026-12-07): a 2 KiB WAV at 1 Hz claims 2,048 s, which the peer decoded to
    16 kHz float32 whole (+1.8 GB; ~20 KiB would take the machine). The route refuses it on
    its header (400, nothing stored, no job); as a job's input it skips the route, and the
    generator refuses it before decoding."""
    settings = GenerationSettings(transcription_max_seconds=5.0)
    async with serve_generations(tmp_path, speech_generators, settings=settings) as s, client(s) as http:
        for clip, why in ((tone_wav(1, 2048), "sample rate of 1 Hz"), (tone_wav(8000, 6), "6 s long; at most 5 s")):
            assert why in assert_error_shape(await transcribe(http, clip), 400)
        assert (await http.get("/v1/generations")).json()["generations"] == []
        assert await uploaded_objects(http) == 0
        clip = await s.service.store_upload(tone_wav(1, 2048), "audio/wav")
        body = {"model": "whisper:tiny.en", "modality": "text", "params": {"prompt": "x"}, "input_artifacts": [clip]}
        job = (await http.post("/v1/generations", json=body)).json()
        failed = await wait_state(http, job["id"], ("failed", "completed"), timeout=20)
        assert (failed["error_code"], failed["error_message"]) == ("unsupported_input", "a sample rate of 1 Hz is "
                                                                   "outside 8000-192000 Hz")  # fmt: skip


async def test_job_lifecycle_events_listing_and_admin_erase(served: Served) -> None:
    async with client(served) as http:
        job = await submit(http, params={"text": SENTENCE}, seed=7)
        assert job["state"] == "queued" and job["id"].count("-") == 4 and job["seed"] == 7
        events = []
        async with http.stream("GET", f"/v1/generations/{job['id']}/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        states = [json.loads(e)["state"] for e in events[:-1]]
        assert states[-1] == "completed" and "running" in states
        assert len(events) == len(set(events))  # one event per change
        final = json.loads(events[-2])
        assert final["progress_stage"] == "publishing" and final["progress_fraction"] == 1.0
        # Attaching to a finished job: its outcome at once, then [DONE].
        again = (await http.get(f"/v1/generations/{job['id']}/events")).text
        assert again.count("data: ") == 2 and again.rstrip().endswith("data: [DONE]")
        # The listing resolves outputs against the store; a single GET does not.
        await served.artifacts.delete(final["output_artifacts"][0])
        row = next(r for r in (await http.get("/v1/generations")).json()["generations"] if r["id"] == job["id"])
        assert row["output_artifacts"] == [] and row["artifacts_deleted"] == 1 and row["params"] == {"text": SENTENCE}
        assert (await http.get(f"/v1/generations/{job['id']}")).json()["artifacts_deleted"] == 0
        # Cancel a finished job: 409, and it stays readable.
        assert (await http.delete(f"/v1/generations/{job['id']}")).status_code == 409
        # Admin erase: token rules, then the record goes (its artifact was already gone).
        path = f"/admin/generations/{job['id']}"
        assert (await http.delete(path)).status_code == 401
        assert (await http.delete(path, headers={"X-Admin-Token": "wrong"})).status_code == 401
        erased = await http.delete(path, headers={"X-Admin-Token": ADMIN_TOKEN})
        assert erased.status_code == 200 and erased.json() == {"id": job["id"], "artifacts_deleted": 0}
        assert (await http.get(f"/v1/generations/{job['id']}")).status_code == 404
        assert (await http.delete(path, headers={"X-Admin-Token": ADMIN_TOKEN})).status_code == 404


async def test_admin_erase_keeps_or_deletes_artifacts_and_refuses_active_jobs(served: Served) -> None:
    headers = {"X-Admin-Token": ADMIN_TOKEN}
    async with client(served) as http:
        kept = await wait_state(http, (await submit(http, params={"text": "One."}))["id"], ("completed",))
        gone = await wait_state(http, (await submit(http, params={"text": "Two."}))["id"], ("completed",))
        answer = await http.delete(f"/admin/generations/{kept['id']}?artifacts=false", headers=headers)
        assert answer.json()["artifacts_deleted"] == 0
        assert served.artifacts.meta(kept["output_artifacts"][0]).ready
        answer = await http.delete(f"/admin/generations/{gone['id']}", headers=headers)
        assert answer.json()["artifacts_deleted"] == 1
        busy = await submit(http, params={"text": LONG_TEXT})
        assert (await http.delete(f"/admin/generations/{busy['id']}", headers=headers)).status_code == 409
        await http.delete(f"/v1/generations/{busy['id']}")


async def test_admin_erase_without_a_configured_token_is_503(tmp_path: Path, speech_generators: dict) -> None:
    async with serve_generations(tmp_path, speech_generators, admin_token=None) as s, client(s) as http:
        response = await http.delete(f"/admin/generations/{UNKNOWN_ID}", headers={"X-Admin-Token": "x"})
    assert response.status_code == 503


async def test_cancel_mid_generation_stops_between_frames_and_keeps_nothing(served: Served) -> None:
    async with client(served) as http:
        job = await submit(http, params={"text": LONG_TEXT})
        with trio.fail_after(60):
            while not ((j := (await http.get(f"/v1/generations/{job['id']}")).json())["progress_fraction"] or 0) > 0:
                await trio.sleep(0.05)
        assert j["state"] == "running"
        cancelled = await http.delete(f"/v1/generations/{job['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        assert cancelled.json()["output_artifacts"] == []
    assert served.artifacts.usage().generated.objects == 0


async def _leave_while_it_runs(http: httpx.AsyncClient, request: Callable[[], Awaitable[object]]) -> dict:
    """Start a synchronous route's request, hang up once its job is generating (the
    connection closes), and return the job as it ends."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        with trio.fail_after(60):
            while not (running := [j for j in (await http.get("/v1/generations")).json()["generations"] if j["state"] == "running"]):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    return await wait_state(http, running[0]["id"], ("completed", "failed", "cancelled", "expired"))


async def test_a_client_that_leaves_a_speech_request_takes_its_job_along(served: Served) -> None:
    """Only the waiting client would have learnt the job's id: one that left used to leave the
    job running to the end and its audio kept for good."""
    async with client(served) as http:
        job = await _leave_while_it_runs(http, lambda: http.post("/v1/audio/speech", json={"model": "piper:joe", "input": LONG_TEXT}))
        assert job["state"] == "cancelled" and job["output_artifacts"] == []
    assert served.artifacts.usage().generated.objects == 0


async def test_a_client_that_leaves_a_transcription_takes_its_job_and_clip_along(served: Served) -> None:
    async with client(served) as http:
        job = await _leave_while_it_runs(http, lambda: transcribe(http, pcm_wav(seconds=20.0)))
        assert job["state"] == "cancelled"
        assert await uploaded_objects(http) == 0
    assert served.artifacts.usage().generated.objects == 0


async def test_cancel_a_queued_job_and_idempotency(served: Served) -> None:
    async with client(served) as http:
        first = await submit(http, params={"text": LONG_TEXT}, idempotency_key="k1")
        same = await submit(http, params={"text": "something else"}, idempotency_key="k1")
        assert same["id"] == first["id"]
        queued = await submit(http, params={"text": SENTENCE})
        assert (await http.delete(f"/v1/generations/{queued['id']}")).json()["state"] == "cancelled"
        await http.delete(f"/v1/generations/{first['id']}")


async def test_deadline_expires_a_running_job(served: Served) -> None:
    async with client(served) as http:
        job = await submit(http, params={"text": LONG_TEXT}, deadline_seconds=1.0)
        done = await wait_state(http, job["id"], ("expired", "completed", "failed"))
    assert done["state"] == "expired" and done["error_code"] == "deadline_exceeded"
    assert served.artifacts.usage().generated.objects == 0


async def test_generation_submission_errors(served: Served) -> None:
    async with client(served) as http:
        assert (await http.post("/v1/generations", content=b"{nope", headers={"content-type": "application/json"})).status_code == 400
        bad_params = await http.post("/v1/generations", json={"model": "piper:joe", "modality": "audio", "params": {}})
        assert bad_params.status_code == 400 and "params.text" in bad_params.json()["error"]
        for modality in ("image", "video"):
            none = await http.post("/v1/generations", json={"model": "piper:joe", "modality": modality})
            assert none.status_code == 422
        assert (await http.post("/v1/generations", json={"model": "sdxl", "modality": "image"})).status_code == 422
        assert (await http.get("/v1/generations/not-a-uuid")).status_code == 400
        assert (await http.get(f"/v1/generations/{UNKNOWN_ID}")).status_code == 404
        assert (await http.get("/v1/generations/not-a-uuid/events")).status_code == 400
        assert (await http.get(f"/v1/generations/{UNKNOWN_ID}/events")).status_code == 404
        assert (await http.delete(f"/v1/generations/{UNKNOWN_ID}")).status_code == 404
        assert (await http.get("/v1/generations?limit=0")).status_code == 400
        for offset in ("9223372036854775808", "99999999999999999999999"):  # SQLite overflowed: a 500
            too_far = await http.get(f"/v1/generations?offset={offset}")
            assert too_far.status_code == 400 and "offset" in too_far.json()["error"], too_far.text


async def test_a_lone_surrogate_in_any_string_is_a_400(served: Served) -> None:
    """``"\\ud800"`` is valid JSON but not text: the job table refused it as an idempotency
    key (500), and a speech job crashed on it. The body parser refuses it for every route."""
    bodies = {
        "/v1/generations": rb'{"model": "piper:joe", "modality": "audio", "params": {"text": "hi"}, "idempotency_key": "k\ud800"}',
        "/v1/audio/speech": rb'{"model": "piper:joe", "input": "\udfff hi"}',
    }
    async with client(served) as http:
        for path, body in bodies.items():
            response = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400 and "surrogate" in response.json()["error"], (path, response.text)
    assert served.jobs.list(10, 0) == []


async def test_queue_full_is_429(tmp_path: Path, speech_generators: dict) -> None:
    async with serve_generations(tmp_path, speech_generators, config=RunnerConfig(max_active=1, poll_s=0.1)) as s:
        async with client(s) as http:
            first = await submit(http, params={"text": LONG_TEXT})
            full = await http.post("/v1/generations", json={"model": "piper:joe", "modality": "audio",
                                                            "params": {"text": "hi"}})  # fmt: skip
            assert full.status_code == 429
            assert full.headers["retry-after"] == "5"  # the openai SDK's retry waits this long
            await http.delete(f"/v1/generations/{first['id']}")


async def test_understanding_jobs_and_their_error_codes(served: Served) -> None:
    async def upload(data: bytes, media_type: str) -> str:
        return await served.service.store_upload(data, media_type)

    async with client(served) as http:
        speech = await http.post("/v1/audio/speech", json={"model": "piper:joe", "input": SENTENCE})
        clip = await upload(speech.content, "audio/wav")
        png = await upload(b"\x89PNG\r\n\x1a\n" + bytes(32), "image/png")

        async def run(model: str, params: dict, inputs: list[str]) -> dict:
            job = (await http.post("/v1/generations", json={"model": model, "modality": "text", "params": params,
                                                            "input_artifacts": inputs})).json()  # fmt: skip
            return await wait_state(http, job["id"], ("completed", "failed"))

        done = await run("whisper:tiny.en", {"prompt": "Transcribe."}, [clip])
        assert done["state"] == "completed" and done["modality"] == "text"
        text = (await served.service.read_artifact(done["output_artifacts"][0], 1 << 20)).data.decode()
        assert word_error_rate(SENTENCE, text) <= SENTENCE_MAX_WER
        for model, params, inputs, code in [
            ("whisper:tiny.en", {}, [clip], "no_prompt"),
            ("whisper:tiny.en", {"prompt": "x"}, [], "no_input"),
            ("whisper:tiny.en", {"prompt": "x"}, [UNKNOWN_ID], "input_unreadable"),
            ("whisper:tiny.en", {"prompt": "x"}, [png], "unsupported_input"),
            (CHAT_MODEL, {"prompt": "Describe it."}, [clip], "unsupported_input"),
        ]:
            failed = await run(model, params, inputs)
            assert (failed["state"], failed["error_code"]) == ("failed", code), (model, params, failed)


async def test_a_restart_resumes_the_interrupted_job(tmp_path: Path, speech_generators: dict) -> None:
    async with serve_generations(tmp_path, speech_generators) as s, client(s) as http:
        job = await submit(http, params={"text": " ".join(LONG_TEXT.split()[:36])})
        await wait_state(http, job["id"], ("running",))
    # The service above was torn down mid-generation (its worker cancelled): the row says running.
    async with serve_generations(tmp_path, speech_generators) as s, client(s) as http:
        done = await wait_state(http, job["id"], ("completed", "failed"), timeout=120)
        listed = (await http.get("/v1/artifacts")).json()["artifacts"]
    assert done["state"] == "completed" and len(done["output_artifacts"]) == 1
    # The shutdown's own output (the generator ran to its end; the write was cancelled) left
    # no row behind: the job never named it, so nothing would ever delete it.
    assert [a["id"] for a in listed] == done["output_artifacts"]


async def test_openapi_describes_the_generation_and_audio_routes(served: Served) -> None:
    async with client(served) as http:
        paths = (await http.get("/openapi.json")).json()["paths"]
    assert set(paths["/v1/generations/{job_id}"]) == {"get", "delete"}
    assert "429" in paths["/v1/generations"]["post"]["responses"]
    assert "504" in paths["/v1/audio/speech"]["post"]["responses"]
    assert "multipart/form-data" in paths["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]
    assert paths["/admin/generations/{job_id}"]["delete"]["security"] == [{"adminToken": []}]


async def test_disconnecting_from_events_does_not_cancel(served: Served) -> None:
    async with client(served) as http:
        job = await submit(http, params={"text": "One sentence. And another one."})

        def watch_briefly() -> None:  # a sync client: leaving early leaves no async generator behind
            with httpx.stream("GET", f"{served.url}/v1/generations/{job['id']}/events", timeout=30) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        return  # the watcher leaves after the first event

        await trio.to_thread.run_sync(watch_briefly)
        assert (await wait_state(http, job["id"], ("completed", "cancelled")))["state"] == "completed"


async def test_input_too_large_and_publish_failed(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from inclavate import job_runner
    from inclavate.artifact_types import ArtifactConfig

    async with client(served) as http:
        clip = await served.service.store_upload(b"RIFF" + bytes(100), "audio/wav")
        monkeypatch.setattr(job_runner, "MAX_INPUT_BYTES", 50)
        body = {"model": "whisper:tiny.en", "modality": "text", "params": {"prompt": "x"}, "input_artifacts": [clip]}
        job = (await http.post("/v1/generations", json=body)).json()
        assert (await wait_state(http, job["id"], ("failed", "completed")))["error_code"] == "input_too_large"
        served.artifacts.config = ArtifactConfig(max_objects=1)  # the store is full: the output cannot be kept
        job = await submit(http, params={"text": "Hi."})
        failed = await wait_state(http, job["id"], ("failed", "completed"))
        assert (failed["state"], failed["error_code"]) == ("failed", "publish_failed")


async def test_an_input_named_again_is_read_once(served: Served) -> None:
    """An audit (2026-12-07): a job may name one input 16 times (the spec keeps their order),
    and each was read whole into a copy of its own (up to 64 MiB each). It is read once, and
    the job's inputs are the same bytes in the order named."""
    reads: list[str] = []
    read_input = served.runner._read_input

    async def counting(artifact_id: str, limit: int):  # type: ignore[no-untyped-def]
        reads.append(artifact_id)
        return await read_input(artifact_id, limit)

    served.runner._read_input = counting  # type: ignore[method-assign]
    async with client(served) as http:
        note, other = [await served.service.store_upload(text, "text/plain") for text in (b"x" * 100, b"y")]
        body = {"model": CHAT_MODEL, "modality": "text", "params": {"prompt": "x"}, "input_artifacts": [note, other, note, note]}
        job = (await http.post("/v1/generations", json=body)).json()
        await wait_state(http, job["id"], ("failed", "completed"), timeout=20)
    assert reads == [note, other]


async def test_without_generation_every_route_is_503() -> None:
    from api.app import create_app, serve_api
    from generation_harness import GenerationContext
    from inclavate.local_swarm import free_port

    port = free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_api, create_app(GenerationContext(None, ADMIN_TOKEN)), "127.0.0.1", port)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            for method, path, kwargs in [
                ("GET", "/v1/generations/capabilities", {}),
                ("POST", "/v1/generations", {"json": {"model": "piper:joe", "modality": "audio"}}),
                ("GET", "/v1/generations", {}),
                ("GET", f"/v1/generations/{UNKNOWN_ID}", {}),
                ("GET", f"/v1/generations/{UNKNOWN_ID}/events", {}),
                ("DELETE", f"/v1/generations/{UNKNOWN_ID}", {}),
                ("POST", "/v1/audio/speech", {"json": {"model": "piper:joe", "input": "hi"}}),
                ("POST", "/v1/audio/music", {"json": {"model": "m", "input": "lofi"}}),
                ("POST", "/v1/audio/transcriptions", {"data": {"model": "whisper:tiny.en"}}),
            ]:
                response = await http.request(method, path, **kwargs)
                assert response.status_code == 503, (method, path, response.text)
        nursery.cancel_scope.cancel()


async def test_audio_routes_share_the_queue_bound_and_the_wait_bound(tmp_path: Path, speech_generators: dict) -> None:
    settings = GenerationSettings(transcription_sync_timeout_s=0.05)
    config = RunnerConfig(max_active=1, poll_s=0.1)
    async with serve_generations(tmp_path, speech_generators, config=config, settings=settings) as s, client(s) as http:
        clip = (await http.post("/v1/audio/speech", json={"model": "piper:joe", "input": SENTENCE})).content
        files = {"file": ("a.wav", clip, "audio/wav")}
        slow = await http.post("/v1/audio/transcriptions", files=files, data={"model": "whisper:tiny.en"})
        assert slow.status_code == 504 and slow.headers["x-dppan-job-id"] in slow.json()["error"]
        await wait_state(http, slow.headers["x-dppan-job-id"], ("completed",))  # it kept running
        busy = await submit(http, params={"text": LONG_TEXT})
        assert (await http.post("/v1/audio/speech", json={"model": "piper:joe", "input": "hi"})).status_code == 429
        assert (await http.post("/v1/audio/transcriptions", files=files, data={"model": "whisper:tiny.en"})).status_code == 429
        await http.delete(f"/v1/generations/{busy['id']}")


async def test_a_chat_model_reads_text_inputs_as_a_job(tmp_path: Path, speech_generators: dict, smollm2, slice_cache) -> None:  # type: ignore[no-untyped-def]
    from local_context import LocalContext

    chat = LocalContext(CHAT_MODEL, smollm2.path, slice_cache)
    try:
        async with serve_generations(tmp_path, speech_generators, chat=chat) as s, client(s) as http:
            listed = (await http.get("/v1/generations/capabilities")).json()["generators"]
            assert {"modality": "text", "kind": "understand", "model": CHAT_MODEL, "ready": True,
                    "input_modalities": ["text"]} in listed  # an understanding generator "like any other"
            note = await s.service.store_upload(b"The meeting moved to Tuesday at noon.", "text/plain")
            body = {"model": CHAT_MODEL, "modality": "text", "input_artifacts": [note],
                    "params": {"prompt": "When is the meeting?", "max_tokens": 12}}  # fmt: skip
            job = (await http.post("/v1/generations", json=body)).json()
            done = await wait_state(http, job["id"], ("completed", "failed"))
            assert done["state"] == "completed", done
            answer = (await s.service.read_artifact(done["output_artifacts"][0], 1 << 20)).data.decode()
            assert answer.strip()
            assert chat.open_sessions()["stage"] == 0  # the turn freed its KV cache
            # An audit (2026-12-07): 16 copies of one upload were decoded, joined and encoded
            # before the chat path refused them (+2.8 GB from 16 MiB). Text the context cannot
            # hold whatever it tokenizes to is refused on its size, before it is decoded.
            limit = chat.chat.max_bytes_per_token * (chat.local_pipeline.context_length - 1)  # the chat route's bound
            big = await s.service.store_upload(b"a" * (limit // 16 + 1), "text/plain")
            job = (await http.post("/v1/generations", json={**body, "input_artifacts": [big] * 16})).json()
            failed = await wait_state(http, job["id"], ("completed", "failed"))
            assert failed["error_code"] == "inference_failed", failed  # as the chat path's own refusal was
            assert f"cannot hold more than {limit} bytes" in failed["error_message"]
    finally:
        chat.close()
