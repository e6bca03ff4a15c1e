"""Agent replicas (``agent/N``): run the multi-turn loop of each rollout they are given.

A ``Run`` starts one attempt as a task (the delivery is acked at once: a rollout can take hours, far
longer than a broker should hold a message). The attempt runs an ``AgentProgram`` (``programs.py``)
through a ``RolloutContext``; its end is a receipt for the controller, ``Completed`` or ``Failed``,
kept and re-sent until the controller acknowledges it (``Ack``, idempotent). ``Retire`` stops
attempts the controller gave up on and releases their tool sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog
from parkway.actors.participant import Participant
from parkway.actors.programs import PROGRAMS
from parkway.actors.rollout import RolloutContext, RolloutFailure, ToolOutcome
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import capture_key
from parkway.protocol.messages import (
    Ack,
    Completed,
    Error,
    Failed,
    Generate,
    Generated,
    Message,
    Ok,
    Retire,
    Run,
    ToolCall,
    ToolResult,
)

log = structlog.get_logger("parkway.agent")

AttemptKey = tuple[str, int]
CALL_TIMEOUT_S = 600.0  # a model or tool call that takes longer is a failure of the attempt


class Agent(Participant):
    role = "agent"
    prefetch = 256

    def __init__(
        self,
        *args: Any,
        policy_address: str = "policy/0",
        controller_address: str = "controller/0",
        resend_after_s: float = 2.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.policy_address = policy_address
        self.controller_address = controller_address
        self.resend_after_s = resend_after_s
        self.running: dict[AttemptKey, asyncio.Task[None]] = {}
        self.latest_attempt: dict[str, int] = {}
        self.unacked: dict[AttemptKey, tuple[Completed | Failed, float]] = {}
        self._resender: asyncio.Task[None] | None = None
        self.handlers.update({Run: self.on_run, Ack: self.on_ack})

    async def start(self) -> None:
        await super().start()
        self._resender = asyncio.get_running_loop().create_task(self._resend_unacked())

    async def stop(self) -> None:
        if self._resender is not None:
            self._resender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resender
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        await super().stop()

    def status_extras(self) -> dict[str, Any]:
        extras = super().status_extras()
        extras["in_flight"] = len(self.running)
        return extras

    # -- handlers ------------------------------------------------------------------------------
    async def on_run(self, run: Run) -> None:
        key = (run.rollout_id, run.attempt)
        if (
            key in self.running
            or key in self.unacked
            or self.latest_attempt.get(run.rollout_id, -1) > run.attempt
        ):
            self.counts["runs_duplicate"] += (
                1  # a redelivered or stale Run: the attempt exists or is replaced
            )
            return
        self.latest_attempt[run.rollout_id] = run.attempt
        task = asyncio.get_running_loop().create_task(self._drive(run))
        self.running[key] = task
        task.add_done_callback(lambda _: self.running.pop(key, None))

    async def on_ack(self, ack: Ack) -> None:
        for ref in ack.receipts:
            if self.unacked.pop((ref.rollout_id, ref.attempt), None) is not None:
                self.counts["receipts_acked"] += 1

    async def on_retire(self, command: Retire) -> Message:
        stopped = 0
        for ref in command.attempts:
            task = self.running.get((ref.rollout_id, ref.attempt))
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                stopped += 1
        await super().on_retire(command)
        return Ok(detail=f"stopped {stopped} of {len(command.attempts)}")

    # -- one attempt ---------------------------------------------------------------------------
    async def _drive(self, run: Run) -> None:
        from parkway.actors.environments import ENVIRONMENTS  # the resources' tool catalogue

        key = (run.rollout_id, run.attempt)
        ck = capture_key(run.rollout_id, run.attempt)
        resources = f"resources/{run.task.get('resources', self.replica)}"
        with structlog.contextvars.bound_contextvars(rollout_id=run.rollout_id, attempt=run.attempt):
            env = ENVIRONMENTS.get(run.env)
            program_cls = PROGRAMS.get(str(run.task.get("agent", "tool")))
            ctx = RolloutContext(
                run=run,
                tools=env.tools if env is not None else (),
                _generate=lambda index, tokens: self._generate(run, ck, index, tokens),
                _call_tool=lambda index, tool, args: self._call_tool(run, ck, resources, index, tool, args),
                _boundary=self._at_boundary,
            )
            receipt: Completed | Failed
            try:
                if env is None:
                    raise RolloutFailure("unknown_env", f"no environment {run.env!r}")
                if program_cls is None:
                    raise RolloutFailure("unknown_agent", f"no agent program {run.task.get('agent')!r}")
                reward = await program_cls().run(ctx)
                receipt = Completed(
                    rollout_id=run.rollout_id,
                    attempt=run.attempt,
                    capture_key=ck,
                    reward=reward,
                    turns=ctx.turns,
                    staging_keys=tuple(f"{ck}:{i}" for i in range(ctx.model_calls)),
                )
                self.counts["rollouts_completed"] += 1
            except asyncio.CancelledError:
                self.counts["rollouts_retired"] += 1
                await self._release(run, ck, resources, ctx.tool_calls)
                raise
            except RolloutFailure as failure:
                receipt = self._failed(run, failure.code, failure.detail, ctx)
                await self._release(run, ck, resources, ctx.tool_calls)
            except Exception as exc:  # a bug in a program is that attempt's failure, not the agent's death
                log.exception("program_failed")
                receipt = self._failed(run, "agent_error", f"{type(exc).__name__}: {exc}", ctx)
                await self._release(run, ck, resources, ctx.tool_calls)
            self.unacked[key] = (receipt, time.monotonic())
            await self._send_receipt(receipt)

    def _failed(self, run: Run, code: str, detail: str, ctx: RolloutContext) -> Failed:
        self.counts["rollouts_failed"] += 1
        log.info("rollout_failed", code=code, detail=detail, turns=ctx.turns)
        return Failed(
            rollout_id=run.rollout_id, attempt=run.attempt, code=code, detail=detail, turns=ctx.turns
        )

    async def _at_boundary(self) -> None:
        self.counts["boundaries"] += 1

    async def _generate(self, run: Run, ck: str, index: int, tokens: tuple[int, ...]) -> Generated:
        request = Generate(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            token_ids=tokens,
            seed=run.seed,
            max_tokens=int(run.task.get("max_tokens", 160)),  # type: ignore[arg-type]
            policy_version=run.policy_version,
        )
        reply = await self._request(self.policy_address, request, f"{ck}:{index}")
        if not isinstance(reply, Generated):
            raise RolloutFailure("policy_error", f"unexpected reply {type(reply).__name__}")
        return reply

    async def _call_tool(
        self, run: Run, ck: str, resources: str, index: int, tool: str, arguments: dict[str, object]
    ) -> ToolOutcome:
        call = ToolCall(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            env=run.env,
            tool=tool,
            arguments=arguments,
            seed=run.seed,
        )
        reply = await self._request(resources, call, f"{ck}:t{index}")
        if not isinstance(reply, ToolResult):
            raise RolloutFailure("resources_error", f"unexpected reply {type(reply).__name__}")
        return ToolOutcome(reply.ok, dict(reply.output))

    async def _request(self, address: str, message: Message, correlation_id: str) -> Message:
        try:
            reply = await self.client.request(
                address, message, correlation_id=correlation_id, deadline=time.time() + CALL_TIMEOUT_S
            )
        except (ProtocolError, BrokerError, OSError) as exc:
            raise RolloutFailure("call_failed", f"{address}: {exc}") from exc
        if isinstance(reply, Error):
            raise RolloutFailure(reply.code.value, f"{address}: {reply.detail}")
        return reply

    async def _release(self, run: Run, ck: str, resources: str, index: int) -> None:
        """A rollout that ends without verify still retires its tool session (no leaked sessions)."""
        call = ToolCall(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            env=run.env,
            tool="release",
            seed=run.seed,
        )
        with contextlib.suppress(Exception):
            await self.client.request(
                resources, call, correlation_id=f"{ck}:release", deadline=time.time() + 10
            )

    async def _send_receipt(self, receipt: Completed | Failed) -> None:
        ck = capture_key(receipt.rollout_id, receipt.attempt)
        try:
            await self.client.send(self.controller_address, receipt, correlation_id=ck)
        except Exception as exc:  # kept in unacked: the resender tries again
            log.warning("receipt_not_sent", error=str(exc))

    async def _resend_unacked(self) -> None:
        while True:
            await asyncio.sleep(self.resend_after_s)
            now = time.monotonic()
            for key, (receipt, sent_at) in list(self.unacked.items()):
                if now - sent_at >= self.resend_after_s:
                    self.unacked[key] = (receipt, now)
                    self.counts["receipts_resent"] += 1
                    await self._send_receipt(receipt)
