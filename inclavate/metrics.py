"""Metrics: what a peer measures about itself, and what any peer derives from the records.

Two halves over the same record fields (``p2p.records``):

* :class:`MetricsRecorder` lives inside a peer. The peer feeds it events (a chat request it
  serves as entry, a batch its stage ran, an error) and copies its readings into its own
  record at every heartbeat; ``inclavate.metrics_store`` keeps it across restarts.
* The aggregations (:func:`rankings`, :func:`summary`, :func:`model_metrics`,
  :func:`cluster_minutes`, :func:`history`) are pure functions of ``list[NodeView]``. They
  read only gossiped records, so every peer that has seen the same records gives the same
  answer, and a test needs no network.

Definitions the spec leaves open, and why:

* **Step latency** is the mean wall time of one stage step (one batch). Prefill is one step
  per request against hundreds of decode steps, so the mean is the decode-step latency to
  within a few percent without telling the two apart.
* **Throughput** (``throughput_tps``) is tokens per second *while the stage is busy*: how
  fast it runs, not how loaded it is (the samples' ``tps`` measure load). An idle node keeps
  its last measured value instead of dropping to 0, so rankings do not punish idleness.
* **A slice's figures.** What the stage measured (tokens, step latency, throughput, the tokens of
  the minute buckets) belongs to the model and layers it ran (:func:`slice_key`): once the peer
  serves another slice (restarted with another ``--model`` or range, or moved while running),
  they start again from zero (:meth:`MetricsRecorder.measuring`). Otherwise they were claimed
  for the new slice: a step time of 30 layers as one of 10, tokens weighted by the new range.
  The entry's counts (requests, per model) and the error count are no slice's: they stay.
* **Cluster tokens** are full-model tokens: a stage holding k of n layers counts k/n of each
  token it ran. Every stage of a chain runs every token, so a plain sum would count a token
  once per stage and a model cut in three would look three times as busy as the same model
  on one machine; with the weighting, replicas and any cut add up to the tokens the model
  processed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from inclavate.types import LayerRange
from p2p.records import Counters, MetricSample, MinuteBucket, NodeRecord, now_ms
from p2p.registry import NodeView

Clock = Callable[[], int]
"""Wall-clock epoch milliseconds (``p2p.records.now_ms``); injected so tests drive time."""

MINUTE_MS = 60_000
SAMPLE_INTERVAL_MS = 10_000
SAMPLE_RING = 60
"""Samples kept and gossiped: ten minutes at one per 10 s."""
BUCKET_MINUTES = 60
"""Minutes of a peer's own traffic kept in its record (the current one included)."""
RECENT_WINDOWS = 30
"""Sample windows *with traffic* behind latency and throughput: five busy minutes, long
enough to smooth one slow prefill, short enough to follow a machine that slows down."""
HISTORY_MAX_MINUTES = 1440
"""Longest history served, and how long the cluster archive keeps minutes (a day)."""


def minute_of(ts_ms: int) -> int:
    """Start of the minute ``ts_ms`` falls in."""
    return ts_ms - ts_ms % MINUTE_MS


def slice_key(model_id: str, layers: LayerRange) -> str:
    """What a stage's figures were measured on, as stored beside them."""
    return f"{model_id}@{layers.start}-{layers.end}"


@dataclass(frozen=True)
class RecorderState:
    """What of a recorder survives a restart (samples do not: they describe the last
    ten minutes of a process that is gone)."""

    counters: Counters = Counters()
    throughput_tps: float = 0.0
    requests_by_model: Mapping[str, int] = field(default_factory=dict)
    buckets: tuple[MinuteBucket, ...] = ()
    measured_on: str = ""
    """The :func:`slice_key` the stage's figures belong to ("": unknown, trusted for none)."""


@dataclass
class _Window:
    """Stage work accumulated between two samples."""

    tokens: int = 0
    steps: int = 0
    step_ms: float = 0.0


class MetricsRecorder:
    """A peer's running account of its own traffic.

    Not thread-safe: call it from the trio thread (engine calls run in worker threads, but
    the stage records their results back on the trio side)."""

    def __init__(self, clock: Clock = now_ms, state: RecorderState | None = None) -> None:
        state = state or RecorderState()
        self._clock = clock
        self._tokens = state.counters.tokens_total
        self._requests = state.counters.requests_served
        self._errors = state.counters.errors
        # Restored readings stand until this process has measured traffic of its own.
        self._restored_latency_ms = state.counters.avg_latency_ms
        self._restored_tps = state.throughput_tps
        self._by_model = dict(state.requests_by_model)
        self._minutes = {b.ts_ms: b for b in state.buckets}
        self._measured_on = state.measured_on
        self._samples: deque[MetricSample] = deque(maxlen=SAMPLE_RING)
        self._window = _Window()
        self._recent: deque[_Window] = deque(maxlen=RECENT_WINDOWS)
        self._last_sample_ms = clock()
        self.revision = 0
        """Bumped by every change worth persisting: a saver compares it to what it wrote."""

    # ----------------------------------------------------------------- events

    def record_request(self, model_id: str) -> None:
        """This peer's API started serving a chat request as entry peer."""
        self._requests += 1
        self._by_model[model_id] = self._by_model.get(model_id, 0) + 1
        self._add_to_minute(requests=1, tokens=0)

    def record_tokens(self, n: int, step_ms: float) -> None:
        """This peer's stage ran one batch of ``n`` tokens in ``step_ms``."""
        if n < 0 or step_ms < 0:
            raise ValueError(f"a batch cannot have {n} tokens or last {step_ms} ms")
        self._tokens += n
        self._window.tokens += n
        self._window.steps += 1
        self._window.step_ms += step_ms
        self._add_to_minute(requests=0, tokens=n)

    def record_error(self) -> None:
        self._errors += 1
        self.revision += 1

    def measuring(self, slice_: str) -> None:
        """The stage's figures are for ``slice_`` (a :func:`slice_key`) from now on; those
        measured on another are dropped, restored or this run's. Called before every
        reading is published, so a record never carries another slice's figures."""
        if slice_ == self._measured_on:
            return
        self._measured_on = slice_
        self._tokens = 0
        self._restored_latency_ms = self._restored_tps = 0.0
        self._window = _Window()
        self._recent.clear()
        self._minutes = {m: MinuteBucket(m, b.requests, 0) for m, b in self._minutes.items() if b.requests}
        self.revision += 1

    def sample(self, now_ms: int) -> MetricSample:
        """Close the current window (called every 10 s) and append its sample to the ring."""
        elapsed_ms = now_ms - self._last_sample_ms
        if elapsed_ms <= 0:  # the wall clock stepped back: assume the nominal interval
            elapsed_ms = SAMPLE_INTERVAL_MS
        window = self._window
        latency = window.step_ms / window.steps if window.steps else 0.0
        sample = MetricSample(round(window.tokens * 1000 / elapsed_ms, 3), round(latency, 3), now_ms)
        self._samples.append(sample)
        if window.steps:
            self._recent.append(window)
            self.revision += 1  # latency and throughput moved
        self._window = _Window()
        self._last_sample_ms = now_ms
        return sample

    # --------------------------------------------------------------- readings

    def counters(self) -> Counters:
        return Counters(self._tokens, self._requests, self._errors, round(self._latency_ms(), 3))

    def samples(self) -> tuple[MetricSample, ...]:
        return tuple(self._samples)

    def buckets(self, now_ms: int) -> tuple[MinuteBucket, ...]:
        """Minutes with traffic among the last :data:`BUCKET_MINUTES`, oldest first."""
        first = minute_of(now_ms) - (BUCKET_MINUTES - 1) * MINUTE_MS
        return tuple(self._minutes[m] for m in sorted(self._minutes) if m >= first)

    def requests_by_model(self) -> dict[str, int]:
        return dict(self._by_model)

    def throughput_tps(self) -> float:
        busy = self._busy()
        if busy.step_ms <= 0:
            return self._restored_tps
        return round(busy.tokens * 1000 / busy.step_ms, 3)

    def snapshot(self) -> RecorderState:
        return RecorderState(self.counters(), self.throughput_tps(), self.requests_by_model(),
                             self.buckets(self._clock()), self._measured_on)  # fmt: skip

    # ---------------------------------------------------------------- private

    def _busy(self) -> _Window:
        """The recent windows with traffic plus the open one, summed."""
        total = _Window()
        for w in (*self._recent, self._window):
            total.tokens += w.tokens
            total.steps += w.steps
            total.step_ms += w.step_ms
        return total

    def _latency_ms(self) -> float:
        busy = self._busy()
        return busy.step_ms / busy.steps if busy.steps else self._restored_latency_ms

    def _add_to_minute(self, *, requests: int, tokens: int) -> None:
        now = self._clock()
        minute = minute_of(now)
        held = self._minutes.get(minute)
        if held is None:  # a new minute: drop those that fell out of the window (once a minute, not every batch)
            held = MinuteBucket(minute, 0, 0)
            first = minute - (BUCKET_MINUTES - 1) * MINUTE_MS
            for old in [m for m in self._minutes if m < first]:
                del self._minutes[old]
        self._minutes[minute] = MinuteBucket(minute, held.requests + requests, held.tokens + tokens)
        self.revision += 1


# ------------------------------------------------------------------ aggregations


@dataclass(frozen=True)
class Ranking:
    node_id: str
    model_id: str
    score: float
    rank: int


@dataclass(frozen=True)
class Summary:
    total_nodes: int
    ready_nodes: int
    total_tokens: int
    total_requests: int
    avg_latency_ms: float


@dataclass(frozen=True)
class ModelMetrics:
    model_id: str
    nodes: int
    requests: int
    tokens: int
    avg_latency_ms: float


class MinuteArchive(Protocol):
    """Cluster minute totals archived on this peer (``MetricsStore`` implements it)."""

    def archived_minutes(self, since_ms: int, until_ms: int) -> list[MinuteBucket]: ...


def rankings(views: Iterable[NodeView], tps_weight: float = 1.0, latency_weight: float = 1.0) -> list[Ranking]:
    """Every node that is not Dead, best first; informational, never a reason to skip one.

    merit = tps ** tps_weight / (1 + latency_ms) ** latency_weight, score = merit / best.
    The weights are exponents, not factors: a factor on the numerator would cancel in the
    normalisation and change nothing, while an exponent spreads (above 1) or flattens
    (below 1, down to "ignore" at 0) that term's influence, as the spec's knobs promise.
    ``1 +`` keeps an unmeasured latency of 0 finite. The arithmetic runs in logs so large
    weights cannot overflow. Ties (equal rounded scores) go to the smaller node id.
    """
    alive = [v.record for v in views if v.state != "Dead"]
    merits = [_log_merit(r, tps_weight, latency_weight) for r in alive]
    best = max(merits, default=-math.inf)
    scores = [0.0 if best == -math.inf else round(math.exp(m - best), 4) for m in merits]
    ordered = sorted(zip(alive, scores, strict=True), key=lambda pair: (-pair[1], pair[0].node_id))
    return [Ranking(r.node_id, r.model_id, score, i) for i, (r, score) in enumerate(ordered, start=1)]


def _log_merit(record: NodeRecord, tps_weight: float, latency_weight: float) -> float:
    tps, latency = record.throughput_tps, max(record.counters.avg_latency_ms, 0.0)
    if tps_weight == 0:
        tps_term = 0.0  # throughput ignored (and 0 ** 0 would be a NaN in logs)
    else:
        tps_term = tps_weight * math.log(tps) if tps > 0 else -math.inf
    return tps_term - latency_weight * math.log1p(latency)


def summary(views: Iterable[NodeView]) -> Summary:
    """Every node the registry holds (as ``GET /nodes`` lists them, Dead ones until they
    are forgotten); tokens and requests are cumulative, a departed node's included."""
    views = list(views)
    return Summary(
        total_nodes=len(views),
        ready_nodes=sum(v.state == "Ready" and not v.record.idle for v in views),  # an idle node serves nothing
        total_tokens=round(sum(_model_tokens(v.record, v.record.counters.tokens_total) for v in views)),
        total_requests=sum(v.record.counters.requests_served for v in views),
        avg_latency_ms=_mean_latency(views),
    )


def model_metrics(views: Iterable[NodeView], model_id: str) -> ModelMetrics | None:
    """One model's share of :func:`summary`; ``None`` for a model with neither a node nor a
    request. Requests are counted at the entry peers, which may serve any model."""
    views = list(views)
    serving = [v for v in views if v.record.model_id == model_id]
    asked = [v.record.requests_by_model[model_id] for v in views if model_id in v.record.requests_by_model]
    if not serving and not asked:
        return None
    return ModelMetrics(
        model_id=model_id,
        nodes=len(serving),
        requests=sum(asked),
        tokens=round(sum(_model_tokens(v.record, v.record.counters.tokens_total) for v in serving)),
        avg_latency_ms=_mean_latency(serving),
    )


def cluster_minutes(views: Iterable[NodeView], since_ms: int, until_ms: int) -> list[MinuteBucket]:
    """Cluster totals per minute in ``[since_ms, until_ms)`` from the records' buckets
    (all states: a Dead node's past minutes are still real), minutes with traffic only."""
    requests: dict[int, int] = {}
    tokens: dict[int, float] = {}
    for view in views:
        for b in view.record.buckets:
            if since_ms <= b.ts_ms < until_ms:
                requests[b.ts_ms] = requests.get(b.ts_ms, 0) + b.requests
                tokens[b.ts_ms] = tokens.get(b.ts_ms, 0.0) + _model_tokens(view.record, b.tokens)
    return [MinuteBucket(m, requests[m], round(tokens[m])) for m in sorted(requests)]


def history(
    views: Iterable[NodeView], archive: Iterable[MinuteBucket], minutes: int, now_ms: int
) -> list[MinuteBucket]:
    """Every minute of the last ``minutes`` (the current, partial one last), zeros included.

    Each minute is the larger of the live total and the archived one, field by field: a
    minute's total only grows while its peers live, so the archive holds the most that was
    ever seen, and a peer that left (its buckets gone from the live sum) stays counted."""
    if minutes < 1:
        raise ValueError(f"history needs at least one minute, not {minutes}")
    last = minute_of(now_ms)
    first = last - (minutes - 1) * MINUTE_MS
    live = {b.ts_ms: b for b in cluster_minutes(views, first, last + MINUTE_MS)}
    kept = {b.ts_ms: b for b in archive}
    empty = MinuteBucket(0, 0, 0)
    out = []
    for minute in range(first, last + MINUTE_MS, MINUTE_MS):
        a, b = live.get(minute, empty), kept.get(minute, empty)
        out.append(MinuteBucket(minute, max(a.requests, b.requests), max(a.tokens, b.tokens)))
    return out


def _model_tokens(record: NodeRecord, stage_tokens: float) -> float:
    """Stage tokens as full-model tokens (see the module docstring)."""
    return stage_tokens * (record.end_layer - record.start_layer) / record.n_layers


def _mean_latency(views: list[NodeView]) -> float:
    """Mean step latency of the Ready nodes that have measured one (per node, unweighted:
    the typical stage's step time, not dominated by the busiest node)."""
    latencies = (v.record.counters.avg_latency_ms for v in views if v.state == "Ready")
    measured = [ms for ms in latencies if ms > 0]
    return round(sum(measured) / len(measured), 2) if measured else 0.0
