"""OpenTelemetry traces across every actor: spans for snapshot steps, command handling and rollouts.

Off unless the process is configured for it (``configure`` reads the standard ``OTEL_*`` environment;
``enable`` takes a tracer provider). While off, every helper here returns at once without touching
OpenTelemetry, so the delivery path costs one attribute check. The OpenTelemetry API is a core
dependency; the SDK and its exporters are the ``tracing`` extra, imported only by ``configure``
(``tracing_sdk.py``), so the package imports without them.

What is traced (docs/tracing.md):

- a snapshot or restore on the controller: one root span per attempt whose trace id is derived from
  the checkpoint id (``protocol/tracecontext.py``), a child span per step;
- every handled command or data message on every actor: a ``queued`` span from its publish to its
  handler's start and a handling span, both children of the sender's span (the ``traceparent``
  header, which ``inject`` writes on every signed envelope);
- every rollout attempt: its own trace, a span per turn, model call and tool call, a ``parked`` span
  linked to each snapshot that saved it, and a link from a continuing attempt to the one it continues.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from parkway.protocol.tracecontext import (
    PUBLISHED_AT_HEADER,
    TRACEPARENT_HEADER,
    checkpoint_span_id,
    checkpoint_trace_id,
    format_traceparent,
    parse_published_at,
    parse_traceparent,
    rollout_span_id,
    rollout_trace_id,
)

T = TypeVar("T")
INSTRUMENTATION = "parkway"
_NULL = contextlib.nullcontext()


class _State:
    tracer: trace.Tracer | None = None
    provider: Any = None  # the SDK provider ``configure`` made (flushed at stop), if any
    forced_ids: Any = None  # the id generator that lets a root span take a derived id, if ours


_state = _State()


def enabled() -> bool:
    return _state.tracer is not None


def enable(provider: trace.TracerProvider, *, forced_ids: Any = None) -> None:
    """Trace with ``provider`` (tests, or a program that set up its own SDK). ``forced_ids`` is the
    provider's ``ForcedIds`` generator when it has one: without it a derived trace id is given to a root
    span through a remote parent of that id instead (docs/tracing.md#trace-ids)."""
    from parkway.actors.runtime import logs

    _state.tracer = provider.get_tracer(INSTRUMENTATION)
    _state.forced_ids = forced_ids
    logs.enable_trace_fields(True)


def disable() -> None:
    from parkway.actors.runtime import logs

    _state.tracer, _state.provider, _state.forced_ids = None, None, None
    logs.enable_trace_fields(False)


def configure(service_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Set tracing up from ``OTEL_TRACES_EXPORTER`` and the other ``OTEL_*`` variables; False (and
    nothing touched) when they leave it off. Raises ``SettingsError`` for a value it cannot honour."""
    from parkway.actors.runtime import tracing_sdk

    setup = tracing_sdk.from_env(service_name, environ)
    if setup is None:
        return False
    shutdown()  # a second run in one process replaces the first one's provider
    _state.provider = setup.provider
    enable(setup.provider, forced_ids=setup.forced_ids)
    return True


def flush(timeout_s: float = 5.0) -> None:
    """Export what is still buffered (a graceful stop); a no-op when off or on someone else's provider."""
    if _state.provider is not None:
        _state.provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    if _state.provider is not None:
        _state.provider.shutdown()
    disable()


# -- propagation ---------------------------------------------------------------------------------
def inject(headers: dict[str, str]) -> None:
    """Write the current span's ``traceparent`` and the publish time into ``headers`` (nothing when off
    or outside a span). Neither is signed: docs/tracing.md#signatures says why."""
    if _state.tracer is None:
        return
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        headers[TRACEPARENT_HEADER] = format_traceparent(
            span_context.trace_id, span_context.span_id, sampled=span_context.trace_flags.sampled
        )
    headers[PUBLISHED_AT_HEADER] = repr(time.time())


def _remote(trace_id: int, span_id: int, *, sampled: bool = True) -> otel_context.Context:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    parent = SpanContext(trace_id=trace_id, span_id=span_id, is_remote=True, trace_flags=flags)
    return trace.set_span_in_context(NonRecordingSpan(parent), otel_context.Context())


def parent_of(headers: Mapping[str, str]) -> otel_context.Context:
    """The context a delivery's handling span starts in: its sender's span, or a fresh root context for
    a missing, malformed or hostile ``traceparent``."""
    parent = parse_traceparent(headers.get(TRACEPARENT_HEADER))
    if parent is None:
        return otel_context.Context()
    return _remote(parent.trace_id, parent.span_id, sampled=parent.sampled)


def link_to(trace_id: int, span_id: int, **attributes: str | int) -> Link:
    """A link to another trace's span; each attribute is named ``parkway.<keyword>``."""
    named = {f"parkway.{key}": value for key, value in attributes.items()}
    return Link(SpanContext(trace_id=trace_id, span_id=span_id, is_remote=True), attributes=named)


def checkpoint_link(checkpoint_id: str, relation: str) -> Link:
    """A link to the root span of the snapshot (or restore) ``checkpoint_id``."""
    return link_to(
        checkpoint_trace_id(checkpoint_id),
        checkpoint_span_id(checkpoint_id),
        relation=relation,
        checkpoint_id=checkpoint_id,
    )


@contextlib.contextmanager
def _root(
    tracer: trace.Tracer,
    name: str,
    trace_id: int,
    span_id: int,
    *,
    attributes: dict[str, Any],
    links: Sequence[Link] = (),
    kind: SpanKind = SpanKind.INTERNAL,
    current: bool = True,
) -> Iterator[trace.Span]:
    """A root span with the derived ids, made current unless ``current`` is False. With parkway's own
    SDK set-up the ids are the span's own; on another provider the trace id comes through a remote
    parent of the derived ids."""
    forced = _state.forced_ids
    if forced is not None:
        with forced.next_ids(trace_id, span_id):
            span = tracer.start_span(
                name, context=otel_context.Context(), kind=kind, attributes=attributes, links=links
            )
    else:
        span = tracer.start_span(
            name, context=_remote(trace_id, span_id), kind=kind, attributes=attributes, links=links
        )
    if not current:
        try:
            yield span
        finally:
            span.end()
        return
    with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield span


# -- the controller: snapshots, restores and their steps ------------------------------------------
def snapshot(
    checkpoint_id: str, *, kind: str, seq: int | None = None, restores: str | None = None
) -> contextlib.AbstractContextManager[Any]:
    """The root span of one save or restore attempt (``kind``), keyed by its checkpoint id, yielded. A
    save's is current while it runs; a restore's is not (its id is made in the middle of a step: the
    steps after it name it as their ``parent``), and links to the snapshot it restores."""
    tracer = _state.tracer
    if tracer is None:
        return _NULL
    attributes: dict[str, Any] = {
        "parkway.checkpoint_id": checkpoint_id,
        "parkway.actor": "controller/0",
        "parkway.operation": kind,
    }
    if seq is not None:
        attributes["parkway.seq"] = seq
    links = [checkpoint_link(restores, "restores")] if restores else []
    return _root(
        tracer,
        f"{kind} {checkpoint_id}",
        checkpoint_trace_id(checkpoint_id),
        checkpoint_span_id(checkpoint_id),
        attributes=attributes,
        links=links,
        current=restores is None,
    )


_CURRENT: Any = object()


def step(name: str, work: Awaitable[T], *, parent: Any = _CURRENT) -> Awaitable[T]:
    """``work`` (one save or restore step) in a span named for the step, a child of the current span or
    of ``parent``; ``work`` itself when off, or when ``parent`` is given as None (no root yet)."""
    if _state.tracer is None or parent is None:
        return work
    context = None if parent is _CURRENT else trace.set_span_in_context(parent)
    return _in_span(
        _state.tracer, name, work, {"parkway.step": name, "parkway.actor": "controller/0"}, context
    )


async def _in_span(
    tracer: trace.Tracer,
    name: str,
    work: Awaitable[T],
    attributes: dict[str, Any],
    context: otel_context.Context | None = None,
) -> T:
    with tracer.start_as_current_span(name, context=context, attributes=attributes):
        return await work


# -- every actor: handling one delivery -----------------------------------------------------------
def handling(
    address: str, headers: Mapping[str, str], message: object
) -> contextlib.AbstractContextManager[Any]:
    """Around a handler: a ``queued`` span (publish to now) and the handling span, current while the
    handler runs, both children of the sender's span."""
    tracer = _state.tracer
    if tracer is None:
        return _NULL
    return _handling(tracer, address, headers, message)


@contextlib.contextmanager
def _handling(
    tracer: trace.Tracer, address: str, headers: Mapping[str, str], message: object
) -> Iterator[None]:
    parent = parent_of(headers)
    kind = type(message).__name__
    attributes: dict[str, Any] = {"parkway.actor": address, "parkway.message_type": kind}
    for field, key in (
        ("checkpoint_id", "parkway.checkpoint_id"),
        ("rollout_id", "parkway.rollout_id"),
        ("attempt", "parkway.attempt"),
        ("call_index", "parkway.call_index"),
    ):
        value = getattr(message, field, None)
        if isinstance(value, str | int):
            attributes[key] = value
    now = time.time()
    published = parse_published_at(headers.get(PUBLISHED_AT_HEADER), now=now)
    if published is not None:
        queued_s = max(0.0, now - published)  # another host's clock may run ahead of ours
        attributes["parkway.queued_ms"] = round(queued_s * 1000, 3)
        waited = tracer.start_span(
            f"queued {kind}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={**attributes, "parkway.phase": "queued"},
            start_time=int((now - queued_s) * 1e9),
        )
        waited.end(end_time=int(now * 1e9))
    span = tracer.start_span(
        kind, context=parent, kind=SpanKind.CONSUMER, attributes={**attributes, "parkway.phase": "handled"}
    )
    with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield


def reply_opened(
    requester: str, replier: str, headers: Mapping[str, str], reply: object, opened_s: float
) -> None:
    """At the requester, once a command's reply is opened: a ``reply X from A`` span, a child of the
    span the request was made in, from the reply's publish (by the replier) to now. It is the way back:
    the replier signing and publishing, the broker, the requester's loop reaching the reply, and
    ``opened_s`` of checking and decoding it. (Between the handling span's end and this span's start is
    what the replier did after its handler: its reply cache, counters, signing.)"""
    tracer = _state.tracer
    if tracer is None:
        return
    now = time.time()
    published = parse_published_at(headers.get(PUBLISHED_AT_HEADER), now=now)
    if published is None:
        return
    kind = type(reply).__name__
    span = tracer.start_span(
        f"reply {kind} from {replier}",
        kind=SpanKind.CLIENT,
        attributes={
            "parkway.actor": requester,
            "parkway.message_type": kind,
            "parkway.replier": replier,
            "parkway.phase": "reply",
            "parkway.opened_ms": round(opened_s * 1000, 3),
        },
        start_time=int(min(published, now) * 1e9),  # another host's clock may run ahead of ours
    )
    span.end(end_time=int(now * 1e9))


def mark_error(code: str, detail: str) -> None:
    """The handler answered with a typed error: its span says so."""
    if _state.tracer is None:
        return
    span = trace.get_current_span()
    span.set_attribute("parkway.error_code", code)
    span.set_status(Status(StatusCode.ERROR, detail[:200]))


# -- rollouts ----------------------------------------------------------------------------------------
class RolloutTrace:
    """One rollout attempt's trace: the attempt's root span, its turns, its model and tool calls."""

    def __init__(self, tracer: trace.Tracer, rollout_id: str, attempt: int, replica: int) -> None:
        self.tracer = tracer
        self.rollout_id, self.attempt = rollout_id, attempt
        self.attributes: dict[str, Any] = {
            "parkway.rollout_id": rollout_id,
            "parkway.attempt": attempt,
            "parkway.actor": f"agent/{replica}",
        }
        self.root = SpanContext(
            trace_id=rollout_trace_id(rollout_id, attempt),
            span_id=rollout_span_id(rollout_id, attempt),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        self._turn: trace.Span | None = None

    def _parent(self) -> otel_context.Context:
        """The turn in progress, or the rollout's root between turns."""
        if self._turn is None:
            return self._root_context()
        return trace.set_span_in_context(self._turn, otel_context.Context())

    def _root_context(self) -> otel_context.Context:
        return trace.set_span_in_context(NonRecordingSpan(self.root), otel_context.Context())

    async def running(self, work: Awaitable[T], *, continues: int | None) -> T:
        """The attempt's root span around its program; linked to the attempt it continues."""
        links = []
        if continues is not None:
            links.append(
                link_to(
                    rollout_trace_id(self.rollout_id, continues),
                    rollout_span_id(self.rollout_id, continues),
                    relation="continues",
                    attempt=continues,
                )
            )
        attributes = {**self.attributes, "parkway.continuing": continues is not None}
        if continues is not None:
            attributes["parkway.continues_attempt"] = continues
        with _root(
            self.tracer,
            f"rollout {self.rollout_id}",
            self.root.trace_id,
            self.root.span_id,
            attributes=attributes,
            links=links,
        ):
            try:
                return await work
            finally:
                self.turn_ended()

    def turn_started(self, index: int, replayed: bool) -> None:
        self.turn_ended()
        self._turn = self.tracer.start_span(
            f"turn {index}",
            context=self._parent(),
            attributes={**self.attributes, "parkway.turn": index, "parkway.replayed": replayed},
        )

    def turn_ended(self) -> None:
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.end()

    async def call(self, kind: str, index: int, work: Awaitable[T]) -> T:
        """One model or tool call, current while it is in flight: the receiver's spans are its children."""
        with self.tracer.start_as_current_span(
            f"{kind} call {index}",
            context=self._parent(),
            kind=SpanKind.CLIENT,
            attributes={**self.attributes, "parkway.call": kind, "parkway.call_index": index},
        ):
            return await work

    def parked(self, checkpoint_id: str, *, at_ns: int) -> None:
        """A snapshot saved this attempt at its boundary, cut at ``at_ns``: a span of no length there
        under the rollout's root, linked to the snapshot's root span (exported at once, so it outlives
        a crash of this process). Made at the agent's Commit, after the window: a span is tens of
        microseconds, and one per rollout inside the window more than doubled it at 1024 in flight."""
        span = self.tracer.start_span(
            f"parked by {checkpoint_id}",
            context=self._root_context(),
            attributes={**self.attributes, "parkway.checkpoint_id": checkpoint_id},
            links=[checkpoint_link(checkpoint_id, "parked_by")],
            start_time=at_ns,
        )
        span.end(end_time=at_ns)


class _NoRolloutTrace:
    async def running(self, work: Awaitable[T], *, continues: int | None) -> T:
        return await work

    def turn_started(self, index: int, replayed: bool) -> None:
        pass

    def turn_ended(self) -> None:
        pass

    async def call(self, kind: str, index: int, work: Awaitable[T]) -> T:
        return await work

    def parked(self, checkpoint_id: str, *, at_ns: int) -> None:
        pass


NO_ROLLOUT_TRACE = _NoRolloutTrace()
AttemptTrace = RolloutTrace | _NoRolloutTrace  # what ``rollout`` gives an attempt


def rollout(rollout_id: str, attempt: int, replica: int) -> AttemptTrace:
    tracer = _state.tracer
    if tracer is None:
        return NO_ROLLOUT_TRACE
    return RolloutTrace(tracer, rollout_id, attempt, replica)
