"""The metrics routes served in-process on loopback, over a small context whose registry is
a list of constructed views and whose archive is a real metrics database."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from registry_helpers import view

from api import routes_metrics
from api.app import INSTALLERS, create_app, serve_api
from api.limits import RequestLimits
from inclavate.local_swarm import free_port
from inclavate.metrics import MINUTE_MS, minute_of
from inclavate.metrics_store import MetricsStore
from p2p.records import Counters, MinuteBucket, now_ms
from p2p.registry import NodeView

MODEL = "llama3.2:1b"


class MetricsContext:
    """The slice of ``PeerContext`` these routes use, plus what ``create_app`` reads."""

    version = "test"
    peer_id = "test"
    admin_token: str | None = None

    def __init__(self, views: list[NodeView], archive: MetricsStore) -> None:
        self.limits = RequestLimits()
        self._views = views
        self._archive = archive

    def views(self) -> list[NodeView]:
        return list(self._views)

    def metrics_archive(self) -> MetricsStore:
        return self._archive


def node(name: str, start: int, end: int, state: str = "Ready", **fields) -> NodeView:
    return view(name, start, end, state, model_id=MODEL, n_layers=16, **fields)


@asynccontextmanager
async def serve(ctx: MetricsContext) -> AsyncIterator[str]:
    app = create_app(ctx)  # type: ignore[arg-type]  # a partial context, enough for these routes
    if routes_metrics.install not in INSTALLERS:  # until the app installs this module itself
        routes_metrics.install(app, ctx)  # type: ignore[arg-type]
    port = free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_api, app, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def get(url: str) -> httpx.Response:
    return await trio.to_thread.run_sync(lambda: httpx.get(url, timeout=10))


@pytest.fixture
def store(tmp_path: Path):
    with MetricsStore.in_dir(tmp_path) as store:
        yield store


@pytest.fixture
def views() -> list[NodeView]:
    return [
        node("a", 0, 8, throughput_tps=200.0, counters=Counters(800, 12, 0, 99.0), requests_by_model={MODEL: 12}),
        node("b", 8, 16, throughput_tps=100.0, counters=Counters(800, 0, 1, 24.0), requests_by_model={"other": 3}),
        node("c", 0, 16, "Dead", throughput_tps=900.0, counters=Counters(100, 1, 0, 1.0)),
    ]


async def test_rankings_shape_order_and_dead_nodes(views: list[NodeView], store: MetricsStore) -> None:
    async with serve(MetricsContext(views, store)) as url:
        reply = await get(url + "/nodes/rankings")
    assert reply.status_code == 200
    assert reply.json() == {
        "rankings": [
            {"node_id": "b", "model_id": MODEL, "score": 1.0, "rank": 1},  # 100 / 25 = 4
            {"node_id": "a", "model_id": MODEL, "score": 0.5, "rank": 2},  # 200 / 100 = 2
        ]
    }


async def test_rankings_weights_come_from_the_environment(
    views: list[NodeView], store: MetricsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPPAN_RANK_LATENCY_WEIGHT", "0")
    async with serve(MetricsContext(views, store)) as url:
        ranked = (await get(url + "/nodes/rankings")).json()["rankings"]
    assert [(r["node_id"], r["score"]) for r in ranked] == [("a", 1.0), ("b", 0.5)]


async def test_an_invalid_weight_is_logged_once_and_defaulted(
    views: list[NodeView], store: MetricsStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DPPAN_RANK_TPS_WEIGHT", "fast")
    monkeypatch.setenv("DPPAN_RANK_LATENCY_WEIGHT", "-1")
    with caplog.at_level(logging.WARNING, logger="api.routes_metrics"):
        async with serve(MetricsContext(views, store)) as url:
            first = (await get(url + "/nodes/rankings")).json()
            second = (await get(url + "/nodes/rankings")).json()
    assert first == second and [r["node_id"] for r in first["rankings"]] == ["b", "a"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "api.routes_metrics"]
    assert len(warnings) == 2
    assert "DPPAN_RANK_TPS_WEIGHT" in warnings[0] and "DPPAN_RANK_LATENCY_WEIGHT" in warnings[1]


async def test_summary_shape(views: list[NodeView], store: MetricsStore) -> None:
    async with serve(MetricsContext(views, store)) as url:
        reply = await get(url + "/metrics/summary")
    assert reply.status_code == 200
    # Tokens: 800 * 8/16 twice, plus the dead node's 100 on all 16 layers.
    assert reply.json() == {"total_nodes": 3, "ready_nodes": 2, "total_tokens": 900, "total_requests": 13,
                            "avg_latency_ms": 61.5}  # fmt: skip


async def test_model_metrics_shape_and_unknown_model(views: list[NodeView], store: MetricsStore) -> None:
    async with serve(MetricsContext(views, store)) as url:
        known = await get(url + f"/metrics/model/{MODEL}")
        asked_only = await get(url + "/metrics/model/other")
        unknown = await get(url + "/metrics/model/org/absent:7b")
    assert known.status_code == 200
    assert known.json() == {"model_id": MODEL, "nodes": 3, "requests": 12, "tokens": 900, "avg_latency_ms": 61.5}
    assert asked_only.json() == {"model_id": "other", "nodes": 0, "requests": 3, "tokens": 0, "avg_latency_ms": 0.0}
    assert unknown.status_code == 404
    assert set(unknown.json()) == {"error"} and "org/absent:7b" in unknown.json()["error"]


async def test_history_default_window_and_archive_merge(store: MetricsStore) -> None:
    now = now_ms()
    recent, departed = minute_of(now) - 2 * MINUTE_MS, minute_of(now) - 3 * MINUTE_MS
    views = [node("a", 0, 16, buckets=(MinuteBucket(recent, 2, 64),))]
    store.archive([MinuteBucket(departed, 5, 500), MinuteBucket(recent, 1, 100)], now)
    async with serve(MetricsContext(views, store)) as url:
        default = (await get(url + "/metrics/history")).json()
        short = await get(url + "/metrics/history?minutes=5")
    assert len(default["buckets"]) == 60
    assert short.status_code == 200
    buckets = short.json()["buckets"]
    assert len(buckets) == 5 and all(set(b) == {"ts_ms", "requests", "tokens"} for b in buckets)
    starts = [b["ts_ms"] for b in buckets]
    assert starts == sorted(starts) and all(b - a == MINUTE_MS for a, b in zip(starts, starts[1:]))
    by_minute = {b["ts_ms"]: (b["requests"], b["tokens"]) for b in buckets}
    assert by_minute[departed] == (5, 500) and by_minute[recent] == (2, 100)
    assert sum(b["requests"] for b in buckets) == 7


@pytest.mark.parametrize("minutes", ["0", "-3", "1441", "abc", "1.5", ""])
async def test_history_refuses_a_bad_window(minutes: str, store: MetricsStore) -> None:
    async with serve(MetricsContext([], store)) as url:
        reply = await get(url + f"/metrics/history?minutes={minutes}")
    assert reply.status_code == 400
    assert set(reply.json()) == {"error"} and "minutes" in reply.json()["error"]
