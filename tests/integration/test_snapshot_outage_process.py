"""A state directory that cannot be written for a while does not end the run it protects.

Every actor is its own process on the real RabbitMQ; the controller is ``parkway run``. After the
first snapshot is published, the run's snapshot directory is moved away and a plain file put in its
place (the tests run as root, so a chmod would not stop a write): every participant's commit and the
controller's own writes fail with a real ``OSError``. Snapshots fail, back off and retry while the
rollouts go on (rollouts seal between the failures); once three have failed in a row the directory
comes back, the next attempt publishes, and the run completes with the transcripts of a run that
never failed, with the default policy (``snapshots.end_after_failures: null``: never end the run).
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from tests.support.embedded import embedded_digest
from tests.support.processes import start_driver, status_of, wait_ready
from tests.support.storage_run import CONFIG
from tests.support.streams import LogLines

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

# Longer than the disk-full test's workload, three rollouts at a time so that they seal one wave after
# another: the outage, its retries and seals all happen while rollouts run. The back-off is capped at
# 1 s so that the first retry after the outage comes while rollouts still run.
OUTAGE_CONFIG = (
    CONFIG.replace("limit: 2", "limit: 4").replace("max_turns: 6}", "max_turns: 6, max_in_flight: 3}")
    + "snapshots: {backoff_max_s: 1.0}\n"
)


def named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == name]


async def test_snapshots_fail_back_off_and_retry_while_the_run_goes_on(
    spawn, client, amqp_url, run_name, tmp_path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(OUTAGE_CONFIG)
    state = tmp_path / "state"
    args = ("--config", str(config))
    actors = [spawn(role, 0, args=args) for role in ("tq", "policy", "resources", "agent")]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)

    driver = start_driver(config, run_name, state, amqp_url)
    assert driver.stderr is not None
    log = LogLines(driver.stderr)
    run_dir, away = state / "snapshots" / run_name, tmp_path / "snapshots-away"
    assert await log.wait_for(lambda events: bool(named(events, "snapshot_published")), driver), log.text()[
        -3000:
    ]

    shutil.move(run_dir, away)
    run_dir.write_text("the state directory is not writable\n")  # every mkdir and write under it fails

    def outage_long_enough(events: list[dict[str, Any]]) -> bool:
        failed = named(events, "snapshot_failed")
        return len(failed) >= 3 and failed[-1]["rollouts_sealed"] > failed[0]["rollouts_sealed"]

    still_running = await log.wait_for(outage_long_enough, driver)
    if still_running:  # what `parkway status` shows for the controller during the outage
        health = (await status_of(client, "controller/0")).snapshots
        assert health is not None and health.consecutive_failures >= 3, health
        assert health.newest_snapshot == "snapshot_1" and health.newest_published_at is not None
        assert health.last_failure_reason is not None and "Not a directory" in health.last_failure_reason
        assert health.next_attempt_at is not None and health.last_failure_at is not None
    run_dir.unlink()
    shutil.move(away, run_dir)
    assert still_running and driver.poll() is None, f"the run ended during the outage: {log.text()[-2000:]}"

    out, _ = driver.communicate(timeout=240)
    log.finish()
    assert driver.returncode == 0, log.text()[-3000:]
    events = log.events()
    failed = named(events, "snapshot_failed")
    assert [e["consecutive"] for e in failed[:3]] == [1, 2, 3], failed
    assert all(e["transient"] and "Not a directory" in e["detail"] for e in failed), failed
    waits = [e["retry_in_s"] for e in failed[:3]]
    assert waits == sorted(waits) and waits[0] < waits[2], waits  # exponential back-off, capped
    last_failure = events.index(failed[-1])
    assert named(events[last_failure:], "snapshot_published"), "no snapshot published after the outage"
    assert not named(events, "snapshots_ended")

    summary = json.loads(out)
    assert summary["snapshots_failed"] >= 3 and summary["rollouts_failed"] == 0
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 12
    assert summary["transcripts_sha256"] == await embedded_digest(config, tmp_path / "reference")
