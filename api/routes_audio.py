"""OpenAI-compatible audio: ``/v1/audio/speech``, ``/v1/audio/music``, ``/v1/audio/transcriptions``.

Thin adapters over generation jobs (same queue, limits and ownership): each checks OpenAI's
fields against the generator's capabilities, submits a job, waits for it within a bounded
time (``DPPAN_*_SYNC_TIMEOUT_SECS``; running out is a 504 that names the job, which keeps
running) and answers with the artifact's bytes, naming the artifact and job in
``x-dppan-artifact-id`` / ``x-dppan-job-id``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio
from werkzeug.http import parse_options_header

from api.bodies import json_object
from api.context import PeerContext
from api.errors import ApiError, BadRequest, GatewayTimeout, PayloadTooLarge, error_headers
from api.media_headers import UnreadableHeader, audio_duration, audio_sample_rate, sniff_audio
from api.multipart import read_form
from api.routes_generations import service
from api.uploads import RequestChunks, set_body_limit
from api.request_guard import takes_any_body
from inclavate.generations import GenerationService, NoGenerator
from inclavate.jobs import NewJob
from node.generators.audio_decode import implausible_rate, too_long

ARTIFACT_HEADER = "x-dppan-artifact-id"
JOB_HEADER = "x-dppan-job-id"
MAX_CLIP_BYTES = 64 * 1024 * 1024
MULTIPART_OVERHEAD = 1024 * 1024
"""Room for the form's other fields and boundaries around a clip of the maximum size."""
AUDIO_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/mpeg", "audio/mp3")
MP3_TYPES = ("audio/mpeg", "audio/mp3")
"""The MP3 types of ``AUDIO_TYPES``; the others are WAV."""
CLIENT_INPUT_CODES = ("input_unreadable", "no_input", "input_too_large", "unsupported_input")
"""Job error codes that blame the clip the client sent, not this server: 400. The check
before the job catches most; the owner of the job (another peer, perhaps with a lower
``DPPAN_TRANSCRIPTION_MAX_SECONDS``) or the decoder (a header that lied) finds the rest."""
REFUSED_FORMATS = ("verbose_json", "srt", "vtt")
DEFAULT_TRANSCRIPTION_PROMPT = "Transcribe this audio."
MAX_OUTPUT_BYTES = 4 * 1024 * 1024
MAX_SPEECH_BYTES = 256 * 1024 * 1024
ABANDON_TIMEOUT_S = 10.0
"""How long a left client's job may take to be cancelled (an owner's answer included)."""
MAX_FIELD_BYTES = 64 * 1024
"""A form field's ceiling (a prompt longer than the generator takes gets its own message)."""


def _capability(generations: GenerationService, model: str, want: str) -> dict[str, Any]:
    for entry in generations.capabilities():
        if entry.get("model") != model:
            continue
        if want == "speech" and entry.get("modality") == "audio" and entry.get("kind") is None:
            return entry
        if want == "transcribe" and entry.get("kind") == "understand" and "audio" in entry.get("input_modalities", []):
            return entry
    kind = {"speech": "speech", "transcribe": "audio-understanding"}[want]
    raise NoGenerator(f"no {kind} generator named {model!r}; GET /v1/generations/capabilities lists them")


def _string(body: dict[str, Any], key: str, *, required: bool = False, max_length: int = 4096) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise BadRequest(f"{key} is required")
        return None
    if not isinstance(value, str) or (required and not value.strip()) or len(value) > max_length:
        raise BadRequest(f"{key} must be a {'non-empty ' if required else ''}string of at most {max_length} characters")
    return value


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadRequest(f"{key} must be a positive number")
    return float(value)


def _wav_only(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is not None and fmt != "wav":
        raise BadRequest(f"response_format {fmt!r} is not available: this deployment produces wav only")


async def _finished(generations: GenerationService, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Wait for the job within the route's bound: the finished job, or 504 naming it. A
    client that leaves meanwhile takes the job with it (:meth:`GenerationService.abandon`):
    it never got the job's id, so the job's output would stay for good."""
    try:
        done = await generations.wait_finished(job["id"], timeout_s)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # the request is being cancelled: its client left
            # Shielded, and bounded: an owner that never answers the cancel held this for ever,
            # through the peer's shutdown (an audit, 2026-12-07).
            with trio.CancelScope(shield=True), trio.move_on_after(ABANDON_TIMEOUT_S):
                await generations.abandon(job["id"])
        raise
    if done is None:
        raise _TimedOut(job["id"])
    if done["state"] != "completed" or not done["output_artifacts"]:
        raise (_InputUnreadable if done.get("error_code") in CLIENT_INPUT_CODES else _JobDidNotComplete)(done)
    return done


class _TimedOut(GatewayTimeout):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"the wait ran out; job {job_id} keeps running: poll GET /v1/generations/{job_id}")
        self.job_id = job_id

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "job_id": self.job_id}


class _JobDidNotComplete(ApiError):
    """The job ended without output: failed (with its error_code), cancelled or expired. The
    answer names the job and why; an SDK's retry would submit the same job again, which only
    an expired one (it waited too long for a worker) may do better."""

    status = 500

    def __init__(self, job: dict[str, Any]) -> None:
        code = job.get("error_code") or job["state"]
        super().__init__(f"generation job {job['id']} {job['state']} ({code}): {job.get('error_message') or ''}".strip())
        self.job = job
        self.should_retry = job["state"] == "expired"

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "job_id": self.job["id"], "error_code": self.job.get("error_code")}


class _InputUnreadable(_JobDidNotComplete):
    """The job failed on its input (the generator could not decode the clip, it was too long
    or at an implausible sample rate, or there was none): the client's request was bad, so 400 as the spec lists for "a container that
    cannot be decoded", not a server error. The header check before the job catches most
    such clips; this catches those whose header reads but whose contents do not decode."""

    status = 400


def _headers(job: dict[str, Any]) -> dict[str, str]:
    return {ARTIFACT_HEADER: job["output_artifacts"][0], JOB_HEADER: job["id"]}


def install(app: QuartTrio, ctx: PeerContext) -> None:
    # A clip may be 64 MiB, above the app-wide (chat) body limit; the form is read as it streams.
    set_body_limit(app, "POST", "/v1/audio/transcriptions", MAX_CLIP_BYTES + MULTIPART_OVERHEAD)

    @app.errorhandler(_TimedOut)
    async def _on_timeout(exc: _TimedOut) -> Response:
        response = jsonify(exc.body())
        response.status_code = 504
        response.headers.update(error_headers(exc))
        response.headers[JOB_HEADER] = exc.job_id
        return response

    @app.post("/v1/audio/speech")
    async def audio_speech():  # type: ignore[no-untyped-def]
        """Speak ``input`` with a speech generator; answers the WAV itself."""
        generations = service(ctx)
        body = await json_object()
        model = _string(body, "model", required=True, max_length=200)
        text = _string(body, "input", required=True)
        _wav_only(body)
        if body.get("stream_format") not in (None, "audio"):
            # Ignored, a client that asked for speech.audio.delta events got WAV bytes to parse as them.
            raise BadRequest(f"stream_format {body['stream_format']!r} is not available: the answer is the audio "
                             "itself; leave stream_format out (or 'audio')")  # fmt: skip
        assert model is not None
        entry = _capability(generations, model, "speech")
        params: dict[str, Any] = {"text": text}
        voice = _string(body, "voice", max_length=100)
        if voice is not None:
            names = [*entry.get("voices", []), *entry.get("builtin_voices", [])]
            if voice not in names:
                known = f"voices here: {', '.join(names)}" if names else f"{model} has no voices to choose from"
                raise BadRequest(f"unknown voice {voice!r}; {known}")
            params["voice"] = voice
        if body.get("speaker_artifact") is not None and not entry.get("requires_speaker"):
            raise BadRequest(f"speaker_unsupported: {model} takes no speaker clip")
        if body.get("reference_text") is not None and not entry.get("requires_reference_text"):
            raise BadRequest(f"{model} does not take reference_text")
        speed = _number(body, "speed")
        bounds = entry.get("speed_range")
        if speed is not None and bounds is not None:
            if not bounds["min"] <= speed <= bounds["max"]:
                raise BadRequest(f"speed must be within {bounds['min']}-{bounds['max']} for {model}, got {speed:g}")
            params["speed"] = speed
        for key in ("max_duration_seconds",):
            if (value := _number(body, key)) is not None:
                params[key] = value
        language = _string(body, "language", max_length=16)
        if language is not None and entry.get("languages") and language.split("-")[0].lower() not in entry["languages"]:
            raise BadRequest(f"{model} speaks {', '.join(entry['languages'])}, not {language!r}")
        _string(body, "instruct")  # accepted; only instruction-tuned checkpoints act on it
        new = NewJob(modality="audio", model=model, params=params, deadline_s=generations.settings.default_deadline_s)
        job = await generations.submit(new, local_only=False, known_chat_model=False)
        done = await _finished(generations, job, generations.settings.speech_sync_timeout_s)
        media = await generations.read_artifact(done["output_artifacts"][0], MAX_SPEECH_BYTES)
        return Response(media.data, status=200, content_type="audio/wav", headers=_headers(done))

    @app.post("/v1/audio/music")
    async def audio_music():  # type: ignore[no-untyped-def]
        """Generate a song (no music generator is configured in this build: 422)."""
        service(ctx)
        body = await json_object()
        _string(body, "model", required=True, max_length=200)
        _string(body, "input", required=True)
        _string(body, "lyrics", max_length=16384)
        _wav_only(body)
        _number(body, "duration_seconds")
        steps = body.get("steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000):
            raise BadRequest("steps must be an integer from 1 to 1000")
        stems = body.get("stems", "mix")
        if stems not in ("mix", "vocal", "instrumental"):
            raise BadRequest("stems must be mix, vocal or instrumental")
        raise NoGenerator(f"no music generator is configured: {body['model']!r} cannot generate music here")

    @app.post("/v1/audio/transcriptions")
    @takes_any_body
    async def audio_transcriptions():  # type: ignore[no-untyped-def]
        """Transcribe an uploaded clip (multipart) with an audio-understanding generator."""
        generations = service(ctx)
        length = request.content_length
        if length is not None and length > MAX_CLIP_BYTES + MULTIPART_OVERHEAD:
            raise PayloadTooLarge(f"the upload is {length} bytes; a clip may be at most 64 MiB")
        # Not Quart's request.form: it parsed any other body as an empty form ("model is
        # required" to a JSON body with a model), and a body cut before its closing boundary as
        # the parts that had arrived ("file is required"). read_form refuses both (400).
        received = await read_form(RequestChunks(kept=True), request.headers.get("Content-Type"), file_field="file",
                                   max_file_bytes=MAX_CLIP_BYTES, field_limit=MAX_FIELD_BYTES, fields="model, file")
        form, upload = received.fields, received.file
        model = form.get("model", "").strip()
        if not model:
            raise BadRequest("model is required: an understanding generator that reads audio")
        fmt = form.get("response_format", "json")
        if fmt in REFUSED_FORMATS:
            raise BadRequest(f"response_format {fmt!r} is refused: this path produces a flat transcript without "
                             "language, duration or segment timestamps; use json or text")  # fmt: skip
        if fmt not in ("json", "text"):
            raise BadRequest(f"response_format must be json or text, not {fmt!r}")
        if form.get("stream", "false").strip().lower() not in ("false", "0", ""):
            # Ignored, the SDK read the JSON answer as an event stream and handed back no
            # events at all: the transcript was lost without an error.
            raise BadRequest("stream is not supported: the transcript comes back whole; leave stream out (or false)")
        if upload is None:
            raise BadRequest("file is required: the clip to transcribe")
        media_type = parse_options_header(upload.content_type or "")[0].lower()
        if not media_type:
            raise BadRequest("the file part needs a Content-Type (audio/wav or audio/mpeg)")
        if media_type not in AUDIO_TYPES:
            raise BadRequest(f"audio format {media_type!r} is not accepted; use one of {', '.join(AUDIO_TYPES)}")
        data = upload.data
        _check_container(data, media_type, generations.settings.transcription_max_seconds)
        _capability(generations, model, "transcribe")
        params: dict[str, Any] = {"prompt": form.get("prompt") or DEFAULT_TRANSCRIPTION_PROMPT}
        if form.get("language"):
            params["language"] = form["language"][:16]
        new = NewJob(modality="text", model=model, params=params, deadline_s=generations.settings.default_deadline_s)
        generations.check(new, n_inputs=1)  # refused params cost no stored clip
        done = await _transcribed(generations, new, data, media_type)
        text = (await generations.read_artifact(done["output_artifacts"][0], MAX_OUTPUT_BYTES)).data.decode(errors="replace")
        if fmt == "text":
            return Response(text, status=200, content_type="text/plain; charset=utf-8", headers=_headers(done))
        response = jsonify(text=text)
        response.headers.update(_headers(done))
        return response


async def _transcribed(generations: GenerationService, new: NewJob, data: bytes, media_type: str) -> dict[str, Any]:
    """Store the clip as the job's input, submit the job and wait for it (the finished job).

    A clip may be 64 MiB and the artifact quota may be unlimited, so a refused request must
    not leave its clip behind, or refusals alone fill the disk. The clip is deleted again
    whenever no job will read it: the submission failed (400, 429, 503, ...), the job ended
    without output, or the client left (the job is then cancelled, see :func:`_finished`). It
    stays while a job may still read it (504, or its owner stopped answering the wait) and
    with a completed job (its input).
    """
    input_id = await generations.store_upload(data, media_type)
    job: dict[str, Any] | None = None
    try:
        job = await generations.submit(replace(new, input_artifacts=(input_id,)), local_only=False,
                                       known_chat_model=False)  # fmt: skip
        return await _finished(generations, job, generations.settings.transcription_sync_timeout_s)
    except BaseException as exc:
        if job is None or isinstance(exc, _JobDidNotComplete) or not isinstance(exc, Exception):  # refused, failed, or abandoned
            with trio.CancelScope(shield=True):
                await generations.discard_upload(input_id)
        raise


def _check_container(data: bytes, media_type: str, max_seconds: float) -> None:
    """Refuse (400) a clip whose bytes are not the declared container, whose header cannot
    be read, or whose header names an implausible sample rate or more audio than a job may
    hold, before anything is stored or a job exists. Magic bytes alone let a RIFF/WAVE
    shell through to the decoder, which failed the job and answered 500; reading the header
    the way chat audio parts are read (:mod:`api.media_headers`) refuses it here. A 2 KiB
    WAV at 1 Hz claimed 2,048 s, which the decoder resampled to gigabytes (an audit,
    2026-12-07); the generator checks again, and bounds the decode, for clips that reach it
    otherwise (``POST /v1/generations``) or whose header lies."""
    fmt = "mp3" if media_type in MP3_TYPES else "wav"
    found = sniff_audio(data)
    if found != fmt:
        raise BadRequest(f"the file cannot be decoded as {media_type}: it is {found or 'not audio'}, not {fmt}")
    try:
        seconds, rate = audio_duration(fmt, data), audio_sample_rate(fmt, data)
    except UnreadableHeader as exc:
        raise BadRequest(f"the file cannot be decoded as {media_type}: {exc}") from None
    # A WAV's length is exact (its data, no more than the bytes sent); an MP3's without a
    # Xing tag is estimated from its first frame, and a quiet VBR opening overstates it
    # several times: that one is left to the decoder, which counts what it produces.
    if (why := implausible_rate(rate) or (too_long(seconds, max_seconds) if fmt == "wav" else None)) is not None:
        raise BadRequest(f"the clip is refused: {why}")
