"""Metrics without a network: the recorder on an injected clock, the SQLite store across a
reopen, the pure aggregations over constructed views, and the service loop on trio's
autojump clock."""

from __future__ import annotations

import sqlite3
from functools import partial
from pathlib import Path

import pytest
import trio
from registry_helpers import view

from inclavate.metrics import (
    BUCKET_MINUTES,
    MINUTE_MS,
    SAMPLE_RING,
    MetricsRecorder,
    ModelMetrics,
    RecorderState,
    Summary,
    cluster_minutes,
    history,
    minute_of,
    model_metrics,
    rankings,
    slice_key,
    summary,
)
from inclavate.metrics_store import MetricsStore, MetricsStoreError, archive_cluster, run_metrics
from inclavate.types import LayerRange
from p2p.records import Counters, MetricSample, MinuteBucket
from p2p.registry import NodeView

T0 = 1_745_123_400_000  # a minute boundary


class Clock:
    def __init__(self, ms: int = T0) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def node(name: str, start: int = 0, end: int = 30, state: str = "Ready", *, tps: float = 0.0,
         latency: float = 0.0, tokens: int = 0, requests: int = 0, **fields) -> NodeView:  # fmt: skip
    counters = Counters(tokens_total=tokens, requests_served=requests, avg_latency_ms=latency)
    return view(name, start, end, state, throughput_tps=tps, counters=counters, **fields)


# ------------------------------------------------------------------ recorder


def test_recorder_counts_cumulatively_per_model_and_per_minute() -> None:
    clock = Clock(T0 + 5_000)
    rec = MetricsRecorder(clock)
    rec.record_request("a")
    rec.record_request("b")
    rec.record_tokens(100, 40.0)
    clock.ms += MINUTE_MS
    rec.record_request("a")
    rec.record_tokens(10, 20.0)
    rec.record_error()
    assert rec.counters() == Counters(tokens_total=110, requests_served=3, errors=1, avg_latency_ms=30.0)
    assert rec.requests_by_model() == {"a": 2, "b": 1}
    assert rec.buckets(clock.ms) == (MinuteBucket(T0, 2, 100), MinuteBucket(T0 + MINUTE_MS, 1, 10))


def test_buckets_keep_the_last_sixty_minutes() -> None:
    clock = Clock()
    rec = MetricsRecorder(clock)
    for _ in range(BUCKET_MINUTES + 5):
        rec.record_request("a")
        clock.ms += MINUTE_MS
    clock.ms -= MINUTE_MS  # back inside the last minute that saw traffic
    held = rec.buckets(clock.ms)
    assert len(held) == BUCKET_MINUTES
    assert held[0].ts_ms == clock.ms - (BUCKET_MINUTES - 1) * MINUTE_MS and held[-1].ts_ms == clock.ms
    # An hour of silence later nothing is left to gossip, but the totals stay.
    assert rec.buckets(clock.ms + BUCKET_MINUTES * MINUTE_MS) == ()
    assert rec.counters().requests_served == BUCKET_MINUTES + 5


def test_samples_measure_load_and_the_ring_holds_sixty() -> None:
    clock = Clock()
    rec = MetricsRecorder(clock)
    rec.record_tokens(300, 50.0)
    rec.record_tokens(100, 150.0)
    first = rec.sample(T0 + 10_000)
    # 400 tokens in 10 s of wall time; two steps averaging 100 ms.
    assert first == MetricSample(tps=40.0, latency_ms=100.0, ts_ms=T0 + 10_000)
    for i in range(2, SAMPLE_RING + 3):
        rec.sample(T0 + i * 10_000)
    samples = rec.samples()
    assert len(samples) == SAMPLE_RING and samples[-1].ts_ms == T0 + (SAMPLE_RING + 2) * 10_000
    assert all(s.tps == 0 and s.latency_ms == 0 for s in samples)


def test_throughput_is_the_busy_rate_and_survives_idleness() -> None:
    rec = MetricsRecorder(Clock())
    assert rec.throughput_tps() == 0.0
    rec.record_tokens(50, 100.0)  # counted before the window closes
    assert rec.throughput_tps() == 500.0
    rec.sample(T0 + 10_000)
    for i in range(2, 100):  # long idle: the last measured speed and latency stand
        rec.sample(T0 + i * 10_000)
    assert rec.throughput_tps() == 500.0 and rec.counters().avg_latency_ms == 100.0


def test_sample_after_a_clock_step_back_assumes_the_nominal_interval() -> None:
    rec = MetricsRecorder(Clock(T0 + 60_000))
    rec.record_tokens(100, 10.0)
    assert rec.sample(T0).tps == 10.0


def test_restored_state_continues_counting() -> None:
    state = RecorderState(Counters(1000, 10, 2, 33.0), 250.0, {"a": 10}, (MinuteBucket(T0, 10, 1000),))
    clock = Clock(T0 + 1_000)
    rec = MetricsRecorder(clock, state)
    assert rec.counters() == state.counters and rec.throughput_tps() == 250.0
    rec.record_request("a")
    assert rec.requests_by_model() == {"a": 11} and rec.buckets(clock.ms) == (MinuteBucket(T0, 11, 1000),)
    assert rec.snapshot().counters.requests_served == 11


def test_figures_measured_on_another_slice_are_dropped_and_the_entrys_counts_kept() -> None:
    """A restored state (or this run's, before a move) counts for the slice it was measured
    on only: tests/test_metrics_restart.py holds the real peer's side."""
    old, new = slice_key("m", LayerRange(0, 10)), slice_key("m", LayerRange(10, 30))
    state = RecorderState(Counters(1000, 10, 2, 33.0), 250.0, {"a": 10}, (MinuteBucket(T0, 10, 1000),), old)
    clock = Clock(T0 + 1_000)
    rec = MetricsRecorder(clock, state)
    rec.measuring(old)
    assert rec.snapshot() == state
    rec.record_tokens(5, 10.0)
    rec.measuring(new)
    assert rec.counters() == Counters(0, 10, 2, 0.0) and rec.throughput_tps() == 0.0
    assert rec.requests_by_model() == {"a": 10} and rec.buckets(clock.ms) == (MinuteBucket(T0, 10, 0),)
    assert rec.snapshot().measured_on == new
    rec.record_tokens(8, 4.0)
    assert rec.counters().avg_latency_ms == 4.0 and rec.throughput_tps() == 2000.0
    # A state of unknown slice (a version-1 database) is trusted for none.
    unknown = MetricsRecorder(clock, RecorderState(Counters(1000, 10, 2, 33.0), 250.0))
    unknown.measuring(new)
    assert unknown.counters() == Counters(0, 10, 2, 0.0)


def test_a_negative_batch_is_refused() -> None:
    with pytest.raises(ValueError):
        MetricsRecorder(Clock()).record_tokens(-1, 5.0)


# --------------------------------------------------------------------- store


def test_store_reopens_with_the_same_counters_and_buckets(tmp_path: Path) -> None:
    clock = Clock(T0 + 1_000)
    rec = MetricsRecorder(clock)
    rec.record_request("a")
    rec.record_tokens(64, 32.0)
    clock.ms += MINUTE_MS
    rec.record_request("b")
    rec.record_error()
    with MetricsStore.in_dir(tmp_path) as store:
        assert store.load() == RecorderState()
        store.save(rec.snapshot())
    with MetricsStore.in_dir(tmp_path) as store:
        restored = MetricsRecorder(clock, store.load())
    assert restored.counters() == rec.counters()
    assert restored.requests_by_model() == rec.requests_by_model()
    assert restored.buckets(clock.ms) == rec.buckets(clock.ms)
    assert restored.throughput_tps() == rec.throughput_tps() == 2000.0


def test_the_slice_is_stored_and_a_version_1_database_gains_it(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "metrics.db") as conn:  # what version 1 created
        conn.execute("CREATE TABLE totals (id INTEGER PRIMARY KEY, tokens_total INTEGER, requests_served "
                     "INTEGER, errors INTEGER, avg_latency_ms FLOAT, throughput_tps FLOAT)")  # fmt: skip
        conn.execute("INSERT INTO totals VALUES (1, 1000, 10, 2, 33.0, 250.0)")
        conn.execute("PRAGMA user_version = 1")
    conn.close()
    with MetricsStore.in_dir(tmp_path) as store:
        assert store.load() == RecorderState(Counters(1000, 10, 2, 33.0), 250.0, measured_on="")
        store.save(RecorderState(Counters(1, 1, 0, 2.0), 3.0, measured_on="m@0-10"))
    with MetricsStore.in_dir(tmp_path) as store:
        assert store.load().measured_on == "m@0-10"


def test_save_replaces_minutes_that_left_the_window(tmp_path: Path) -> None:
    with MetricsStore.in_dir(tmp_path) as store:
        store.save(RecorderState(buckets=(MinuteBucket(T0, 1, 1), MinuteBucket(T0 + MINUTE_MS, 2, 2))))
        store.save(RecorderState(buckets=(MinuteBucket(T0 + MINUTE_MS, 3, 3),)))
        assert store.load().buckets == (MinuteBucket(T0 + MINUTE_MS, 3, 3),)


def test_archive_keeps_the_larger_total_and_forgets_after_a_day(tmp_path: Path) -> None:
    day_later = T0 + 1441 * MINUTE_MS
    with MetricsStore.in_dir(tmp_path) as store:
        store.archive([MinuteBucket(T0, 5, 100), MinuteBucket(T0 + MINUTE_MS, 1, 1)], T0 + 2 * MINUTE_MS)
        store.archive([MinuteBucket(T0, 3, 900)], T0 + 2 * MINUTE_MS)
        assert store.archived_minutes(T0, T0 + MINUTE_MS) == [MinuteBucket(T0, 5, 900)]
        store.archive([MinuteBucket(day_later, 1, 1)], day_later)
        assert store.archived_minutes(0, day_later + MINUTE_MS) == [MinuteBucket(day_later, 1, 1)]


def test_a_corrupt_or_newer_database_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.db").write_bytes(b"not a database" * 100)
    with pytest.raises(MetricsStoreError):
        MetricsStore.in_dir(tmp_path)
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as conn:
        conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(MetricsStoreError, match="newer"):
        MetricsStore(newer)


# -------------------------------------------------------------- aggregations


def test_rankings_normalise_to_the_best_and_break_ties_by_node_id() -> None:
    views = [
        node("c", tps=100, latency=9),  # merit 100 / (1 + 9) = 10
        node("b", tps=100, latency=9),  # a tie with "c": the smaller id ranks first
        node("a", tps=50, latency=9),  # merit 5
        node("d", tps=0, latency=0),  # never measured
        node("z", tps=1000, latency=0, state="Dead"),
    ]
    got = [(r.node_id, r.score, r.rank) for r in rankings(views)]
    assert got == [("b", 1.0, 1), ("c", 1.0, 2), ("a", 0.5, 3), ("d", 0.0, 4)]


def test_ranking_weights_are_exponents() -> None:
    fast_slow = node("fast", tps=200, latency=99)  # 2.0 at (1, 1)
    slow_fast = node("slow", tps=100, latency=24)  # 4.0 at (1, 1)
    assert [r.node_id for r in rankings([fast_slow, slow_fast])] == ["slow", "fast"]
    # Latency ignored: throughput alone decides.
    ranked = rankings([fast_slow, slow_fast], latency_weight=0)
    assert [(r.node_id, r.score) for r in ranked] == [("fast", 1.0), ("slow", 0.5)]
    # Throughput ignored: latency alone decides, 25 / 100.
    ranked = rankings([fast_slow, slow_fast], tps_weight=0)
    assert [(r.node_id, r.score) for r in ranked] == [("slow", 1.0), ("fast", 0.25)]
    # Huge weights do not overflow.
    assert rankings([fast_slow, slow_fast], tps_weight=100, latency_weight=100)[0].score == 1.0


def test_rankings_with_no_traffic_anywhere_are_all_zero_in_id_order() -> None:
    assert [(r.node_id, r.score) for r in rankings([node("y"), node("x")])] == [("x", 0.0), ("y", 0.0)]
    assert rankings([]) == []


def test_summary_counts_full_model_tokens_and_ready_latency() -> None:
    views = [
        node("a", 0, 15, tokens=1000, requests=7, latency=20),  # half the model: 500
        node("b", 15, 30, tokens=1000, requests=0, latency=40),
        node("c", 0, 30, "Degraded", tokens=300, requests=3, latency=500),  # latency not counted
        node("d", 0, 30, "Dead", tokens=200),
        node("e", 0, 30, "Joining"),
        node("f", 0, 30, idle=True),  # Ready, set idle by an admin: serves nothing (as /api/models counts it)
    ]
    expected = Summary(total_nodes=6, ready_nodes=2, total_tokens=1500, total_requests=10, avg_latency_ms=30.0)
    assert summary(views) == expected
    assert summary([]) == Summary(0, 0, 0, 0, 0.0)


def test_model_metrics_count_requests_at_every_entry_peer() -> None:
    views = [
        node("a", 0, 10, tokens=900, latency=10, requests_by_model={"m:1": 4, "other": 2}),
        node("b", 10, 30, tokens=900, latency=30),
        node("x", 0, 5, model_id="other", n_layers=5, tokens=50, requests_by_model={"m:1": 1}),
    ]
    assert model_metrics(views, "m:1") == ModelMetrics("m:1", nodes=2, requests=5, tokens=900, avg_latency_ms=20.0)
    assert model_metrics(views, "other") == ModelMetrics("other", nodes=1, requests=2, tokens=50, avg_latency_ms=0.0)
    # Asked for but served by no node (it left): still known.
    asked_only = [node("a", requests_by_model={"gone": 3})]
    assert model_metrics(asked_only, "gone") == ModelMetrics("gone", 0, 3, 0, 0.0)
    assert model_metrics(views, "nobody") is None


def test_cluster_minutes_sum_every_record_in_range() -> None:
    m0, m1 = T0, T0 + MINUTE_MS
    views = [
        node("a", 0, 15, buckets=(MinuteBucket(m0, 2, 100), MinuteBucket(m1, 1, 10))),
        node("b", 15, 30, "Dead", buckets=(MinuteBucket(m0, 0, 100),)),
    ]
    assert cluster_minutes(views, m0, m1) == [MinuteBucket(m0, 2, 100)]
    assert cluster_minutes(views, m0, m1 + MINUTE_MS) == [MinuteBucket(m0, 2, 100), MinuteBucket(m1, 1, 5)]


def test_history_fills_every_minute_and_merges_the_archive_by_max() -> None:
    now = T0 + 2 * MINUTE_MS + 30_000  # the third minute, half gone
    views = [node("a", buckets=(MinuteBucket(T0 + MINUTE_MS, 2, 20), MinuteBucket(T0 + 2 * MINUTE_MS, 1, 5)))]
    # The archive remembers minute 0 from a peer that left, and a partial minute 1.
    archive = [MinuteBucket(T0, 7, 70), MinuteBucket(T0 + MINUTE_MS, 1, 30)]
    got = history(views, archive, 4, now)
    assert got == [
        MinuteBucket(T0 - MINUTE_MS, 0, 0),
        MinuteBucket(T0, 7, 70),
        MinuteBucket(T0 + MINUTE_MS, 2, 30),
        MinuteBucket(T0 + 2 * MINUTE_MS, 1, 5),
    ]
    assert history([], [], 1, now) == [MinuteBucket(minute_of(now), 0, 0)]
    with pytest.raises(ValueError):
        history(views, archive, 0, now)


def test_archive_cluster_stores_only_completed_minutes(tmp_path: Path) -> None:
    now = T0 + MINUTE_MS + 1_000
    views = [node("a", buckets=(MinuteBucket(T0, 1, 10), MinuteBucket(T0 + MINUTE_MS, 1, 10)))]
    with MetricsStore.in_dir(tmp_path) as store:
        archive_cluster(store, views, now)
        assert store.archived_minutes(0, now + MINUTE_MS) == [MinuteBucket(T0, 1, 10)]


# ------------------------------------------------------------------- service


async def test_run_metrics_samples_saves_archives_and_saves_on_exit(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    def clock() -> int:
        return T0 + int(trio.current_time() * 1000)

    rec = MetricsRecorder(clock)
    views = [node("a", buckets=(MinuteBucket(T0, 4, 40),))]
    with MetricsStore.in_dir(tmp_path) as store:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(run_metrics, rec, store, lambda: views, clock=clock))
            rec.record_request("a")
            await trio.sleep(61)
            assert len(rec.samples()) == 6
            assert store.load().counters.requests_served == 1
            assert store.archived_minutes(T0, T0 + MINUTE_MS) == [MinuteBucket(T0, 4, 40)]
            rec.record_error()
            nursery.cancel_scope.cancel()
        assert store.load().counters.errors == 1
