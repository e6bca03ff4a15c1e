"""Prometheus metrics: one registry per actor, one HTTP endpoint per process.

Every actor owns an ``ActorMetrics`` on its own ``CollectorRegistry`` (never the global default one),
so many actors in one process or one test never collide; every sample carries ``role`` and
``replica`` labels. What each actor exports:

    parkway_messages_total{type,outcome}     messages received, by type; outcome handled | error |
                                             refused | replayed (a cached reply sent again)
    parkway_errors_total{code}               errors by code: refusals and handlers' Error replies
    parkway_handlers_in_flight               deliveries being handled now

and by role:

    parkway_phase_seconds{phase}             participants: time spent in each checkpoint phase
                                             (preparing, prepared, committed, restored), on leaving it
    parkway_rollouts_in_flight               agents: attempts running
    parkway_policy_requests_in_flight        policy: model calls generating or holding their reply
    parkway_snapshot_pause_seconds           controller: admission-closed window of each snapshot
    parkway_snapshot_phase_seconds{step}     controller: duration of each save step
    parkway_snapshots_total{outcome}         controller: published | failed | skipped
    parkway_snapshot_age_seconds             controller: age of the newest published snapshot (NaN: none)
    parkway_snapshot_consecutive_failures    controller: snapshot attempts failed in a row
    parkway_snapshot_last_failure_timestamp_seconds  controller: when the last one failed (0: never)
    parkway_restores_total                   controller: restores done at start

A process serves the registries of all the actors it hosts, merged, plus its broker connection's
``parkway_broker_reconnects_total``, from one ``/metrics`` endpoint (``MetricsEndpoint``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import structlog
from parkway.actors.runtime.settings import SettingsError
from parkway.protocol.errors import ErrorCode
from parkway.protocol.phases import Phase
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from parkway.brokers.base import Broker

log = structlog.get_logger("parkway.metrics")

# From a millisecond to two minutes: snapshot pauses are milliseconds to seconds; a phase held while a
# slow rollout reaches its boundary can take far longer.
DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)

HANDLED, ERROR, REFUSED, REPLAYED = "handled", "error", "refused", "replayed"
OUTCOMES = (HANDLED, ERROR, REFUSED, REPLAYED)
# Why a reply was not sent: its reply_to is not a reply address (another actor's queue, say), or the
# transport failed every try (the delivery is left for redelivery).
REPLY_NOT_A_REPLY_ADDRESS, REPLY_TRANSPORT = "not_a_reply_address", "transport"
UNKNOWN_TYPE = "unknown"  # a refused message that could not be decoded has no type
TIMED_PHASES = tuple(p for p in Phase if p is not Phase.IDLE)
SNAPSHOT_OUTCOMES = ("published", "failed", "skipped")
LABELS = ("role", "replica")


class ActorMetrics:
    """One actor's metrics on its own registry. Updating one costs a dict lookup and a counter inc."""

    def __init__(self, role: str, replica: int) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"role": role, "replica": str(replica)}
        self._messages = self._metric(
            Counter, "parkway_messages", "Messages received, by message type and outcome", ("type", "outcome")
        )
        self._by_outcome: dict[str, dict[str, Any]] = {outcome: {} for outcome in OUTCOMES}
        errors = self._metric(
            Counter,
            "parkway_errors",
            "Errors by code: messages refused and Error replies of handlers",
            ("code",),
        )
        self._errors = {code: errors.labels(**self._labels, code=code.value) for code in ErrorCode}
        self._phases: dict[str, Any] | None = None
        self._snapshot_pause: Any = None
        self._snapshot_steps: Any = None  # the histogram; its children are made per step
        self._snapshots: dict[str, Any] = {}
        self._restores: Any = None
        self._gauges: dict[str, Any] = {}  # name -> the gauge's child, read when scraped
        self._replies_not_sent: Any = None

    def _metric(self, kind: type, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> Any:
        extra: dict[str, Any] = {"buckets": DURATION_BUCKETS} if kind is Histogram else {}
        return kind(name, documentation, (*LABELS, *labelnames), registry=self.registry, **extra)

    def _child(self, metric: Any, **labels: str) -> Any:
        return metric.labels(**self._labels, **labels)

    # -- every actor -----------------------------------------------------------------------------
    def message(self, kind: str, outcome: str) -> None:
        """One message of type ``kind`` received, with ``outcome`` (``HANDLED``, ``ERROR``, ...)."""
        children = self._by_outcome[outcome]
        child = children.get(kind)
        if child is None:
            child = children[kind] = self._child(self._messages, type=kind, outcome=outcome)
        child.inc()

    def error(self, code: ErrorCode) -> None:
        self._errors[code].inc()

    def reply_not_sent(self, reason: str) -> None:
        """A reply that did not go out: ``REPLY_NOT_A_REPLY_ADDRESS`` or ``REPLY_TRANSPORT``."""
        if self._replies_not_sent is None:
            self._replies_not_sent = self._metric(
                Counter, "parkway_replies_not_sent", "Replies not sent, by reason", ("reason",)
            )
        self._child(self._replies_not_sent, reason=reason).inc()

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge read when scraped (``read`` runs in the HTTP server's thread: keep it a plain read).
        Registering a name again rebinds it (a controller that runs its workload again)."""
        child = self._gauges.get(name)
        if child is None:
            child = self._gauges[name] = self._child(self._metric(Gauge, name, documentation))
        child.set_function(read)

    def counter(self, name: str, documentation: str) -> Any:
        """A counter of this actor's (``inc()`` it)."""
        return self._child(self._metric(Counter, name, documentation))

    # -- participants ----------------------------------------------------------------------------
    def phase_left(self, phase: str, seconds: float) -> None:
        """A participant left ``phase`` after ``seconds`` in it (idle is not timed)."""
        child = self.timed_phases().get(phase)
        if child is not None:
            child.observe(seconds)

    def timed_phases(self) -> dict[str, Any]:
        """The phase histogram's children by phase, registered on first use (a participant registers it
        when made, so it is scraped, at zero, before any checkpoint)."""
        if self._phases is None:
            histogram = self._metric(
                Histogram,
                "parkway_phase_seconds",
                "Time a participant spent in a checkpoint phase, observed when it leaves the phase",
                ("phase",),
            )
            self._phases = {p.value: self._child(histogram, phase=p.value) for p in TIMED_PHASES}
        return self._phases

    # -- the controller --------------------------------------------------------------------------
    def snapshot_metrics(self) -> None:
        """Register the controller's snapshot metrics (idempotent)."""
        if self._snapshot_pause is not None:
            return
        self._snapshot_pause = self._child(
            self._metric(
                Histogram,
                "parkway_snapshot_pause_seconds",
                "Admission-closed window of each snapshot, measured with the gate's own clock",
            )
        )
        self._snapshot_steps = self._metric(
            Histogram, "parkway_snapshot_phase_seconds", "Duration of each snapshot save step", ("step",)
        )
        snapshots = self._metric(Counter, "parkway_snapshots", "Snapshot attempts, by outcome", ("outcome",))
        self._snapshots = {o: self._child(snapshots, outcome=o) for o in SNAPSHOT_OUTCOMES}
        self._restores = self._child(self._metric(Counter, "parkway_restores", "Restores at start"))

    def snapshot_pause(self, seconds: float) -> None:
        self.snapshot_metrics()
        self._snapshot_pause.observe(seconds)

    def snapshot_step(self, step: str, seconds: float) -> None:
        self.snapshot_metrics()
        self._child(self._snapshot_steps, step=step).observe(seconds)

    def snapshot(self, outcome: str) -> None:
        self.snapshot_metrics()
        self._snapshots[outcome].inc()

    def restored(self) -> None:
        self.snapshot_metrics()
        self._restores.inc()


class BrokerCollector(Collector):
    """The broker connection's reconnects (counted by the transport's reconnect callback), the dead letters
    its bounded dead-letter queue refused, and its retried replies."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "parkway_broker_reconnects",
            "Times the broker connection was re-established after it was lost",
            value=self.broker.reconnects,
        )
        yield CounterMetricFamily(
            "parkway_dead_letters_dropped",
            "Dead letters the run's full (bounded) dead-letter queue refused, so dropped",
            value=self.broker.dead_letters_dropped,
        )
        yield CounterMetricFamily(
            "parkway_reply_retries",
            "Reply publishes that failed on the transport and were tried again",
            value=self.broker.reply_retries,
        )


class MergedCollector(Collector):
    """Several registries as one: families of the same name are merged, so each name is described once."""

    def __init__(self, sources: Iterable[CollectorRegistry | Collector]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for source in self.sources:
            for family in source.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                into.samples.extend(family.samples)
        yield from merged.values()


def process_registry(actors: Iterable[Any], broker: Broker | None = None) -> CollectorRegistry:
    """One registry holding every actor's metrics (and the broker's) of this process."""
    sources: list[CollectorRegistry | Collector] = [actor.metrics.registry for actor in actors]
    if broker is not None:
        sources.append(BrokerCollector(broker))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedCollector(sources))
    return registry


class MetricsEndpoint:
    """``/metrics`` over HTTP for a process, served from a thread; ``stop`` releases the port."""

    def __init__(self, registry: CollectorRegistry, port: int, *, addr: str = "0.0.0.0") -> None:
        self.registry = registry
        self.port = port
        self.addr = addr
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsEndpoint:
        self._server, self._thread = start_http_server(self.port, addr=self.addr, registry=self.registry)
        self.port = self._server.server_port  # the real one when asked for port 0
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MetricsEndpoint:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@contextlib.contextmanager
def metrics_endpoint(
    broker: Broker | None, actors: Iterable[Any], port: int
) -> Iterator[MetricsEndpoint | None]:
    """Serve ``actors``' metrics (and ``broker``'s) on ``port`` while inside; nothing when ``port`` is
    0. The port is released on the way out."""
    if not port:
        yield None
        return
    actors = list(actors)
    endpoint = MetricsEndpoint(process_registry(actors, broker), port)
    try:
        endpoint.start()
    except OSError as exc:
        raise SettingsError(f"cannot serve metrics on port {port}: {exc}") from None
    log.info("metrics_serving", port=endpoint.port, actors=len(actors))
    try:
        yield endpoint
    finally:
        endpoint.stop()
