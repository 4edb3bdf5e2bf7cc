"""The job table (inclavate/jobs.py): lifecycle, idempotency, queue bound, ordering, and
what a restart does to jobs that were queued or running. Pure SQLite, no generators."""

from __future__ import annotations

from pathlib import Path

import pytest

from inclavate.jobs import MAX_ATTEMPTS, JobStore, NewJob, QueueFull, rfc3339

T0 = 1_780_000_000_000


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    s = JobStore.in_dir(tmp_path)
    yield s
    s.close()


def new(key: str | None = None, deadline: float = 60.0) -> NewJob:
    return NewJob(modality="audio", model="piper:joe", params={"text": "hi"}, idempotency_key=key, deadline_s=deadline)


def test_created_queued_with_spec_fields(store: JobStore) -> None:
    job, created = store.create("a", new(), max_active=4, now=T0)
    assert created and job.state == "queued" and job.version == 1
    body = job.to_json()
    assert body["created_at"] == rfc3339(T0) and body["expires_at"] == rfc3339(T0 + 60_000)
    assert body["created_at"].endswith("Z") and body["started_at"] is None and body["output_artifacts"] == []
    assert {"progress_stage", "progress_fraction", "error_code", "error_message", "seed", "input_artifacts"} <= set(body)


def test_idempotency_key_returns_the_first_job(store: JobStore) -> None:
    first, _ = store.create("a", new("k"), max_active=4, now=T0)
    again, created = store.create("b", new("k"), max_active=4, now=T0 + 5)
    assert not created and again.id == first.id
    assert store.get("b") is None


def test_queue_bound_counts_queued_and_running(store: JobStore) -> None:
    store.create("a", new(), max_active=2, now=T0)
    store.create("b", new(), max_active=2, now=T0)
    store.start("a", T0)
    with pytest.raises(QueueFull):
        store.create("c", new(), max_active=2, now=T0)
    store.finish("a", "completed", T0, outputs=("x",))
    store.create("c", new(), max_active=2, now=T0)  # room again


def test_listing_is_newest_first_with_id_tie_break(store: JobStore) -> None:
    for job_id, at in [("a", T0), ("c", T0 + 1), ("b", T0 + 1), ("d", T0 + 2)]:
        store.create(job_id, new(), max_active=10, now=at)
    assert [j.id for j in store.list(10, 0)] == ["d", "c", "b", "a"]
    assert [j.id for j in store.list(2, 1)] == ["c", "b"]
    assert store.next_queued().id == "a"  # first in, first out


def test_terminal_state_is_final_and_versions_grow(store: JobStore) -> None:
    store.create("a", new(), max_active=4, now=T0)
    running = store.start("a", T0 + 1)
    assert running is not None and running.state == "running" and running.attempts == 1
    assert store.start("a", T0 + 2) is None  # claimed once
    progressed = store.progress("a", "generating", 0.5)
    assert progressed is not None and progressed.version > running.version
    done = store.finish("a", "completed", T0 + 3, outputs=("art",))
    assert done is not None and done.to_json()["output_artifacts"] == ["art"]
    assert store.finish("a", "cancelled", T0 + 4) is None
    assert store.get("a").state == "completed"


def test_outputs_only_shown_when_completed(store: JobStore) -> None:
    store.create("a", new(), max_active=4, now=T0)
    failed = store.finish("a", "failed", T0, outputs=("x",), error_code="inference_failed", error_message="boom")
    assert failed is not None and failed.to_json()["output_artifacts"] == [] and failed.error_code == "inference_failed"


def test_restart_requeues_running_then_fails_it_never_stuck(tmp_path: Path) -> None:
    store = JobStore.in_dir(tmp_path)
    store.create("a", new(deadline=3600), max_active=4, now=T0)
    store.start("a", T0)
    store.close()
    store = JobStore.in_dir(tmp_path)  # the peer restarted mid-generation
    assert store.recover(T0 + 10) == ["a"]
    assert store.get("a").state == "queued"
    for _ in range(MAX_ATTEMPTS - 1):
        store.start("a", T0 + 20)
    assert store.recover(T0 + 30) == []
    job = store.get("a")
    assert job.state == "failed" and job.error_code == "interrupted"
    store.close()


def test_restart_expires_overdue_and_settles_cancel_requests(store: JobStore) -> None:
    store.create("late", new(deadline=1), max_active=4, now=T0)
    store.create("stop", new(deadline=3600), max_active=4, now=T0)
    store.start("stop", T0)
    store.request_cancel("stop")
    store.recover(T0 + 5_000)
    assert store.get("late").state == "expired" and store.get("late").error_code == "deadline_exceeded"
    assert store.get("stop").state == "cancelled"
    assert store.active_count() == 0


def test_only_the_newest_finished_jobs_are_kept(store: JobStore) -> None:
    for n in range(5):
        store.create(f"j{n}", new(), max_active=10, now=T0 + n)
    for n in range(4):
        store.finish(f"j{n}", "completed", T0 + 10)
    assert store.prune_finished(keep=2) == 2
    assert [j.id for j in store.list(10, 0)] == ["j4", "j3", "j2"]  # j4 is still queued: never pruned


class _CountingStore(JobStore):
    """Counts the history scans the runner asks for."""

    scans = 0

    def finished_count(self) -> int:
        self.scans += 1
        return super().finished_count()

    def prune_finished(self, keep: int) -> int:
        self.scans += 1
        return super().prune_finished(keep)


async def test_an_idle_runner_does_not_rescan_a_full_history_and_prunes_it_in_batches(tmp_path: Path) -> None:
    """Pruning sorts every finished record: the runner once did it every second, ~11 ms of
    its event loop at the default 10,000 records, forever, and seconds each second for a
    peer keeping millions. Now it looks only after a job changed, and prunes once the
    history is a tenth over its limit."""
    import trio

    from inclavate.job_runner import JobRunner, RunnerConfig

    store = _CountingStore.in_dir(tmp_path)
    for n in range(30):
        store.create(f"old{n:02d}", new(), max_active=100, now=T0 + n)
        store.finish(f"old{n:02d}", "completed", T0 + n)
    runner = JobRunner(store, None, {}, "peer", lambda *_: None, RunnerConfig(poll_s=0.01, history_max=20))  # type: ignore[arg-type]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            await trio.sleep(0.2)
            assert store.finished_count() == 20  # over the limit at start: pruned to it
            scans = store.scans
            await trio.sleep(0.3)  # thirty idle rounds
            assert store.scans == scans
            for n in range(3):  # 23 finished: more than a tenth over 20
                job, _ = runner.submit(new())
                await runner.cancel(job.id)
                await trio.sleep(0.05)
                assert store.finished_count() == (21 + n if n < 2 else 20)
            nursery.cancel_scope.cancel()
    store.close()
