"""Structured logs: structlog JSON lines, context bound through contextvars, written locally and
published to the run's log stream on the broker (so ``parkway logs --checkpoint-id`` sees every actor).

Context (actor, role, replica, checkpoint id, rollout id, attempt) is bound once with
``structlog.contextvars`` where it becomes known, never passed by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import MutableMapping
from typing import Any, TextIO

import anyio
import msgspec
import structlog
from opentelemetry import trace
from parkway.brokers.base import Broker
from parkway.protocol.tracecontext import checkpoint_trace_id, span_id_hex, trace_id_hex

_json = msgspec.json.Encoder()


def _default(obj: object) -> object:
    return repr(obj)


class BrokerLogSink:
    """Publishes rendered lines to the broker from a background task; never blocks the logger.

    When the queue is full (broker slow or gone), lines are dropped and counted, not buffered forever:
    the local log keeps every line.
    """

    def __init__(self, broker: Broker, *, capacity: int = 10_000) -> None:
        self.broker = broker
        self.dropped = 0
        self._queue: asyncio.Queue[tuple[bytes, str | None]] = asyncio.Queue(capacity)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.get_ident()

    def submit(self, line: bytes, checkpoint_id: str | None) -> None:
        if self._loop is not None and threading.get_ident() != self._thread:
            # From another thread (a span exported there): asyncio's queue is the loop's alone.
            self._loop.call_soon_threadsafe(self.submit, line, checkpoint_id)
            return
        try:
            self._queue.put_nowait((line, checkpoint_id))
        except asyncio.QueueFull:
            self.dropped += 1

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._task = self._loop.create_task(self._pump())

    async def _pump(self) -> None:
        while True:
            line, checkpoint_id = await self._queue.get()
            try:
                await self.broker.publish_log(line, checkpoint_id=checkpoint_id)
            except Exception:
                self.dropped += 1
            finally:
                self._queue.task_done()

    async def flush(self, timeout: float = 2.0) -> None:
        with anyio.move_on_after(timeout):  # lines still queued then are dropped with the process
            await self._queue.join()

    async def stop(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


_sinks: list[BrokerLogSink] = []
_trace_fields = False  # set while tracing is on: lines carry trace_id and span_id


def publish_line(line: bytes, checkpoint_id: str | None) -> None:
    """A line for the run's log stream only (a span's record), not the local log."""
    for sink in _sinks:
        sink.submit(line, checkpoint_id)


def enable_trace_fields(on: bool) -> None:
    global _trace_fields
    _trace_fields = on


def _trace_ids(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """``trace_id`` and ``span_id`` of the span the line is logged in, so logs and traces join; a line
    of a checkpoint logged outside any span gets that checkpoint's trace id (docs/tracing.md)."""
    if not _trace_fields:
        return event_dict
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event_dict.setdefault("trace_id", trace_id_hex(span_context.trace_id))
        event_dict.setdefault("span_id", span_id_hex(span_context.span_id))
    elif isinstance(checkpoint_id := event_dict.get("checkpoint_id"), str):
        event_dict.setdefault("trace_id", trace_id_hex(checkpoint_trace_id(checkpoint_id)))
    return event_dict


_LEVELS = logging.getLevelNamesMapping()
_local_level = logging.INFO  # lines below it reach the broker's stream but not the local stream


def _render(_: Any, method: str, event_dict: MutableMapping[str, Any]) -> str:
    line = (
        _json.encode(event_dict) if _plain(event_dict) else msgspec.json.encode(event_dict, enc_hook=_default)
    )
    for sink in _sinks:
        checkpoint_id = event_dict.get("checkpoint_id")
        sink.submit(line, checkpoint_id if isinstance(checkpoint_id, str) else None)
    if _LEVELS.get(method.upper(), logging.INFO) < _local_level:
        raise structlog.DropEvent
    return line.decode()


def _plain(event_dict: MutableMapping[str, Any]) -> bool:
    return all(isinstance(v, str | int | float | bool | type(None)) for v in event_dict.values())


def configure_logging(
    *, stream: TextIO | None = None, level: str = "info", stream_level: str = "info"
) -> None:
    """JSON lines at ``level`` and above to ``stream`` (stderr by default); while a broker sink is
    attached it gets ``stream_level`` and above, so a quiet terminal (``parkway run`` shows warnings
    only) does not leave the run's log stream without the lines ``parkway logs`` and ``parkway report``
    read."""
    global _local_level, _stream_level, _output
    _local_level = _LEVELS[level.upper()]
    _stream_level = _LEVELS[stream_level.upper()]
    _output = stream or sys.stderr
    _apply()


_stream_level = logging.INFO
_output: TextIO | None = None


def _apply() -> None:
    # Below both levels a call costs one comparison (the filtering logger); between them, only while a
    # sink wants the line, it is rendered for the sink and dropped locally.
    floor = min(_local_level, _stream_level) if _sinks else _local_level
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            _render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(floor),
        logger_factory=structlog.PrintLoggerFactory(_output or sys.stderr),
        cache_logger_on_first_use=False,
    )


def attach_sink(sink: BrokerLogSink) -> None:
    _sinks.append(sink)
    if _output is not None:
        _apply()


def detach_sink(sink: BrokerLogSink) -> None:
    if sink in _sinks:
        _sinks.remove(sink)
    if _output is not None:
        _apply()
