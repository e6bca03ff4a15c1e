"""Traces across every actor process, exported over OTLP/HTTP to a real receiver this test starts.

Every actor is its own process on the real RabbitMQ; each exports its spans with the SDK's OTLP/HTTP
exporter (``OTEL_TRACES_EXPORTER=otlp``) to ``tests/support/otlp.py``, which decodes them with
``opentelemetry-proto``. The controller is SIGKILLed right after its second snapshot is published, the
rest of the cluster with it; a fresh cluster restores that snapshot and finishes the run. Then:

- each published snapshot is one trace whose id is derived from its checkpoint id (and is the one its
  manifest names), with a span for every save step, and a handling span of each participant for each
  command, each a child of the controller's step span in another process;
- the restore is one trace, linked to the snapshot it restored;
- a rollout the restore continued has its own trace, linked to the attempt it continues, whose turns
  (exported before the SIGKILL) and ``parked`` span (linked to the snapshot) the receiver holds.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections import defaultdict

import pytest
from parkway.protocol.snapshot import SAVE_SEQUENCE
from parkway.protocol.tracecontext import (
    checkpoint_span_id,
    checkpoint_trace_id,
    rollout_span_id,
    rollout_trace_id,
    span_id_hex,
    trace_id_hex,
)

from tests.support.crash_cluster import CONFIG, ROLES, cluster, start_driver
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

PARTICIPANTS = {f"{role}/{replica}" for role, replica in ROLES}


def by_trace(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    traces: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    return traces


async def test_one_trace_per_snapshot_across_every_process_and_a_rollout_across_a_crash(
    spawn, client, amqp_url, run_name, tmp_path, monkeypatch
) -> None:
    receiver = OtlpReceiver().start()
    try:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # a SIGKILL loses at most 0.1 s of spans
        config_path = tmp_path / "run.yaml"
        config_path.write_text(CONFIG)
        state = tmp_path / "state"

        first = await cluster(spawn, client, config_path, state)
        driver = start_driver(config_path, run_name, state, amqp_url, faults="after_publish@2")
        _, err = await asyncio.to_thread(driver.communicate, timeout=240)
        assert driver.returncode == -signal.SIGKILL, err[-3000:]
        [crashed] = sorted((state / "snapshots" / run_name).glob("snapshot_*"))[-1:]
        manifest = json.loads((crashed / "manifest.json").read_text())
        saved = [tuple(e) for e in manifest["episodes"]]
        assert saved, "the snapshot must catch rollouts mid-flight, or the crash half proves nothing"
        parked_name = f"parked by {manifest['checkpoint_id']}"
        # The agents' last batches leave within a schedule delay; on a loaded machine, give them longer.
        await until(lambda: sum(s.name == parked_name for s in receiver.snapshot()) >= len(saved), timeout=20)
        for actor in first:
            actor.kill()
        assert manifest["trace_id"] == trace_id_hex(checkpoint_trace_id(manifest["checkpoint_id"]))

        await cluster(spawn, client, config_path, state)
        driver = start_driver(config_path, run_name, state, amqp_url)
        out, err = await asyncio.to_thread(driver.communicate, timeout=240)
        assert driver.returncode == 0, err[-3000:]
        summary = json.loads(out)
        assert summary["restores"] == 1 and summary["rollouts_restored"] == len(saved)
        await until(lambda: any(s.name.startswith("restore ") for s in receiver.snapshot()), timeout=10)
    finally:
        receiver.stop()

    spans = receiver.snapshot()
    traces = by_trace(spans)
    by_id = {s.span_id: s for s in spans}

    # Every published snapshot that ran to its end: one trace, keyed by its checkpoint id.
    roots = [s for s in spans if s.name.startswith("snapshot ") and not s.parent_span_id]
    complete = []
    for root in roots:
        cid = root.attrs["parkway.checkpoint_id"]
        assert root.trace_id == trace_id_hex(checkpoint_trace_id(cid))
        assert root.span_id == span_id_hex(checkpoint_span_id(cid))
        assert root.service == "parkway-controller"
        steps = {s.name: s for s in traces[root.trace_id] if s.parent_span_id == root.span_id}
        if "publish" in steps:
            complete.append((cid, steps))
    assert len(complete) >= 2, f"published snapshots seen whole: {[c for c, _ in complete]}"
    for cid, steps in complete:
        assert set(steps) == {step.name.value for step in SAVE_SEQUENCE}, cid
        handled: dict[str, set[str]] = defaultdict(set)
        for span in traces[steps["prepare"].trace_id]:
            if span.attrs.get("parkway.phase") != "handled":
                continue
            parent = by_id[span.parent_span_id]
            assert (
                parent.service == "parkway-controller" and span.service != parent.service
            )  # across processes
            if span.name != "Ack":  # the acks the ack_drain step sends are data, with no checkpoint id
                assert span.attrs["parkway.checkpoint_id"] == cid, (span.name, parent.name)
            handled[span.name].add(span.attrs["parkway.actor"])
            # Only the agents prepare in the prepare step; TQ's Prepare and Commit are its capture, in
            # the window; the policy and the tool servers are prepared and committed after it.
            role = span.attrs["parkway.actor"].split("/")[0]
            step = {"agent": "prepare", "tq": "capture"}.get(role, "commit")
            assert parent.name == {
                "Prepare": step,
                "Commit": "capture" if role == "tq" else "commit",
                "Resume": "resume",
                "Persist": "persist",
            }.get(span.name, parent.name)
        assert handled["Prepare"] == PARTICIPANTS, cid
        assert handled["Commit"] == PARTICIPANTS, cid
        assert handled["Resume"] == PARTICIPANTS, cid
        assert handled["Persist"] == PARTICIPANTS, cid
        queued = [s for s in traces[steps["prepare"].trace_id] if s.attrs.get("parkway.phase") == "queued"]
        assert {s.attrs["parkway.actor"] for s in queued} == PARTICIPANTS

    # The restore: its own trace, linked to the snapshot it restored.
    [restore] = [s for s in spans if s.name.startswith("restore ")]
    assert restore.trace_id == trace_id_hex(checkpoint_trace_id(restore.attrs["parkway.checkpoint_id"]))
    assert (manifest["trace_id"], span_id_hex(checkpoint_span_id(manifest["checkpoint_id"]))) in {
        (t, s) for t, s, _ in restore.links
    }
    restored_by = {s.attrs.get("parkway.actor") for s in traces[restore.trace_id] if s.name == "Restore"}
    assert {"agent/0", "agent/1"} <= restored_by

    # A rollout the restore continued: linked to its earlier attempt, whose spans outlived the SIGKILL.
    continued = [s for s in spans if s.name.startswith("rollout ") and s.attrs.get("parkway.continuing")]
    assert {(s.attrs["parkway.rollout_id"], s.attrs["parkway.continues_attempt"]) for s in continued} == set(
        saved
    )
    for span in continued:
        rollout_id, earlier = span.attrs["parkway.rollout_id"], span.attrs["parkway.continues_attempt"]
        assert span.trace_id == trace_id_hex(rollout_trace_id(rollout_id, span.attrs["parkway.attempt"]))
        link = (
            trace_id_hex(rollout_trace_id(rollout_id, earlier)),
            span_id_hex(rollout_span_id(rollout_id, earlier)),
        )
        assert link in {(t, s) for t, s, _ in span.links}
        before = traces[link[0]]
        assert any(s.name.startswith("turn ") for s in before), f"{rollout_id}: no turn of attempt {earlier}"
        parked = [s for s in before if s.name == f"parked by {manifest['checkpoint_id']}"]
        assert parked and parked[0].links[0][0] == manifest["trace_id"]
        assert any(
            s.name.startswith("turn ") and s.attrs.get("parkway.replayed") for s in traces[span.trace_id]
        )
