"""An aborted snapshot never holds admission for a participant that does not answer.

Every actor is its own process on the real RabbitMQ; the controller is ``parkway run``. The agent stops
itself with SIGSTOP in the middle of its second Prepare (the fault point
``participant_prepare:agent=STOP@2``, after the first snapshot published), so that snapshot's
``prepared`` step reaches its deadline and the snapshot is aborted. Admission reopened at the
snapshot's instant, long before: the gate opened before the abort was decided, and the Abort to the
stopped agent is in flight under the same id meanwhile. Only once the abort is decided is the agent
sent SIGCONT; its acknowledgement of that Abort arrives later, and the next snapshot waits for the
abort round to end before it closes its gate (a participant still prepared for the old id must be
aborted before it can prepare a new one). Asserted on the order of the controller's log events, not
on durations; the run completes with the transcripts of a run that never stopped.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from tests.support.embedded import embedded_digest
from tests.support.processes import start_driver, wait_ready
from tests.support.storage_run import CONFIG
from tests.support.streams import LogLines

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

# A 3 s snapshot deadline; rollouts three at a time, so that the run outlasts the stopped agent.
STOPPED_CONFIG = (
    CONFIG.replace("prepare_timeout_s: 10", "prepare_timeout_s: 3")
    .replace("max_turns: 6}", "max_turns: 6, max_in_flight: 3}")
    .replace("limit: 2", "limit: 4")
)


def position(events: list[dict[str, Any]], event: str, **fields: Any) -> int | None:
    """The index of the first ``event`` whose fields include ``fields``."""
    for i, e in enumerate(events):
        if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()):
            return i
    return None


async def test_the_gate_reopens_when_the_abort_is_decided_not_when_a_stopped_agent_answers(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(STOPPED_CONFIG)
    state = tmp_path / "state"
    args = ("--config", str(config))
    actors = {role: spawn(role, 0, args=args) for role in ("tq", "policy", "resources")}
    actors["agent"] = spawn("agent", 0, args=args, PARKWAY_FAULTS="participant_prepare:agent=STOP@2")
    for actor in actors.values():
        await wait_ready(client, actor, timeout=60)
    stopped = actors["agent"].pid

    driver = start_driver(config, run_name, state, amqp_url)
    assert driver.stderr is not None
    log = LogLines(driver.stderr)
    try:

        def abort_decided(events: list[dict[str, Any]]) -> bool:
            return position(events, "snapshot_aborted") is not None

        decided_in_time = await log.wait_for(abort_decided, driver)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert decided_in_time, log.text()[-3000:]
    assert "parkway: fault point participant_prepare: stopped" in actors["agent"].log_text()
    events = log.events()
    aborted = position(events, "snapshot_aborted")
    assert aborted is not None
    cid = events[aborted]["checkpoint_id"]
    assert events[aborted]["step"] == "prepared" and "agent/0" in events[aborted]["detail"], events[aborted]

    def agent_acknowledged(events: list[dict[str, Any]]) -> bool:
        return position(events, "abort_acknowledged", checkpoint_id=cid, participant="agent/0") is not None

    acknowledged = await log.wait_for(agent_acknowledged, driver)
    out, _ = driver.communicate(timeout=240)
    log.finish()
    events = log.events()
    assert acknowledged, (
        f"no acknowledgement of the Abort from agent/0 after the gate reopened: {log.text()[-3000:]}"
    )
    assert driver.returncode == 0, log.text()[-3000:]

    decided = position(events, "snapshot_aborted", checkpoint_id=cid)
    reopened_at = position(events, "gate_opened", checkpoint_id=cid)
    acked = position(events, "abort_acknowledged", checkpoint_id=cid, participant="agent/0")
    assert decided is not None and reopened_at is not None and acked is not None
    # Open at the instant: before the abort was decided, and before the stopped agent answered it.
    assert reopened_at < decided < acked, (reopened_at, decided, acked)
    # The next snapshot prepares only after the abort round of the old id ended everywhere.
    ended = position(events, "abort_round_ended", checkpoint_id=cid)
    later = [i for i, e in enumerate(events) if e.get("event") == "gate_closed" and i > reopened_at]
    assert ended is not None and later and ended < later[0], (ended, later)
    assert position(events[ended:], "snapshot_published") is not None, "no snapshot after the abort"

    summary = json.loads(out)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] and summary["rollouts_failed"] == 0
    assert summary["transcripts_sha256"] == await embedded_digest(config, tmp_path / "reference")
