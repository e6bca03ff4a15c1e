"""Actors in their own OS processes on the real RabbitMQ, killed with real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from parkway.actors.runtime.client import Client
from parkway.protocol.messages import Probe, ProbeResult

from tests.support.processes import status_of, wait_handling, wait_ready
from tests.support.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def probe_lines(state_root, role: str, checkpoint_id: str) -> list[str]:
    path = state_root / "state" / "state"
    log = next(path.glob(f"*/{role}/0/probe.log"), None)
    return (
        []
        if log is None
        else [line for line in log.read_text().splitlines() if line.split()[0] == checkpoint_id]
    )


async def test_sigkill_while_handling_redelivers_and_executes_once(spawn, client: Client, tmp_path) -> None:
    first = spawn("tq")
    await wait_ready(client, first)
    request = asyncio.ensure_future(
        client.request("tq/0", Probe(checkpoint_id="kill-1", deadline=time.time() + 60, work_s=1.5))
    )
    # Wait until this process is inside the handler, then kill it there.
    await wait_handling(client, "tq/0")
    first.signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    assert probe_lines(tmp_path, "tq", "kill-1") == []  # it died before the effect

    second = spawn("tq")
    reply = await request
    assert isinstance(reply, ProbeResult)
    assert (reply.pid, reply.executions) == (second.pid, 1)  # the restarted process ran it, once
    assert probe_lines(tmp_path, "tq", "kill-1") == [f"kill-1 {second.pid}"]
    await status_of(client, "tq/0")  # a later round trip with the same process: an extra reply would be here
    assert list(client.broker.duplicate_reply_ids) == []


async def test_sigkill_after_the_reply_is_journaled_is_answered_from_the_journal(
    spawn, client: Client, tmp_path
) -> None:
    doomed = spawn("tq", PARKWAY_FAULTS="after_reply_journaled:Probe")
    await wait_ready(client, doomed)
    request = asyncio.ensure_future(
        client.request("tq/0", Probe(checkpoint_id="kill-2", deadline=time.time() + 60))
    )
    assert (
        await asyncio.to_thread(doomed.wait) == -signal.SIGKILL
    )  # executed, journaled, died before replying
    assert not request.done()

    survivor = spawn("tq")
    reply = await request
    assert isinstance(reply, ProbeResult)
    assert (reply.pid, reply.executions) == (doomed.pid, 1)  # the original execution's reply, not a new one
    assert probe_lines(tmp_path, "tq", "kill-2") == [f"kill-2 {doomed.pid}"]
    status = await status_of(client, "tq/0")
    assert status.pid == survivor.pid and status.counts.get("replayed") == 1 and "Probe" not in status.counts
    assert list(client.broker.duplicate_reply_ids) == []


async def test_sigterm_finishes_the_handler_in_progress_and_exits_cleanly(spawn, client: Client) -> None:
    first = spawn("controller")
    await wait_ready(client, first)
    running = asyncio.ensure_future(
        client.request("controller/0", Probe(checkpoint_id="term-1", deadline=time.time() + 60, work_s=1.0))
    )
    await wait_handling(client, "controller/0")
    first.signal(signal.SIGTERM)
    await until(lambda: "actor_stopping" in first.log_text())  # paused: nothing new starts from here
    later = asyncio.ensure_future(
        client.request("controller/0", Probe(checkpoint_id="term-2", deadline=time.time() + 60))
    )
    finished = await running
    assert isinstance(finished, ProbeResult) and finished.pid == first.pid  # finished, not abandoned
    assert await asyncio.to_thread(first.wait) == 0
    assert "actor_stopped" in first.log_text()
    assert not later.done()  # left on the queue, not lost

    second = spawn("controller")
    answered = await later
    assert isinstance(answered, ProbeResult) and answered.pid == second.pid


async def test_sigterm_stops_a_policy_whose_engines_run_in_ray(spawn, client) -> None:
    # Ray installs its own SIGTERM handler when it starts; the service must still stop cleanly.
    policy = spawn("policy")
    await wait_ready(client, policy, timeout=60)
    policy.signal(signal.SIGTERM)
    assert await asyncio.to_thread(policy.wait, 60) == 0
    assert "actor_stopped" in policy.log_text()


async def test_an_actor_off_the_window_lowers_its_own_cpu_priority_and_still_answers(
    spawn, client: Client, tmp_path
) -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    by_env = spawn("tq", PARKWAY_NICE="5")
    by_flag = spawn("policy", args=("--nice", "7"), PARKWAY_NICE="2")  # the flag wins over the setting
    plain = spawn("resources")
    for process in (by_env, by_flag, plain):
        await wait_ready(client, process)
    assert os.getpriority(os.PRIO_PROCESS, by_env.pid) == min(own + 5, 19)
    assert os.getpriority(os.PRIO_PROCESS, by_flag.pid) == min(own + 7, 19)
    assert os.getpriority(os.PRIO_PROCESS, plain.pid) == own
    reply = await client.request("tq/0", Probe(checkpoint_id="nice-1", deadline=time.time() + 60))
    assert isinstance(reply, ProbeResult) and (reply.pid, reply.executions) == (by_env.pid, 1)
    assert (await status_of(client, "policy/0")).pid == by_flag.pid
