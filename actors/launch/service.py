"""Running actors as a long-lived service: signals, the log sink, graceful stop.

SIGTERM or SIGINT: every actor finishes the handler in progress, leaves the rest unacked for
redelivery, and the process exits 0. With a metrics port, the process serves every actor's Prometheus
metrics (and its broker connection's) from one ``/metrics`` endpoint until it stops.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import structlog
from parkway.actors.launch.roles import ROLES
from parkway.actors.launch.workload import role_options
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime import tracing
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.faults import FaultPoints
from parkway.actors.runtime.logs import BrokerLogSink, attach_sink, detach_sink
from parkway.actors.runtime.metrics import metrics_endpoint
from parkway.actors.runtime.participant import Participant
from parkway.actors.runtime.settings import RunSettings
from parkway.brokers.base import Broker
from parkway.protocol.ids import Role
from parkway.protocol.layout import ACTOR_STATE_DIR, SNAPSHOTS_DIR

log = structlog.get_logger("parkway.service")


def build_actor(
    role: str,
    replica: int,
    broker: Broker,
    settings: RunSettings,
    *,
    durable: bool,
    config: RunConfig | None = None,
) -> Actor:
    """One actor of ``role``; ``durable`` gives it a state dir (reply journal) under the state root."""
    cls = ROLES[Role(role)]
    state_dir = (
        settings.state_root / ACTOR_STATE_DIR / settings.run / role / str(replica) if durable else None
    )
    options = role_options(role, config)  # each role's own keywords, so typed as Any
    if issubclass(cls, Participant):
        options["snapshot_root"] = Path(settings.state_root) / SNAPSHOTS_DIR
    return cls(
        broker,
        keyring=settings.keyring,
        replica=replica,
        state_dir=state_dir,
        faults=FaultPoints(),
        **options,
    )


def lower_cpu_priority(increment: int) -> int:
    """Lower this process's CPU priority by ``increment`` (``parkway actor --nice``, ``PARKWAY_NICE``);
    the niceness it has now. For a role off a snapshot's window (policy, tool servers, TQ): on a host
    they share, the window's processes (controller, agents, the broker) get the cores first, and each
    of the window's hops waits less to be scheduled (docs/operations.md)."""
    niceness = os.nice(increment)  # (0 reads it)
    if increment:
        log.info("cpu_priority_lowered", by=increment, niceness=niceness)
    return niceness


def service_name(actors: list[Actor]) -> str:
    """OpenTelemetry's ``service.name`` of a process (``OTEL_SERVICE_NAME`` overrides it)."""
    roles = sorted({actor.role for actor in actors})
    return f"parkway-{roles[0]}" if len(roles) == 1 else "parkway"


async def serve(
    broker: Broker,
    actors: list[Actor],
    *,
    duration_s: float | None = None,
    on_started: Callable[[], Awaitable[None]] | None = None,
    metrics_port: int = 0,
) -> None:
    """Start ``actors`` on ``broker`` and serve until a signal (or ``duration_s``), then stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sink = BrokerLogSink(broker)
    sink.start()
    attach_sink(sink)
    tracing.configure(service_name(actors))  # off unless OTEL_TRACES_EXPORTER asks (docs/tracing.md)
    try:
        with metrics_endpoint(broker, actors, metrics_port):
            for actor in actors:
                await actor.start()
            for sig in (signal.SIGTERM, signal.SIGINT):
                # Again: starting Ray (the policy's engines) installs its own SIGTERM handler over ours.
                loop.add_signal_handler(sig, stop.set)
            if on_started is not None:
                await on_started()
            with anyio.move_on_after(duration_s):  # None: until a signal
                await stop.wait()
            log.info("service_stopping", actors=len(actors))
            async with anyio.create_task_group() as stopping:
                for actor in actors:
                    stopping.start_soon(actor.stop)
    finally:
        await asyncio.to_thread(tracing.flush)  # spans still batched go out before the process does
        await sink.stop()
        detach_sink(sink)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
