"""Tracing in one process on the in-memory broker: the spans a snapshot and a rollout make, hostile
``traceparent`` headers, the ``OTEL_*`` settings, log lines that carry the ids, the waterfall."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.runtime import tracing, tracing_sdk
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.settings import SettingsError
from parkway.actors.tools import waterfall
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Probe, ProbeResult
from parkway.protocol.snapshot import SAVE_SEQUENCE
from parkway.protocol.tracecontext import (
    PUBLISHED_AT_HEADER,
    TRACEPARENT_HEADER,
    checkpoint_span_id,
    checkpoint_trace_id,
    format_traceparent,
    trace_id_hex,
)

from tests.support.embedded import SNAPSHOT_RUN, embedded_run
from tests.support.signed import SECRET


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    ids = tracing_sdk.ForcedIds()
    provider = TracerProvider(id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider, forced_ids=ids)
    yield exporter
    tracing.disable()


def test_off_by_default_and_each_setting_checked() -> None:
    assert tracing_sdk.from_env("parkway", {}) is None
    assert (
        tracing_sdk.from_env("parkway", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) is None
    )
    with pytest.raises(SettingsError, match="unknown exporter 'jaeger'"):
        tracing_sdk.from_env("parkway", {"OTEL_TRACES_EXPORTER": "otlp,jaeger"})
    with pytest.raises(SettingsError, match="HTTP"):
        tracing_sdk.from_env(
            "parkway", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        )
    with pytest.raises(SettingsError, match="PARKWAY_TRACE_FILE"):
        tracing_sdk.from_env("parkway", {"OTEL_TRACES_EXPORTER": "file"})
    setup = tracing_sdk.from_env("parkway-agent", {"OTEL_TRACES_EXPORTER": "none"})
    assert setup is not None and setup.exporters == ("none",)
    assert setup.provider.resource.attributes["service.name"] == "parkway-agent"


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-" + "f" * 100_000,
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
    ],
    ids=["garbage", "zero-trace-id", "oversized", "upper-case"],
)
async def test_a_hostile_traceparent_starts_a_root_span_and_changes_nothing_else(
    spans: InMemorySpanExporter, tmp_path: Path, traceparent: str
) -> None:
    async with MemoryBroker(MemoryHub(), "unit") as broker:
        tq = TransferQueue(broker, secret=SECRET, replica=0, state_dir=tmp_path / "tq")
        await tq.start()
        try:
            client = Client(broker, secret=SECRET, sender="controller/0")
            message = Probe(checkpoint_id="p-hostile", deadline=time.time() + 10, note="n")
            envelope = client.envelope(message, correlation_id="p-hostile", to="tq/0")
            headers = {**envelope.headers, TRACEPARENT_HEADER: traceparent, PUBLISHED_AT_HEADER: "nan"}
            reply_envelope = await broker.request(
                "tq/0", replace(envelope, headers=headers), deadline=time.time() + 5
            )
            reply = client.open_reply(reply_envelope, requested="tq/0")
            assert isinstance(reply, ProbeResult) and reply.note == "n"  # handled as it would be without it
            assert await broker.read_dead_letters() == []
            assert tq.counts["Probe"] == 1 and not any(k.startswith("refused") for k in tq.counts)
        finally:
            await tq.stop()
    [handled] = [s for s in spans.get_finished_spans() if s.name == "Probe"]
    assert handled.parent is None  # a new root span
    assert not [s for s in spans.get_finished_spans() if s.name == "queued Probe"]  # no publish time to trust


async def test_a_valid_traceparent_parents_the_handling_and_queued_spans(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    parent = format_traceparent(0xABC, 0xDEF)
    async with MemoryBroker(MemoryHub(), "unit") as broker:
        tq = TransferQueue(broker, secret=SECRET, replica=0, state_dir=tmp_path / "tq")
        await tq.start()
        try:
            client = Client(broker, secret=SECRET, sender="controller/0")
            envelope = client.envelope(
                Probe(checkpoint_id="p-ok", deadline=time.time() + 10), correlation_id="p-ok", to="tq/0"
            )
            headers = {**envelope.headers, TRACEPARENT_HEADER: parent, PUBLISHED_AT_HEADER: repr(time.time())}
            await broker.request("tq/0", replace(envelope, headers=headers), deadline=time.time() + 5)
        finally:
            await tq.stop()
    named = {s.name: s for s in spans.get_finished_spans()}
    for name in ("Probe", "queued Probe"):
        assert named[name].context.trace_id == 0xABC and named[name].parent.span_id == 0xDEF
    assert named["Probe"].attributes["parkway.actor"] == "tq/0"
    assert named["Probe"].attributes["parkway.checkpoint_id"] == "p-ok"


async def test_a_snapshot_is_one_trace_keyed_by_its_checkpoint_id(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    from parkway.actors.runtime.logs import configure_logging

    saved = structlog.get_config()
    stream = io.StringIO()
    configure_logging(stream=stream, level="info")
    try:
        summary = await embedded_run(SNAPSHOT_RUN, tmp_path)
    finally:
        structlog.configure(**saved)
    assert summary.snapshots_published >= 1
    finished = spans.get_finished_spans()
    [newest] = sorted((tmp_path / "snapshots" / "snaps").glob("snapshot_*"))[-1:]
    manifest = json.loads((newest / "manifest.json").read_text())
    cid = manifest["checkpoint_id"]
    trace_id = checkpoint_trace_id(cid)
    assert manifest["trace_id"] == trace_id_hex(trace_id)
    mine = [s for s in finished if s.context.trace_id == trace_id]
    [root] = [s for s in mine if s.parent is None]
    assert root.context.span_id == checkpoint_span_id(cid) and root.name == f"snapshot {cid}"
    steps = {s.name for s in mine if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert steps == {step.name.value for step in SAVE_SEQUENCE}
    handled = {
        (s.name, s.attributes["parkway.actor"])
        for s in mine
        if s.attributes.get("parkway.phase") == "handled"
    }
    for actor in ("agent/0", "agent/1", "policy/0", "resources/0", "resources/1", "tq/0"):
        assert {("Prepare", actor), ("Commit", actor), ("Resume", actor)} <= handled
    # The way back: each agent's Persisted, a span at the controller under the persist step, from the
    # agent's publish (after its handling span ended) to the controller opening it. (A reply that
    # arrived before it was awaited has no way back to draw: a Prepared, collected a step after its
    # Prepare went, usually has.)
    [persist_step] = [s for s in mine if s.name == "persist" and s.parent.span_id == root.context.span_id]
    for agent in ("agent/0", "agent/1"):
        [back] = [s for s in mine if s.name == f"reply Persisted from {agent}"]
        [handling] = [s for s in mine if s.name == "Persist" and s.attributes["parkway.actor"] == agent]
        assert back.parent.span_id == persist_step.context.span_id
        assert (
            back.attributes["parkway.actor"] == "controller/0" and back.attributes["parkway.phase"] == "reply"
        )
        assert handling.end_time <= back.start_time <= back.end_time <= persist_step.end_time
    assert not [s for s in finished if s.name.startswith("reply Generate")]  # data calls: the rollout's spans

    # Rollouts: a trace each, with turns, model and tool calls, and the snapshots that parked them.
    rollouts = [s for s in finished if s.name.startswith("rollout ")]
    assert len(rollouts) == summary.rollouts_sealed
    one = rollouts[0]
    in_it = [s for s in finished if s.context.trace_id == one.context.trace_id]
    kinds = {s.name.split(" ")[0] for s in in_it}
    assert {"rollout", "turn", "model", "tool", "Generate", "ToolCall"} <= kinds
    parked = [s for s in finished if s.name.startswith("parked by ")]
    assert parked and all(
        s.links[0].context.trace_id == checkpoint_trace_id(s.attributes["parkway.checkpoint_id"])
        for s in parked
    )
    # Made at the agent's Commit, after the window (not one per rollout inside it), and dated at the
    # cut: each ends after its agent's Prepare of that snapshot, and is of no length.
    for span in (s for s in parked if s.attributes["parkway.checkpoint_id"] == cid):
        agent = span.attributes["parkway.actor"]
        [prepared] = [s for s in mine if s.name == "Prepare" and s.attributes["parkway.actor"] == agent]
        assert finished.index(span) > finished.index(prepared)
        assert (
            span.start_time == span.end_time and prepared.start_time <= span.start_time <= prepared.end_time
        )

    # Log lines carry the ids: those of the checkpoint, its trace id.
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]
    of_it = [line for line in lines if line.get("checkpoint_id") == cid]
    assert of_it and all(line["trace_id"] == trace_id_hex(trace_id) for line in of_it)
    assert any("span_id" in line for line in of_it)

    # And the waterfall of its records.
    records = [tracing_sdk.span_record(s) for s in finished]
    built = waterfall.build(records, cid)
    assert built is not None and built.rows[0].name == f"snapshot {cid}"
    assert [r.name for r in built.rows if r.depth == 1] == [step.name.value for step in SAVE_SEQUENCE]
    assert all(r.critical for r in built.rows if r.depth <= 1)  # the steps run one after another
    text = waterfall.render(built)
    assert "critical path: retire " in text and "> instant " in text and "policy/0" in text
    assert "reply Persisted from agent/0" in text
    assert waterfall.build(records, "ck-never") is None
    page = waterfall.render_html(built)
    assert f"checkpoint {cid}" in page and page.count("<tr>") == len(built.rows) + 1
    longest = waterfall.slowest(records)
    assert longest is not None and longest.total_s >= built.total_s


WITHOUT_SDK = """
import sys
class NoSdk:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ImportError(f"{name} is not installed (blocked by the test)")
sys.meta_path.insert(0, NoSdk())
import parkway.actors.tools.cli, parkway.actors.launch.workload, parkway.actors.runtime.tracing as tracing
from parkway.actors.runtime.settings import SettingsError
assert not tracing.configure("parkway", {})
try:
    tracing.configure("parkway", {"OTEL_TRACES_EXPORTER": "otlp"})
except SettingsError as exc:
    print("refused:", exc)
assert not [m for m in sys.modules if m.startswith("opentelemetry.sdk")]
"""


@pytest.mark.slow  # a Python process of its own, where the SDK cannot be imported
def test_the_core_imports_and_runs_without_the_sdk() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", WITHOUT_SDK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: OTEL_TRACES_EXPORTER='otlp' needs the OpenTelemetry SDK" in result.stdout
    assert "parkway[tracing]" in result.stdout


WAY_BACK_CID = "ck-20261206T101505.916-0f92af"


def way_back_records() -> list[dict[str, Any]]:
    """A snapshot's span lines in which an agent's reply took longer on its way back than its handling."""
    cid = WAY_BACK_CID
    trace_id = trace_id_hex(checkpoint_trace_id(cid))

    def record(span_id: str, parent: str | None, name: str, actor: str, start: float, end: float, **attrs):
        return {
            "event": "span",
            "trace_id": trace_id,
            "span_id": span_id,
            "parent_span_id": parent,
            "name": name,
            "actor": actor,
            "start": start,
            "end": end,
            "attrs": attrs,
        }

    t = 1_796_552_105.0
    records = [
        record("r", None, f"snapshot {cid}", "controller/0", t, t + 0.020),
        record("p", "r", "prepare", "controller/0", t, t + 0.012),
        record(
            "q",
            "p",
            "queued Prepare",
            "agent/0",
            t + 0.001,
            t + 0.004,
            **{"parkway.phase": "queued", "parkway.actor": "agent/0", "parkway.message_type": "Prepare"},
        ),
        record(
            "h",
            "p",
            "Prepare",
            "agent/0",
            t + 0.004,
            t + 0.005,
            **{"parkway.phase": "handled", "parkway.actor": "agent/0", "parkway.message_type": "Prepare"},
        ),
        record(
            "b",
            "p",
            "reply Prepared from agent/0",
            "controller/0",
            t + 0.0052,
            t + 0.0115,
            **{"parkway.phase": "reply", "parkway.actor": "controller/0"},
        ),
        record("c", "r", "capture", "controller/0", t + 0.012, t + 0.020),
    ]
    return records


def test_the_waterfall_names_a_replys_way_back_on_the_critical_path() -> None:
    built = waterfall.build(way_back_records(), WAY_BACK_CID)
    assert built is not None
    critical = [(r.name, r.phase) for r in built.critical_path if r.depth == 2]
    assert critical == [("Prepare", "handled"), ("reply Prepared from agent/0", "reply")]
    text = waterfall.render(built)
    assert "slowest in its step: Prepare at agent/0: queued 3.0 ms, handled 1.0 ms" in text
    assert (
        "on its way back: reply Prepared from agent/0: 6.3 ms from its publish to controller/0 opening it"
        in text
    )


def test_parkway_trace_prints_the_waterfall_and_draws_it_as_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from parkway.actors.tools.cli import main

    spans = tmp_path / "spans.jsonl"
    spans.write_text("not a span line\n" + "".join(json.dumps(r) + "\n" for r in way_back_records()))
    picture = tmp_path / "waterfall.image"  # drawn as PNG whatever the name ends in
    assert main(["trace", WAY_BACK_CID, str(spans), "--png", str(picture)]) == 0
    out, err = capsys.readouterr()
    assert "critical path: prepare " in out and "reply Prepared from agent/0" in out
    assert f"drew {picture}" in err
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and picture.stat().st_size > 5000

    # Where it cannot write, a clear error and exit 2 (the text was printed all the same).
    assert main(["trace", WAY_BACK_CID, str(spans), "--png", str(tmp_path / "no" / "such.png")]) == 2
    out, err = capsys.readouterr()
    assert "critical path:" in out and f"cannot write {tmp_path / 'no' / 'such.png'}" in err
    # A checkpoint with no span in the files: exit 1, and nothing drawn.
    other = tmp_path / "other.png"
    assert main(["trace", "ck-20261206T101505.916-000000", str(spans), "--png", str(other)]) == 1
    assert "no span of trace" in capsys.readouterr().err and not other.exists()
