"""The metrics database, ``<data_dir>/metrics.db``, and the loop that keeps it current.

It holds what must outlive the process: this peer's cumulative counters, per-model request
counts and its own minute buckets (so a restarted peer gossips the same totals it had), and
the *archive* of cluster-wide minute totals (so history still counts peers that have left).
Tables, created on first use (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)::

    totals           id = 1 (one row): tokens_total, requests_served, errors,
                     avg_latency_ms, throughput_tps, measured_on (the model and layers
                     the stage's figures were measured on: a peer serving another
                     slice drops them, ``MetricsRecorder.measuring``)
    model_requests   model_id (pk), requests        cumulative, entry requests
    own_minutes      ts_ms (pk), requests, tokens   this peer's last 60 minutes
    cluster_minutes  ts_ms (pk), requests, tokens   the archive, last 24 h, max-merged

Writes are synchronous on the trio thread: each is a few dozen rows in one transaction, in
WAL mode with ``synchronous=NORMAL`` (durable across a process crash, which is the failure
that matters here; a power cut may lose the last transaction). A worker thread would buy
nothing at that size and sqlite3 connections are bound to their thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import trio
from sqlite_utils import Database

from inclavate.sqlite_errors import sqlite_errors_as
from inclavate.errors import InclavateError
from inclavate.metrics import (
    HISTORY_MAX_MINUTES,
    MINUTE_MS,
    SAMPLE_INTERVAL_MS,
    MetricsRecorder,
    RecorderState,
    cluster_minutes,
    minute_of,
)
from p2p.records import Counters, MinuteBucket, now_ms
from p2p.registry import NodeView
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)

FILENAME = "metrics.db"
SCHEMA_VERSION = 2
"""2: ``totals.measured_on``. A version-1 database's stage figures belong to no known slice,
so the first run after the upgrade drops them (its counts of requests stay)."""
SAVE_INTERVAL_MS = SAMPLE_INTERVAL_MS // 2
"""At most this much recorded traffic is lost to a crash."""
LIVE_MINUTES = 60
"""How far back each archive pass re-reads the records (all the buckets they carry)."""


class MetricsStoreError(InclavateError):
    """The metrics database cannot be opened, read or written."""


def _mapped() -> AbstractContextManager[None]:
    return sqlite_errors_as(MetricsStoreError, "metrics database")


class MetricsStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        with _mapped():
            self._db = Database(path)
            try:
                self._migrate()
            except BaseException:
                self._db.close()
                raise

    @classmethod
    def in_dir(cls, data_dir: Path) -> MetricsStore:
        return cls(data_dir / FILENAME)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> MetricsStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise MetricsStoreError(f"{self.path} has schema {version}, newer than this version's {SCHEMA_VERSION}")
        self._db.enable_wal()
        self._db.execute("PRAGMA synchronous=NORMAL")
        minute = {"ts_ms": int, "requests": int, "tokens": int}
        with self._db.atomic():
            self._db.table("totals").create(
                {"id": int, "tokens_total": int, "requests_served": int, "errors": int,
                 "avg_latency_ms": float, "throughput_tps": float, "measured_on": str},
                pk="id", if_not_exists=True,
            )  # fmt: skip
            if "measured_on" not in self._db.table("totals").columns_dict:  # version 1
                self._db.table("totals").add_column("measured_on", str, not_null_default="")
            self._db.table("model_requests").create(
                {"model_id": str, "requests": int}, pk="model_id", if_not_exists=True
            )
            self._db.table("own_minutes").create(minute, pk="ts_ms", if_not_exists=True)
            self._db.table("cluster_minutes").create(minute, pk="ts_ms", if_not_exists=True)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # -------------------------------------------------------- this peer's state

    def load(self) -> RecorderState:
        """What :meth:`save` last wrote (an empty state on a new database)."""
        with _mapped():
            totals = next(self._db.table("totals").rows_where("id = 1"), None)
            by_model = {r["model_id"]: r["requests"] for r in self._db.table("model_requests").rows}
            minutes = tuple(_bucket(r) for r in self._db.table("own_minutes").rows_where(order_by="ts_ms"))
        if totals is None:
            return RecorderState(requests_by_model=by_model, buckets=minutes)
        counters = Counters(
            totals["tokens_total"], totals["requests_served"], totals["errors"], totals["avg_latency_ms"]
        )
        return RecorderState(counters, totals["throughput_tps"], by_model, minutes, totals["measured_on"] or "")

    def save(self, state: RecorderState) -> None:
        """Replace the stored state with ``state``, all or nothing."""
        c = state.counters
        with _mapped(), self._db.atomic():
            self._db.table("totals").upsert(
                {"id": 1, "tokens_total": c.tokens_total, "requests_served": c.requests_served, "errors": c.errors,
                 "avg_latency_ms": c.avg_latency_ms, "throughput_tps": state.throughput_tps,
                 "measured_on": state.measured_on},
                pk="id",
            )  # fmt: skip
            models = [{"model_id": m, "requests": n} for m, n in state.requests_by_model.items()]
            self._db.table("model_requests").upsert_all(models, pk="model_id")
            # The recorder's buckets are the whole truth for its window: replace, do not merge.
            self._db.execute("DELETE FROM own_minutes")
            self._db.table("own_minutes").insert_all([_row(b) for b in state.buckets], pk="ts_ms")

    # ----------------------------------------------------------------- archive

    def archive(self, minutes: Iterable[MinuteBucket], now_ms: int) -> None:
        """Merge cluster minute totals, keeping the larger value of each field, and forget
        minutes older than :data:`HISTORY_MAX_MINUTES`."""
        rows = [(b.ts_ms, b.requests, b.tokens) for b in minutes]
        horizon = minute_of(now_ms) - (HISTORY_MAX_MINUTES - 1) * MINUTE_MS  # the longest history's first minute
        with _mapped(), self._db.atomic():
            # Raw SQL: sqlite-utils' upsert overwrites, and the merge rule is max.
            self._db.conn.executemany(
                "INSERT INTO cluster_minutes (ts_ms, requests, tokens) VALUES (?, ?, ?) "
                "ON CONFLICT (ts_ms) DO UPDATE SET requests = max(requests, excluded.requests), "
                "tokens = max(tokens, excluded.tokens)",
                rows,
            )
            self._db.execute("DELETE FROM cluster_minutes WHERE ts_ms < ?", [horizon])

    def archived_minutes(self, since_ms: int, until_ms: int) -> list[MinuteBucket]:
        """Archived minutes in ``[since_ms, until_ms)``, oldest first (implements
        ``inclavate.metrics.MinuteArchive``)."""
        with _mapped():
            rows = self._db.table("cluster_minutes").rows_where(
                "ts_ms >= ? AND ts_ms < ?", [since_ms, until_ms], order_by="ts_ms"
            )
            return [_bucket(r) for r in rows]


def _row(b: MinuteBucket) -> dict[str, int]:
    return {"ts_ms": b.ts_ms, "requests": b.requests, "tokens": b.tokens}


def _bucket(row: dict[str, int]) -> MinuteBucket:
    return MinuteBucket(row["ts_ms"], row["requests"], row["tokens"])


def archive_cluster(store: MetricsStore, views: Iterable[NodeView], now_ms: int) -> None:
    """Archive the cluster totals of every completed minute the records still carry.

    Called once a minute. Each minute is re-archived on every pass while records hold it;
    the max-merge makes that harmless, and it catches the last seconds of a minute that
    gossip delivered after the pass that first saw it."""
    current = minute_of(now_ms)
    store.archive(cluster_minutes(views, current - LIVE_MINUTES * MINUTE_MS, current), now_ms)


async def run_metrics(
    recorder: MetricsRecorder,
    store: MetricsStore,
    views: Callable[[], list[NodeView]],
    *,
    clock: Callable[[], int] = now_ms,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The peer's metrics service: a sample every 10 s, a save every 5 s when anything
    changed, an archive pass at each new minute, and a last save on the way out.

    A database failure is logged and retried next tick: metrics never stop a peer."""
    saved, archived_minute, tick = -1, None, 0
    task_status.started()
    try:
        while True:
            await sleep_to_tick(SAVE_INTERVAL_MS / 1000)
            tick += 1
            now = clock()
            if tick % (SAMPLE_INTERVAL_MS // SAVE_INTERVAL_MS) == 0:
                recorder.sample(now)
            try:
                if minute_of(now) != archived_minute:
                    archive_cluster(store, views(), now)
                    archived_minute = minute_of(now)
                if recorder.revision != saved:
                    store.save(recorder.snapshot())
                    saved = recorder.revision
            except MetricsStoreError as exc:
                log.warning("%s", exc)
            except Exception:  # gossiped numbers feed this loop: a bug costs one tick, not the peer
                log.exception("metrics pass failed; retrying next tick")
    finally:
        if recorder.revision != saved:
            try:
                store.save(recorder.snapshot())
            except MetricsStoreError as exc:
                log.warning("final save failed: %s", exc)
