"""Generation jobs across real peer processes on 127.0.0.1.

Peer X is started with default flags in a home where `inclavate pull --speech piper:joe` and
`inclavate pull whisper:tiny.en` ran: it must offer both generators. Peer Y runs
``--no-generators``: everything done through Y (capabilities, speech, transcription, a
job's read, listing, events, cancel, admin erase) reaches X's generators and job table.
Last, X is killed with SIGKILL mid-generation and restarted: the job resumes and completes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from speech_checks import SENTENCE, SENTENCE_MAX_WER, rms, wav_facts, word_error_rate
from swarm import PeerProcess, Swarm

from inclavate.owner_ids import owner_candidates

SPEECH_MODELS = {"piper:joe", "whisper:tiny.en"}

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

LONG_TEXT = " ".join(f"This is sentence number {n} of a long reading." for n in range(1, 40))
TOKEN = "swarm-admin-token"
REPO_ROOT = Path(__file__).resolve().parents[1]


def peer_id_of(data_dir: Path) -> str:
    """Create the peer's identity before it starts, so another peer can trust it."""
    code = "import sys; from p2p.identity import load_or_create_identity as l; print(l(__import__('pathlib').Path(sys.argv[1])).peer_id)"
    data_dir.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", code, str(data_dir)], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, smollm2: object, speech_home: Path) -> Iterator[tuple[Swarm, PeerProcess, PeerProcess]]:
    workdir = tmp_path_factory.mktemp("generation-swarm")
    y_id = peer_id_of(workdir / "y")
    with Swarm(workdir) as swarm:
        x = swarm.start("x", "--layers", "0-30", "--admin-token", TOKEN, "--admin-peer", y_id)
        y = swarm.start("y", "--layers", "0-30", "--no-generators", "--admin-token", TOKEN, bootstrap=x)
        swarm.wait_ready(x)
        swarm.wait_ready(y)
        swarm.wait(lambda: SPEECH_MODELS <= {g["model"] for g in y.get("/v1/generations/capabilities")["generators"]}, 60,
                   "Y to learn X's generators", y)  # fmt: skip
        yield swarm, x, y


def test_default_flags_offer_both_pulled_models_and_any_peer_lists_them(pair: tuple) -> None:
    _, x, y = pair
    for peer in (x, y):
        by_model = {g["model"]: g for g in peer.get("/v1/generations/capabilities")["generators"]}
        readers = {model for model, g in by_model.items() if g.get("input_modalities") == ["text"]}
        assert set(by_model) - readers == SPEECH_MODELS
        assert by_model["piper:joe"]["builtin_voices"] == ["joe"]
        assert by_model["whisper:tiny.en"]["input_modalities"] == ["audio"]
        # The chat model both serve reads text as a job on either: listed, and ready.
        assert by_model["smollm2:135m"] == {"modality": "text", "kind": "understand", "model": "smollm2:135m",
                                            "ready": True, "input_modalities": ["text"]}  # fmt: skip


def test_speech_and_transcription_through_a_peer_without_generators(pair: tuple) -> None:
    _, x, y = pair
    x_id = x.get("/health")["peer_id"]
    speech = httpx.post(y.url + "/v1/audio/speech", json={"model": "piper:joe", "input": SENTENCE, "voice": "joe"}, timeout=120)
    assert speech.status_code == 200, speech.text
    assert wav_facts(speech.content)[0] == 22050 and rms(speech.content) > 0.02
    artifact_id = speech.headers["x-dppan-artifact-id"]
    assert owner_candidates(artifact_id, [x_id]) == [x_id]  # produced and stored on X
    again = httpx.get(y.url + f"/v1/artifacts/{artifact_id}", timeout=30)
    assert again.status_code == 200 and again.content == speech.content
    # The clip is uploaded to Y, read by X's Whisper over the artifact protocol.
    files = {"file": ("hello.wav", speech.content, "audio/wav")}
    transcript = httpx.post(y.url + "/v1/audio/transcriptions", files=files, data={"model": "whisper:tiny.en"}, timeout=120)
    assert transcript.status_code == 200, transcript.text
    assert word_error_rate(SENTENCE, transcript.json()["text"]) <= SENTENCE_MAX_WER


def test_a_job_is_read_listed_watched_cancelled_and_erased_through_another_peer(pair: tuple) -> None:
    _, x, y = pair
    submitted = httpx.post(y.url + "/v1/generations", json={"model": "piper:joe", "modality": "audio",
                                                             "params": {"text": LONG_TEXT}}, timeout=30)  # fmt: skip
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    assert x.get(f"/v1/generations/{job_id}")["id"] == job_id  # it lives on X
    seen = []
    with httpx.stream("GET", y.url + f"/v1/generations/{job_id}/events", timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                seen.append(event["state"])
                if event["state"] == "running" and (event["progress_fraction"] or 0) > 0:
                    break
    assert seen[-1] == "running"
    assert any(r["id"] == job_id for r in y.get("/v1/generations")["generations"])
    cancelled = httpx.delete(y.url + f"/v1/generations/{job_id}", timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert httpx.delete(y.url + f"/v1/generations/{job_id}", timeout=30).status_code == 409
    erased = httpx.delete(y.url + f"/admin/generations/{job_id}", headers={"X-Admin-Token": TOKEN}, timeout=30)
    assert erased.status_code == 200 and erased.json() == {"id": job_id, "artifacts_deleted": 0}
    assert httpx.get(x.url + f"/v1/generations/{job_id}", timeout=10).status_code == 404


def test_a_job_survives_kill_9_of_its_peer(pair: tuple) -> None:
    swarm, x, _ = pair
    job = httpx.post(x.url + "/v1/generations", json={"model": "piper:joe", "modality": "audio",
                                                       "params": {"text": " ".join(LONG_TEXT.split()[:80])}}, timeout=30).json()  # fmt: skip
    swarm.wait(lambda: x.get(f"/v1/generations/{job['id']}")["state"] == "running", 60, "the job to run", x)
    x.process.send_signal(signal.SIGKILL)
    x.process.wait(10)
    swarm.peers.remove(x)
    restarted = swarm.start("x", "--layers", "0-30")  # same name: same data dir, same job table
    swarm.wait_ready(restarted)
    done = swarm.wait(lambda: (j := restarted.get(f"/v1/generations/{job['id']}"))["state"] in ("completed", "failed") and j,
                      180, "the resumed job to finish", restarted)  # fmt: skip
    assert done["state"] == "completed" and len(done["output_artifacts"]) == 1
