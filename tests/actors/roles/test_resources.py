"""The tool server over the in-memory broker: sessions, exactly-once calls, attempts, retirement.

Duplicates are sent with a new correlation id, as a retry after a lost reply is: the runtime's reply
cache answers a repeat of the same (correlation id, sender) before the handler runs, so only a new id
or a new sender reaches the session's own exactly-once check.
"""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from parkway.actors.roles.resources import Resources
from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    AttemptRef,
    Capabilities,
    Discover,
    Error,
    Forget,
    Message,
    Restore,
    Restored,
    Retire,
    Status,
    StatusReport,
    ToolCall,
    ToolResult,
)

from tests.support.signed import SECRET

RUN = "unit"
ADDRESS = "resources/0"


class Agent:
    """Sends tool calls the way an agent does, each request under a fresh correlation id."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.ids = itertools.count()

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        rollout_id: str = "r1",
        attempt: int = 0,
        call_index: int = 0,
        env: str = "bank",
        seed: int = 0,
        correlation_id: str | None = None,
    ) -> Message:
        call = ToolCall(
            rollout_id=rollout_id,
            attempt=attempt,
            call_index=call_index,
            env=env,
            tool=tool,
            arguments=arguments or {},
            seed=seed,
        )
        return await self.client.request(
            ADDRESS, call, correlation_id=correlation_id or f"tc-{next(self.ids)}"
        )

    async def ok(self, tool: str, arguments: dict[str, Any] | None = None, **kwargs: Any) -> ToolResult:
        result = await self.call(tool, arguments, **kwargs)
        assert isinstance(result, ToolResult) and result.ok, result
        return result

    async def refused(
        self, code: ErrorCode, tool: str, arguments: dict | None = None, **kwargs: Any
    ) -> Error:
        reply = await self.call(tool, arguments, **kwargs)
        assert isinstance(reply, Error) and reply.code is code, reply
        return reply


@pytest.fixture
async def setup(tmp_path: Path):
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET, snapshot_root=tmp_path)
        await actor.start()
        yield actor, Agent(Client(broker, secret=SECRET, sender="agent/0"))
        await actor.stop()


def soon() -> float:
    return time.time() + 10


def transfer(amount: int = 10, src: str = "a", dst: str = "b") -> dict[str, Any]:
    return {"src": src, "dst": dst, "amount": amount}


def balances(actor: Resources, rollout_id: str = "r1") -> dict[str, int]:
    return actor.sessions[rollout_id].env.state["balances"]


# -- the mode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exported", "stateless", "restart_only"])
async def test_discover_reports_the_mode(mode: str) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET, mode=mode)
        await actor.start()
        reply = await Client(broker, secret=SECRET, sender="controller/0").request(
            ADDRESS, Discover(checkpoint_id="d-1", deadline=soon())
        )
        await actor.stop()
    assert reply == Capabilities(role="resources", replica=0, mode=mode, restart_only=mode == "restart_only")


async def test_an_unknown_mode_is_refused() -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        with pytest.raises(ValueError, match="mode 'durable' is not one of"):
            Resources(broker, secret=SECRET, mode="durable")


# -- sessions and calls ------------------------------------------------------------------------


async def test_the_first_call_opens_a_session_and_mutations_bump_the_revision(setup) -> None:
    actor, agent = setup
    first = await agent.ok("balance", {"account": "a"}, seed=1234)
    assert first == ToolResult(
        rollout_id="r1", attempt=0, call_index=0, ok=True, output={"account": "a", "balance": 134}, revision=0
    )
    moved = await agent.ok("transfer", transfer(34), call_index=1, seed=1234)
    assert moved.output == {"a": 100, "b": 158} and moved.revision == 1
    read = await agent.ok("balance", {"account": "b"}, call_index=2, seed=1234)
    assert read.revision == 1  # reads do not count
    assert (await agent.ok("transfer", transfer(1), call_index=3, seed=1234)).revision == 2
    session = actor.sessions["r1"]
    assert session.attempt == 0 and session.revision == 2 and len(session.results) == 4
    assert actor.counts["sessions_opened"] == 1
    assert actor.counts["tool_calls"] == 4 and actor.counts["tool_mutations_applied"] == 2


async def test_sessions_are_per_rollout(setup) -> None:
    actor, agent = setup
    await agent.ok("increment", {"by": 5}, rollout_id="r1", env="counter", seed=2)
    await agent.ok("increment", {"by": 1}, rollout_id="r2", env="counter", seed=3)
    assert (await agent.ok("get", rollout_id="r1", call_index=1, env="counter", seed=2)).output == {
        "value": 7
    }
    assert (await agent.ok("get", rollout_id="r2", call_index=1, env="counter", seed=3)).output == {
        "value": 4
    }
    await agent.ok("add_todo", {"text": "x"}, rollout_id="r3", env="workplace")
    assert set(actor.sessions) == {"r1", "r2", "r3"} and actor.counts["sessions_opened"] == 3


async def test_a_tool_error_is_a_result_not_a_protocol_error(setup) -> None:
    actor, agent = setup
    result = await agent.call("transfer", transfer(1000))
    assert isinstance(result, ToolResult) and not result.ok and result.revision == 0
    assert "insufficient funds" in result.output["error"]
    unknown = await agent.call("rob", call_index=1)
    assert (
        isinstance(unknown, ToolResult) and not unknown.ok and "unknown tool 'rob'" in unknown.output["error"]
    )
    bad = await agent.call("transfer", {"src": "a", "dst": "b", "amount": True}, call_index=2)
    assert isinstance(bad, ToolResult) and not bad.ok and "must be an integer" in bad.output["error"]
    assert actor.sessions["r1"].revision == 0 and balances(actor) == {"a": 100, "b": 100, "c": 100}
    assert actor.counts["tool_mutations_applied"] == 0
    assert not any(k.startswith("error:") for k in actor.counts)


async def test_an_unknown_environment_is_an_invalid_message(setup) -> None:
    actor, agent = setup
    reply = await agent.refused(ErrorCode.INVALID_MESSAGE, "spin", env="casino")
    assert "unknown environment 'casino'" in reply.detail and "bank" in reply.detail
    assert actor.sessions == {} and actor.counts["sessions_opened"] == 0
    await agent.ok("transfer", transfer(10))
    await agent.refused(ErrorCode.INVALID_MESSAGE, "spin", env="casino", attempt=1)
    assert actor.sessions["r1"].attempt == 0 and balances(actor)["a"] == 90  # the live session stays
    assert actor.counts["sessions_retired"] == 0


async def test_a_call_naming_another_environment_than_its_session_is_refused(setup) -> None:
    actor, agent = setup
    await agent.ok("balance", {"account": "a"})
    await agent.refused(ErrorCode.INVALID_MESSAGE, "get", call_index=1, env="counter")
    await agent.refused(ErrorCode.INVALID_MESSAGE, "balance", {"account": "a"}, call_index=1, seed=9)
    assert actor.sessions["r1"].env.name == "bank"


# -- exactly once ------------------------------------------------------------------------------


async def test_a_duplicate_returns_the_same_result_and_applies_once(setup) -> None:
    actor, agent = setup
    first = await agent.ok("transfer", transfer(10), call_index=0)
    retried = await agent.ok("transfer", transfer(10), call_index=0)  # a new correlation id: the handler runs
    other_sender = await Agent(Client(agent.client.broker, secret=SECRET, sender="agent/0-new")).ok(
        "transfer", transfer(10), call_index=0
    )
    assert first == retried == other_sender
    assert balances(actor) == {"a": 90, "b": 110, "c": 100}  # moved once, not three times
    assert actor.sessions["r1"].revision == 1
    assert actor.counts["tool_mutations_applied"] == 1 and actor.counts["tool_duplicates"] == 2
    # And the record the agent keeps verifies: the state is exactly one transfer.
    calls = [{"tool": "transfer", "arguments": transfer(10), "output": first.output}]
    assert (await agent.ok("verify", {"calls": calls}, call_index=1)).output == {"reward": 1.0}


async def test_calls_that_take_time_still_apply_once_when_delivered_twice_at_once(tmp_path: Path) -> None:
    import asyncio

    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET, snapshot_root=tmp_path, tool_delay_s=0.05)
        await actor.start()
        agent = Agent(Client(broker, secret=SECRET, sender="agent/0"))
        # Both deliveries are inside the tool's own time together; the check and the apply come after.
        first, second = await asyncio.gather(
            agent.ok("transfer", transfer(10), call_index=0), agent.ok("transfer", transfer(10), call_index=0)
        )
        released = await agent.ok("release", call_index=1)
        await actor.stop()
    assert first == second and released.output == {"released": True}
    assert actor.counts["tool_mutations_applied"] == 1 and actor.counts["tool_duplicates"] == 1


async def test_a_redelivery_with_the_same_correlation_id_is_answered_by_the_runtime(setup) -> None:
    actor, agent = setup
    first = await agent.ok("transfer", transfer(10), correlation_id="tc-same")
    again = await agent.ok("transfer", transfer(10), correlation_id="tc-same")
    assert first == again and balances(actor)["a"] == 90
    assert actor.counts["tool_calls"] == 1 and actor.counts["replayed"] == 1


async def test_a_failed_call_is_answered_the_same_when_repeated(setup) -> None:
    actor, agent = setup
    failed = await agent.call("transfer", transfer(150), call_index=0)
    await agent.ok("transfer", transfer(60, src="b", dst="a"), call_index=1)  # now a could pay 150
    again = await agent.call("transfer", transfer(150), call_index=0)
    assert isinstance(failed, ToolResult) and not failed.ok and again == failed
    assert balances(actor) == {"a": 160, "b": 40, "c": 100}


async def test_a_call_index_reused_for_another_call_is_refused(setup) -> None:
    actor, agent = setup
    await agent.ok("transfer", transfer(10), call_index=0)
    reply = await agent.refused(ErrorCode.INVALID_MESSAGE, "transfer", transfer(20), call_index=0)
    assert "a call index names one call" in reply.detail
    assert balances(actor)["a"] == 90


# -- attempts ----------------------------------------------------------------------------------


async def test_a_call_from_an_older_attempt_is_stale(setup) -> None:
    actor, agent = setup
    await agent.ok("transfer", transfer(10), attempt=2)
    reply = await agent.refused(ErrorCode.STALE_ATTEMPT, "transfer", transfer(10), attempt=1, call_index=1)
    assert "replaced by attempt 2" in reply.detail and not reply.retryable
    assert balances(actor)["a"] == 90 and actor.sessions["r1"].attempt == 2


async def test_a_newer_attempt_starts_a_fresh_session(setup) -> None:
    actor, agent = setup
    await agent.ok("transfer", transfer(10), attempt=0, call_index=0)
    await agent.ok("transfer", transfer(10), attempt=0, call_index=1)
    retry = await agent.ok("transfer", transfer(10), attempt=1, call_index=0)
    assert retry.output == {"a": 90, "b": 110} and retry.revision == 1  # from the initial state again
    session = actor.sessions["r1"]
    assert session.attempt == 1 and list(session.results) == [(1, 0)]
    assert actor.counts["sessions_opened"] == 2 and actor.counts["sessions_retired"] == 1
    await agent.refused(ErrorCode.STALE_ATTEMPT, "balance", {"account": "a"}, attempt=0, call_index=2)


# -- verify and release ------------------------------------------------------------------------


async def test_verify_scores_and_retires(setup) -> None:
    actor, agent = setup
    moved = await agent.ok("transfer", transfer(10), call_index=0)
    read = await agent.ok("balance", {"account": "a"}, call_index=1)
    calls = [
        {"tool": "transfer", "arguments": transfer(10), "output": moved.output},
        {"tool": "balance", "arguments": {"account": "a"}, "output": read.output},
    ]
    verified = await agent.ok("verify", {"calls": calls}, call_index=2)
    assert verified.output == {"reward": 1.0} and verified.revision == 1
    assert actor.sessions["r1"].retired and ("r1", 0) in actor.retired
    assert actor.counts["sessions_retired"] == 1
    # Verify is idempotent: a repeat gets the same answer, under whatever index it was sent.
    assert await agent.ok("verify", {"calls": calls}, call_index=2) == verified
    assert (await agent.ok("verify", {"calls": []}, call_index=7)).output == {"reward": 1.0}
    assert actor.counts["sessions_retired"] == 1


async def test_verify_sees_a_record_that_does_not_match(setup) -> None:
    _, agent = setup
    await agent.ok("transfer", transfer(10), call_index=0)
    await agent.ok("transfer", transfer(10), call_index=1)
    calls = [{"tool": "transfer", "arguments": transfer(10), "output": {}}]  # the agent lost one
    assert (await agent.ok("verify", {"calls": calls}, call_index=2)).output == {"reward": 0.0}


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({}, "exactly one argument, 'calls'"),
        ({"calls": [], "extra": 1}, "exactly one argument, 'calls'"),
        ({"calls": "all of them"}, "'calls' must be a list"),
        ({"calls": [{"tool": "transfer"}]}, "calls\\[0\\] must be an object"),
        ({"calls": [{"tool": 3, "arguments": {}, "output": {}}]}, "calls\\[0\\] must be an object"),
        ({"calls": [{"tool": "steal", "arguments": {}, "output": {}}]}, "unknown tool 'steal'"),
    ],
)
async def test_a_malformed_verify_is_a_tool_error_and_keeps_the_session(setup, arguments, match) -> None:
    actor, agent = setup
    await agent.ok("transfer", transfer(10), call_index=0)
    result = await agent.call("verify", arguments, call_index=1)
    assert isinstance(result, ToolResult) and not result.ok
    assert re.search(match, result.output["error"])
    assert not actor.sessions["r1"].retired
    assert (await agent.ok("balance", {"account": "a"}, call_index=2)).output["balance"] == 90


async def test_release_retires_without_a_score(setup) -> None:
    actor, agent = setup
    await agent.ok("transfer", transfer(10), call_index=0)
    released = await agent.ok("release", call_index=1)
    assert released.output == {"released": True} and released.revision == 1
    assert actor.sessions["r1"].retired and actor.counts["sessions_retired"] == 1
    assert await agent.ok("release", call_index=1) == released
    # A verify after the release gets the release's answer: there is no state left to score.
    assert (await agent.ok("verify", {"calls": []}, call_index=2)).output == {"released": True}


async def test_release_works_whatever_index_it_comes_with(setup) -> None:
    actor, agent = setup
    # The agent lost the reply of call 0 (applied here) and releases under the index it never finished.
    await agent.ok("transfer", transfer(10), call_index=0)
    released = await agent.ok("release", call_index=0)
    assert released.output == {"released": True} and actor.sessions["r1"].retired


async def test_a_late_call_after_retirement_is_stale_and_reopens_nothing(setup) -> None:
    actor, agent = setup
    await agent.ok("transfer", transfer(10), call_index=0)
    await agent.ok(
        "verify", {"calls": [{"tool": "transfer", "arguments": transfer(10), "output": {}}]}, call_index=1
    )
    # The same call again (a late redelivery) and a new one: both refused, the balances untouched.
    await agent.refused(ErrorCode.STALE_ATTEMPT, "transfer", transfer(10), call_index=0)
    reply = await agent.refused(ErrorCode.STALE_ATTEMPT, "transfer", transfer(5), call_index=2)
    assert "is retired" in reply.detail
    assert balances(actor)["a"] == 90 and actor.counts["sessions_opened"] == 1
    await agent.refused(ErrorCode.STALE_ATTEMPT, "balance", {"account": "a"}, attempt=0, call_index=3)
    # A newer attempt of the same rollout starts afresh.
    assert (await agent.ok("balance", {"account": "a"}, attempt=1)).output["balance"] == 100


async def test_the_controller_retires_and_forgets_attempts(setup) -> None:
    actor, agent = setup
    controller = Client(agent.client.broker, secret=SECRET, sender="controller/0")
    await agent.ok("transfer", transfer(10), call_index=0)
    refs = (AttemptRef(rollout_id="r1", attempt=0), AttemptRef(rollout_id="r2", attempt=0))
    await controller.call(ADDRESS, Retire(checkpoint_id="rt-1", deadline=soon(), attempts=refs))
    assert actor.sessions["r1"].retired and actor.counts["sessions_retired"] == 1
    await agent.refused(ErrorCode.STALE_ATTEMPT, "balance", {"account": "a"}, call_index=1)
    await agent.refused(ErrorCode.STALE_ATTEMPT, "verify", {"calls": []}, call_index=1)  # no ending to repeat
    await agent.refused(ErrorCode.STALE_ATTEMPT, "balance", {"account": "a"}, rollout_id="r2")  # never opened
    assert "r2" not in actor.sessions
    await controller.call(ADDRESS, Forget(checkpoint_id="fg-1", deadline=soon(), attempts=refs))
    assert actor.sessions == {} and not actor.retired


# -- status and logs ---------------------------------------------------------------------------


async def test_the_counts_go_out_in_status(setup) -> None:
    _, agent = setup
    moved = await agent.ok("transfer", transfer(10), call_index=0)
    await agent.ok("transfer", transfer(10), call_index=0)
    calls = [{"tool": "transfer", "arguments": transfer(10), "output": moved.output}]
    await agent.ok("verify", {"calls": calls}, call_index=1)
    report = await agent.client.request(ADDRESS, Status(checkpoint_id="s-1", deadline=soon()))
    assert isinstance(report, StatusReport)
    assert {k: report.counts[k] for k in report.counts if not k[0].isupper()} == {
        "tool_calls": 3,
        "tool_mutations_applied": 1,
        "tool_duplicates": 1,
        "sessions_opened": 1,
        "sessions_retired": 1,
    }
    assert report.counts["ToolCall"] == 3


async def test_tool_calls_log_at_debug_only(setup) -> None:
    _, agent = setup
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await agent.ok("transfer", transfer(10), call_index=0)
    [line] = [e for e in logs if e["event"] == "tool_call"]
    assert line["log_level"] == "debug" and line["rollout_id"] == "r1" and line["attempt"] == 0
    assert line["tool"] == "transfer" and line["revision"] == 1
    assert [e for e in logs if e["log_level"] not in ("debug",)] == []


async def test_a_server_that_lost_a_session_refuses_the_rest_of_it(setup) -> None:
    # The chaos harness found this: a resources process killed alone came back empty and answered the
    # next calls of a running rollout from a fresh state, so the transfers before the crash were lost
    # and the rollout sealed with reward 0.0. A session only opens at its first call.
    actor, agent = setup
    reply = await agent.refused(ErrorCode.STALE_ATTEMPT, "transfer", transfer(10), call_index=3)
    assert "holds no session of r1 attempt 0: call 3 cannot continue it" in reply.detail
    assert not reply.retryable and actor.sessions == {} and actor.counts["tool_mutations_applied"] == 0
    await agent.refused(ErrorCode.STALE_ATTEMPT, "verify", {"calls": []}, call_index=4)
    assert (await agent.ok("release", call_index=4)).output == {"released": True}  # clean-up still works
    await agent.ok("transfer", transfer(10), attempt=1, call_index=0)  # the redo starts from its prompt
    assert actor.sessions["r1"].attempt == 1 and balances(actor)["a"] == 90


async def test_a_session_a_restore_closes_counts_as_ended(tmp_path: Path) -> None:
    """A fresh server may open a session for work left queued by the cluster that died, before the
    restore reaches it: the restore closes it, and it is counted ended, not leaked."""
    saved = tmp_path / RUN / "snapshot_1" / "participants" / "resources" / "0"
    saved.mkdir(parents=True)
    (saved / "sessions.msgpack").write_bytes(msgspec.msgpack.encode([]))
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(broker, secret=SECRET, snapshot_root=tmp_path)
        await actor.start()
        agent = Agent(Client(broker, secret=SECRET, sender="agent/0"))
        await agent.ok("balance", {"account": "a"}, seed=1234)  # a stale Run's first call
        controller = Client(broker, secret=SECRET, sender="controller/0")
        restored = await controller.request(
            ADDRESS, Restore(checkpoint_id="rs-1", deadline=soon(), location="snapshot_1")
        )
        assert isinstance(restored, Restored), restored
        assert not actor.sessions
        assert actor.counts["sessions_opened"] == actor.counts["sessions_retired"] == 1
        await actor.stop()
