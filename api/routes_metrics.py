"""Cluster metrics endpoints: ``/nodes/rankings`` and ``/metrics/*``.

Thin on purpose: each handler parses its query, calls a pure aggregation of
``inclavate.metrics`` over the gossiped records, and returns its dataclass as JSON, so
every peer answers the same up to gossip delay. Only ``/metrics/history`` reads local state
(the archive of minutes from peers that have since left), through
``ctx.metrics_archive()``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from quart import jsonify, request
from quart_trio import QuartTrio

from api.context import PeerContext
from api.errors import BadRequest, NotFound
from inclavate.metrics import HISTORY_MAX_MINUTES, MINUTE_MS, history, minute_of, model_metrics, rankings, summary
from p2p.records import now_ms

log = logging.getLogger(__name__)

TPS_WEIGHT_ENV = "DPPAN_RANK_TPS_WEIGHT"
LATENCY_WEIGHT_ENV = "DPPAN_RANK_LATENCY_WEIGHT"
DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 100.0
"""Beyond this an exponent only says "this term alone decides"; a larger value is a typo."""
DEFAULT_HISTORY_MINUTES = 60


@dataclass(frozen=True)
class RankWeights:
    tps: float = DEFAULT_WEIGHT
    latency: float = DEFAULT_WEIGHT

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RankWeights:
        """Read once, when the app is built: an invalid value is logged once and replaced
        by the default, since a typo in a tuning knob should not stop a peer."""
        return cls(_weight(env, TPS_WEIGHT_ENV), _weight(env, LATENCY_WEIGHT_ENV))


def _weight(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return DEFAULT_WEIGHT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= MAX_WEIGHT:  # NaN fails this too
        log.warning("%s=%r is not a number in [0, %g]; using %g", name, raw, MAX_WEIGHT, DEFAULT_WEIGHT)
        return DEFAULT_WEIGHT
    return value


def history_minutes(raw: str | None) -> int:
    """The ``minutes`` query parameter: a whole number in [1, HISTORY_MAX_MINUTES]."""
    if raw is None:
        return DEFAULT_HISTORY_MINUTES
    try:
        minutes = int(raw)
    except ValueError:
        minutes = 0
    if not 1 <= minutes <= HISTORY_MAX_MINUTES:
        raise BadRequest(f"minutes must be a whole number from 1 to {HISTORY_MAX_MINUTES}, not {raw!r}")
    return minutes


def install(app: QuartTrio, ctx: PeerContext) -> None:
    weights = RankWeights.from_env(os.environ)

    @app.get("/nodes/rankings")
    async def node_rankings():  # type: ignore[no-untyped-def]
        """Nodes ranked by a combined score of throughput and latency (informational)."""
        ranked = rankings(ctx.views(), weights.tps, weights.latency)
        return jsonify(rankings=[dataclasses.asdict(r) for r in ranked])

    @app.get("/metrics/summary")
    async def metrics_summary():  # type: ignore[no-untyped-def]
        """Cluster-wide totals: nodes, tokens, requests and mean step latency."""
        return jsonify(dataclasses.asdict(summary(ctx.views())))

    @app.get("/metrics/model/<path:model_id>")
    async def metrics_model(model_id: str):  # type: ignore[no-untyped-def]
        """One model's nodes, requests, tokens and mean step latency."""
        found = model_metrics(ctx.views(), model_id)
        if found is None:
            raise NotFound(f"no node serves model {model_id!r} and no request asked for it")
        return jsonify(dataclasses.asdict(found))

    @app.get("/metrics/history")
    async def metrics_history():  # type: ignore[no-untyped-def]
        """Cluster requests and tokens per minute over the last ``minutes`` (default 60)."""
        minutes = history_minutes(request.args.get("minutes"))
        now = now_ms()
        since = minute_of(now) - (minutes - 1) * MINUTE_MS
        archived = ctx.metrics_archive().archived_minutes(since, now)
        buckets = history(ctx.views(), archived, minutes, now)
        return jsonify(buckets=[dataclasses.asdict(b) for b in buckets])
