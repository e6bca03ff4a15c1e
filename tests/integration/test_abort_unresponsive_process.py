"""An aborted snapshot reopens admission when the abort is decided, not when a stopped participant
answers it.

Every actor is its own process on the real RabbitMQ; the controller is ``parkway run``. The agent (the
agents are who a snapshot's window waits for) stops itself with SIGSTOP in the middle of its second
Prepare (the fault point ``participant_prepare:agent=STOP@2``: inside the window, after the first
snapshot published), so that snapshot's prepare reaches its deadline and the snapshot is aborted. The
controller reopens the gate at once, while its Abort to the stopped agent is still in flight under
the same id. Only once the gate has reopened is the agent sent SIGCONT; its acknowledgement of that
Abort arrives later, and the next snapshot waits for the abort round to end before it prepares (a
participant still prepared for the old id must be aborted before it can prepare a new one). Asserted
on the order of the controller's log events, not on durations; the run completes with the transcripts
of a run that never stopped.
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

        def reopened_after_abort(events: list[dict[str, Any]]) -> bool:
            aborted = position(events, "snapshot_aborted")
            if aborted is None:
                return False
            cid = events[aborted]["checkpoint_id"]
            return position(events[aborted:], "gate_opened", checkpoint_id=cid) is not None

        reopened = await log.wait_for(reopened_after_abort, driver)
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert reopened, log.text()[-3000:]
    assert "parkway: fault point participant_prepare: stopped" in actors["agent"].log_text()
    events = log.events()
    aborted = position(events, "snapshot_aborted")
    assert aborted is not None
    cid = events[aborted]["checkpoint_id"]
    assert events[aborted]["step"] == "prepare" and "agent/0" in events[aborted]["detail"], events[aborted]

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
    assert decided < reopened_at < acked, (decided, reopened_at, acked)
    # The next snapshot prepares only after the abort round of the old id ended everywhere.
    ended = position(events, "abort_round_ended", checkpoint_id=cid)
    later = [i for i, e in enumerate(events) if e.get("event") == "gate_closed" and i > reopened_at]
    assert ended is not None and later and ended < later[0], (ended, later)
    assert position(events[ended:], "snapshot_published") is not None, "no snapshot after the abort"

    summary = json.loads(out)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] and summary["rollouts_failed"] == 0
    assert summary["transcripts_sha256"] == await embedded_digest(config, tmp_path / "reference")
