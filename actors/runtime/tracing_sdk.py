"""The OpenTelemetry SDK set up from the standard ``OTEL_*`` environment (the ``tracing`` extra).

Imported only when ``tracing.configure`` runs, so the core never needs the SDK. Off unless
``OTEL_TRACES_EXPORTER`` names an exporter (parkway's default is off, where the SDK's is ``otlp``:
tracing must be asked for). ``OTEL_SDK_DISABLED=true`` turns it off whatever else is set.

Exporters, comma-separated in ``OTEL_TRACES_EXPORTER``:

- ``otlp``: OTLP over HTTP/protobuf to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the SDK reads them, and ``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``),
  batched (``OTEL_BSP_*``);
- ``parkway``: each finished span as one JSON line on the run's log stream (what ``parkway trace``
  reads with no backend);
- ``file``: the same lines appended to ``PARKWAY_TRACE_FILE``;
- ``console``: the SDK's console exporter;
- ``none``: spans are made (log lines carry their ids) and exported nowhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from parkway.actors.runtime.settings import SettingsError
from parkway.protocol.tracecontext import SPAN_EVENT

EXPORTERS_ENV = "OTEL_TRACES_EXPORTER"
TRACE_FILE_ENV = "PARKWAY_TRACE_FILE"
KNOWN_EXPORTERS = ("otlp", "parkway", "file", "console", "none")

try:
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
except ImportError:  # the SDK is the ``tracing`` extra; ``from_env`` says so when asked to trace
    SDK = False
else:
    SDK = True

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class Setup:
    provider: Any
    forced_ids: Any
    exporters: tuple[str, ...]


def exporters_from(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the environment asks for; empty when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = tuple(n.strip().lower() for n in environ.get(EXPORTERS_ENV, "").split(",") if n.strip())
    unknown = [n for n in names if n not in KNOWN_EXPORTERS]
    if unknown:
        raise SettingsError(
            f"{EXPORTERS_ENV}={environ.get(EXPORTERS_ENV)!r}: unknown exporter {unknown[0]!r} "
            f"(want a comma-separated list of {', '.join(KNOWN_EXPORTERS)})"
        )
    return names


def from_env(service_name: str, environ: Mapping[str, str] | None = None) -> Setup | None:
    env = os.environ if environ is None else environ
    names = exporters_from(env)
    if not names:
        return None
    if not SDK:
        raise SettingsError(
            f"{EXPORTERS_ENV}={env.get(EXPORTERS_ENV)!r} needs the OpenTelemetry SDK: "
            "pip install 'parkway[tracing]'"
        )
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    forced = ForcedIds()
    provider = TracerProvider(resource=Resource.create(attributes), id_generator=forced)
    for name in dict.fromkeys(names):
        processor = _processor(name, env)
        if processor is not None:
            provider.add_span_processor(processor)
    return Setup(provider=provider, forced_ids=forced, exporters=names)


def _processor(name: str, env: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if name == "otlp":
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol and protocol != "http/protobuf":
            raise SettingsError(
                f"OTLP protocol {protocol!r}: parkway exports OTLP over HTTP (http/protobuf) only"
            )
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise SettingsError(
                "OTEL_TRACES_EXPORTER=otlp needs the OTLP/HTTP exporter: pip install 'parkway[tracing]'"
            ) from None
        return BatchSpanProcessor(OTLPSpanExporter())
    if name == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    if name == "parkway":
        return LogStreamProcessor()
    if name == "file":
        path = env.get(TRACE_FILE_ENV, "").strip()
        if not path:
            raise SettingsError(
                f"{EXPORTERS_ENV}=file needs {TRACE_FILE_ENV} (the file spans are appended to)"
            )
        return FileProcessor(path)
    return None  # none


if SDK:

    class ForcedIds(IdGenerator):
        """Random ids, except for a root span started inside ``next_ids``: it takes the ids given (a
        snapshot's from its checkpoint id, a rollout attempt's from its rollout id and attempt)."""

        def __init__(self) -> None:
            self._random = RandomIdGenerator()
            self._next: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
                "parkway_forced_ids", default=None
            )

        @contextlib.contextmanager
        def next_ids(self, trace_id: int, span_id: int) -> Iterator[None]:
            token = self._next.set((trace_id, span_id))
            try:
                yield
            finally:
                self._next.reset(token)

        def generate_trace_id(self) -> int:
            forced = self._next.get()
            return forced[0] if forced is not None else self._random.generate_trace_id()

        def generate_span_id(self) -> int:
            forced = self._next.get()
            if forced is not None:
                self._next.set(None)  # one span only: its children get random ids
                return forced[1]
            return self._random.generate_span_id()

    class LogStreamProcessor(SpanProcessor):
        """Each finished span as a JSON line on the run's log stream (through the log sinks), tagged
        with its checkpoint id so ``parkway logs --checkpoint-id`` finds it too."""

        def on_end(self, span: ReadableSpan) -> None:
            from parkway.actors.runtime import logs

            record = span_record(span)
            checkpoint_id = record["attrs"].get("parkway.checkpoint_id")
            logs.publish_line(_json.encode(record), checkpoint_id if isinstance(checkpoint_id, str) else None)

    class FileProcessor(SpanProcessor):
        """Each finished span as a JSON line appended to a file: one ``write(2)`` on an ``O_APPEND``
        descriptor, so several processes may share the file and a SIGKILL loses no finished span."""

        def __init__(self, path: str) -> None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._lock = threading.Lock()

        def on_end(self, span: ReadableSpan) -> None:
            line = _json.encode(span_record(span)) + b"\n"
            with self._lock:
                os.write(self._fd, line)

        def shutdown(self) -> None:
            with contextlib.suppress(OSError):
                os.close(self._fd)

    def _plain(value: object) -> object:
        """An attribute value as JSON has it: a scalar, or a list of them (the SDK keeps tuples)."""
        if isinstance(value, str | int | float | bool) or value is None:
            return value
        if isinstance(value, list | tuple):
            return list(value)
        return str(value)

    def span_record(span: ReadableSpan) -> dict[str, Any]:
        """A finished span as a log line: ids in hex, times in Unix seconds, attributes as they are."""
        context = span.get_span_context()
        attrs = {k: _plain(v) for k, v in (span.attributes or {}).items()}
        start, end = (span.start_time or 0) / 1e9, (span.end_time or 0) / 1e9
        actor = attrs.get("parkway.actor") or span.resource.attributes.get("service.name", "")
        return {
            "ts": datetime.datetime.fromtimestamp(end, datetime.UTC).isoformat(),
            "event": SPAN_EVENT,
            "level": "info",
            "actor": actor,
            "checkpoint_id": attrs.get("parkway.checkpoint_id"),
            "trace_id": f"{context.trace_id:032x}" if context else "",
            "span_id": f"{context.span_id:016x}" if context else "",
            "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
            "name": span.name,
            "start": start,
            "end": end,
            "status": span.status.status_code.name.lower(),
            "attrs": attrs,
            "links": [
                {
                    "trace_id": f"{link.context.trace_id:032x}",
                    "span_id": f"{link.context.span_id:016x}",
                    "attrs": dict(link.attributes or {}),
                }
                for link in span.links
            ],
        }

else:  # pragma: no cover - without the SDK, ``from_env`` refuses before any of these is needed

    class ForcedIds:  # type: ignore[no-redef]  # a stand-in so the name exists without the SDK
        pass
