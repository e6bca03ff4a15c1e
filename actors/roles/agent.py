"""Agent replicas (``agent/N``): run the multi-turn loop of each rollout they are given.

A ``Run`` starts one attempt as a task (the delivery is acked at once: a rollout can take hours, far
longer than a broker should hold a message). The attempt runs an ``AgentProgram`` (``programs.py``)
through a ``RolloutContext``; its end is a receipt for the controller, ``Completed`` or ``Failed``,
kept and re-sent until the controller acknowledges it (``Ack``, idempotent). ``Retire`` stops
attempts the controller gave up on and releases their tool sessions.

Checkpoints. A rollout is parked when it waits at a boundary (before a model call, after a tool round)
or waits for a model reply issued right after one. Prepare holds every rollout at its next boundary
and answers once all are parked; a tool call in flight is waited for. Commit saves each rollout's
transcript up to its boundary (``transcript.py``); Restore loads them, and the controller's ``Run``
for attempt N+1 continues each from there by replaying the saved calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog
from msgspec import UNSET, UnsetType
from parkway.actors.runtime.participant import ParkReport, Participant
from parkway.actors.sdk import chat
from parkway.actors.sdk.programs import PROGRAMS
from parkway.actors.sdk.rollout import RolloutContext, RolloutFailure, ToolOutcome
from parkway.brokers.base import BrokerError, RequestTimeout
from parkway.protocol.errors import ProtocolError
from parkway.protocol.history import (
    CallRecord,
    ContinuationRestored,
    ModelCallReplayed,
    ModelCallSent,
    ModelReplyReceived,
    Receipt,
    ReceiptAcked,
    RolloutStopped,
    RunReceived,
    SnapshotInstalled,
    ToolCallReplayed,
    ToolCallSent,
    ToolResultReceived,
)
from parkway.protocol.ids import capture_key, staging_key
from parkway.protocol.messages import (
    Ack,
    AttemptRef,
    Commit,
    Completed,
    EpisodeRef,
    Error,
    Failed,
    FileDigest,
    Generate,
    Generated,
    Message,
    Ok,
    Restore,
    Retire,
    Run,
    ToolCall,
    ToolResult,
)
from parkway.protocol.transcript import ModelStep, SavedRollout, ToolStep, prompt_digest

log = structlog.get_logger("parkway.agent")

AttemptKey = tuple[str, int]
CALL_TIMEOUT_S = 600.0  # a model or tool call that takes longer is a failure of the attempt
# Pauses before a call is sent again after a broker error (its reply was lost with the connection).
TRANSPORT_RETRIES_S = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)

RUNNING, AT_BOUNDARY, AWAITING_MODEL, IN_TOOL = "running", "boundary", "model", "tool"
PARKED_STATES = frozenset({AT_BOUNDARY, AWAITING_MODEL})


CallKind = TypeVar("CallKind", bound=CallRecord)


def _about_call(kind: type[CallKind], run: Run, index: int) -> CallKind:
    """A history record of model call ``index`` of ``run``'s attempt."""
    return kind(rollout_id=run.rollout_id, attempt=run.attempt, call_index=index)


def _received(run: Run, outcome: str, continue_from: int | UnsetType | None = UNSET) -> RunReceived:
    """The history record of a Run received: accepted (with the turns it continues from), or not."""
    return RunReceived(
        rollout_id=run.rollout_id,
        attempt=run.attempt,
        epoch=run.epoch,
        outcome=outcome,
        continue_from=continue_from,
    )


@dataclass
class LiveRollout:
    """One attempt in progress: where it is, and its transcript (all of it, and up to its boundary)."""

    run: Run
    state: str = RUNNING
    model: list[ModelStep] = field(default_factory=list)
    tools: list[ToolStep] = field(default_factory=list)
    mark: tuple[int, int, int] = (0, 0, 0)  # (model steps, tool steps, boundaries) at the last boundary
    replay: SavedRollout | None = None
    # The turn in progress, (index, replayed, perf_counter at its start): logged for ``parkway report``.
    turn: tuple[int, bool, float] | None = None

    def saved(self) -> SavedRollout:
        models, tools, boundaries = self.mark
        return SavedRollout(
            run=self.run,
            model=tuple(self.model[:models]),
            tools=tuple(self.tools[:tools]),
            boundaries=boundaries,
        )


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
        self.live: dict[AttemptKey, LiveRollout] = {}
        self.latest_attempt: dict[str, int] = {}
        self.unacked: dict[AttemptKey, tuple[Completed | Failed, float]] = {}
        self.continuations: dict[str, SavedRollout] = {}  # restored, waiting for their Run
        self.epoch = 0  # the newest controller incarnation seen (Run or Restore)
        self._released = asyncio.Event()  # set while no checkpoint holds the rollouts
        self._released.set()
        self._park_changed = asyncio.Event()
        self._resender: asyncio.Task[None] | None = None
        self.handlers.update({Run: self.on_run, Ack: self.on_ack})
        self.metrics.gauge(
            "parkway_rollouts_in_flight", "Rollout attempts running on this agent", lambda: len(self.running)
        )

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
        if run.epoch < self.epoch or key in self.retired:
            self.counts["runs_stale"] += 1  # from an older controller incarnation, or a replaced attempt
            self.history.record(_received(run, "stale"))
            return
        self.epoch = run.epoch
        if (
            key in self.running
            or key in self.unacked
            or self.latest_attempt.get(run.rollout_id, -1) > run.attempt
        ):
            self.counts["runs_duplicate"] += 1  # redelivered: the attempt exists or was replaced
            self.history.record(_received(run, "duplicate"))
            return
        self.latest_attempt[run.rollout_id] = run.attempt
        saved_turns = run.task.get("continue_from")  # the controller's; any other value is no count
        self.history.record(_received(run, "accepted", saved_turns if isinstance(saved_turns, int) else None))
        live = LiveRollout(run)
        if "continue_from" in run.task:
            live.replay = self.continuations.pop(run.rollout_id, None)
        self.live[key] = live
        task = asyncio.get_running_loop().create_task(self._drive(live))
        self.running[key] = task

        def finished(_: asyncio.Task[None]) -> None:
            self.running.pop(key, None)
            self.live.pop(key, None)
            self._park_changed.set()

        task.add_done_callback(finished)

    async def on_ack(self, ack: Ack) -> None:
        for ref in ack.receipts:
            if self.unacked.pop((ref.rollout_id, ref.attempt), None) is not None:
                self.counts["receipts_acked"] += 1
                self.history.record(ReceiptAcked(rollout_id=ref.rollout_id, attempt=ref.attempt))

    async def on_retire(self, command: Retire) -> Message:
        stopped = 0
        for ref in command.attempts:
            task = self.running.get((ref.rollout_id, ref.attempt))
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                stopped += 1
        await super().on_retire(command)  # records the fence
        return Ok(detail=f"stopped {stopped} of {len(command.attempts)}")

    # -- checkpoint hooks ------------------------------------------------------------------------
    async def close_admission(self) -> None:
        self._released.clear()

    async def wait_until_parked(self) -> ParkReport:
        """Event driven: re-checked whenever a rollout changes state, never polled."""
        started, waited = time.monotonic(), False
        while True:
            self._park_changed.clear()
            if all(live.state in PARKED_STATES for live in self.live.values()):
                return ParkReport(
                    parked=len(self.live),
                    boundaries_passed=self.counts["boundaries"],
                    waited_s=time.monotonic() - started if waited else 0.0,
                )
            waited = True
            await self._park_changed.wait()

    async def release(self) -> None:
        self._released.set()

    async def write_snapshot(self, directory: Path, command: Commit) -> tuple[FileDigest, ...]:
        saved = [live.saved() for _, live in sorted(self.live.items())]
        return (self.write_records(directory / "rollouts.msgpack", saved),)

    def saved_episodes(self) -> tuple[EpisodeRef, ...]:
        return tuple(EpisodeRef(rollout_id=r, attempt=a, replica=self.replica) for r, a in sorted(self.live))

    async def on_commit(self, command: Commit) -> Message:
        reply = await super().on_commit(command)
        # What this agent saved, exactly: the controller checks it against its ledger.
        return msgspec.structs.replace(reply, episodes=self.saved_episodes())  # type: ignore[type-var]

    async def install_snapshot(self, directory: Path, command: Restore) -> tuple[AttemptRef, ...]:
        # Read first: a snapshot that cannot be read changes nothing here.
        saved = msgspec.msgpack.decode((directory / "rollouts.msgpack").read_bytes(), type=list[SavedRollout])
        # A restored agent runs nothing from before: work it picked up from the dead cluster's queues
        # is stopped, and anything older than this controller incarnation is refused from now on.
        self.epoch = max(self.epoch, command.epoch)
        zombies = list(self.running.values())
        for task in zombies:
            task.cancel()
        await asyncio.gather(*zombies, return_exceptions=True)
        self.unacked.clear()
        self.counts["runs_stopped_at_restore"] += len(zombies)
        continuing = {e.rollout_id: e.attempt for e in command.episodes if e.replica == self.replica}
        restored = []
        for item in saved:
            attempt = continuing.get(item.run.rollout_id)
            if attempt is None:
                continue
            self.continuations[item.run.rollout_id] = item
            self.latest_attempt[item.run.rollout_id] = attempt  # attempt N+1 may start; N is fenced
            restored.append(AttemptRef(rollout_id=item.run.rollout_id, attempt=attempt))
            self.history.record(
                ContinuationRestored(
                    rollout_id=item.run.rollout_id,
                    attempt=attempt,
                    saved_attempt=item.run.attempt,
                    kept_model=len(item.model),
                    kept_tools=len(item.tools),
                )
            )
        self.history.record(
            SnapshotInstalled(epoch=command.epoch, stopped=len(zombies), continuing=len(restored))
        )
        return tuple(restored)

    # -- one attempt ---------------------------------------------------------------------------
    async def _drive(self, live: LiveRollout) -> None:
        from parkway.actors.sdk.environments import ENVIRONMENTS  # the resources' tool catalogue

        run = live.run
        key = (run.rollout_id, run.attempt)
        ck = capture_key(run.rollout_id, run.attempt)
        resources = f"resources/{run.task.get('resources', self.replica)}"
        with structlog.contextvars.bound_contextvars(rollout_id=run.rollout_id, attempt=run.attempt):
            env = ENVIRONMENTS.get(run.env)
            program_cls = PROGRAMS.get(str(run.task.get("agent", "tool")))
            ctx = RolloutContext(
                run=run,
                tools=env.tools if env is not None else (),
                _generate=lambda index, tokens: self._generate(live, ck, index, tokens),
                _call_tool=lambda index, tool, args: self._call_tool(live, ck, resources, index, tool, args),
                _boundary=lambda: self._at_boundary(live),
            )
            kept = len(live.replay.model) if live.replay is not None else 0
            log.info(
                "rollout_started", replica=self.replica, continuing=live.replay is not None, kept_turns=kept
            )
            receipt: Completed | Failed
            try:
                if env is None:
                    raise RolloutFailure("unknown_env", f"no environment {run.env!r}")
                if program_cls is None:
                    raise RolloutFailure("unknown_agent", f"no agent program {run.task.get('agent')!r}")
                if "continue_from" in run.task and live.replay is None:
                    raise RolloutFailure("no_continuation", "this replica restored no transcript for it")
                reward = await program_cls().run(ctx)
                receipt = Completed(
                    rollout_id=run.rollout_id,
                    attempt=run.attempt,
                    capture_key=ck,
                    reward=reward,
                    turns=ctx.turns,
                    staging_keys=tuple(step.staging_key for step in live.model),
                )
                self.counts["rollouts_completed"] += 1
                self._end_turn(live)
                log.info("rollout_completed", turns=ctx.turns, reward=reward)
            except asyncio.CancelledError:
                self.counts["rollouts_retired"] += 1
                self.history.record(
                    RolloutStopped(rollout_id=run.rollout_id, attempt=run.attempt, turns=ctx.turns)
                )
                log.info("rollout_stopped", turns=ctx.turns)  # a turn in progress stays unfinished
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
            self.history.record(
                Receipt(
                    rollout_id=run.rollout_id,
                    attempt=run.attempt,
                    of="completed" if isinstance(receipt, Completed) else "failed",
                    code=receipt.code if isinstance(receipt, Failed) else None,
                    turns=receipt.turns,
                )
            )
            await self._send_receipt(receipt)

    def _failed(self, run: Run, code: str, detail: str, ctx: RolloutContext) -> Failed:
        self.counts["rollouts_failed"] += 1
        log.info("rollout_failed", code=code, detail=detail, turns=ctx.turns)
        return Failed(
            rollout_id=run.rollout_id, attempt=run.attempt, code=code, detail=detail, turns=ctx.turns
        )

    @staticmethod
    def _start_turn(live: LiveRollout, index: int, replayed: bool) -> None:
        """A turn starts with its model call (the report draws it from here to the next boundary)."""
        live.turn = (index, replayed, time.perf_counter())
        log.info("turn_started", turn=index, replayed=replayed)

    @staticmethod
    def _end_turn(live: LiveRollout) -> None:
        if live.turn is None:
            return
        index, replayed, started = live.turn
        live.turn = None
        log.info(
            "turn_finished",
            turn=index,
            replayed=replayed,
            ms=round((time.perf_counter() - started) * 1000, 3),
        )

    def _set_state(self, live: LiveRollout, state: str) -> None:
        live.state = state
        self._park_changed.set()

    async def _at_boundary(self, live: LiveRollout) -> None:
        self.counts["boundaries"] += 1
        self._end_turn(live)
        live.mark = (len(live.model), len(live.tools), live.mark[2] + 1)
        hold = live.run.task.get("hold_at_turn")
        if hold == len(live.model) and live.run.attempt == 0:
            # A demo's hold (``parkway demo``): stay parked here until the cluster goes away.
            self.counts["held_at_boundary"] += 1
            self._set_state(live, AT_BOUNDARY)
            await asyncio.Event().wait()
        if not self._released.is_set():
            self._set_state(live, AT_BOUNDARY)
            await self._released.wait()
        self._set_state(live, RUNNING)

    async def _generate(self, live: LiveRollout, ck: str, index: int, tokens: tuple[int, ...]) -> Generated:
        run = live.run
        digest = prompt_digest(tokens)
        if live.replay is not None and index < len(live.replay.model):
            step = live.replay.model[index]
            if step.prompt_sha256 != digest:
                raise RolloutFailure(
                    "replay_diverged", f"model call {index} has another prompt than the saved one"
                )
            self._start_turn(live, index, replayed=True)
            live.model.append(step)
            self.counts["model_calls_replayed"] += 1
            self.history.record(_about_call(ModelCallReplayed, run, index))
            return Generated(
                rollout_id=run.rollout_id,
                attempt=run.attempt,
                call_index=index,
                token_ids=step.token_ids,
                logprobs=step.logprobs,
                finish_reason=step.finish_reason,
            )
        request = Generate(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            token_ids=tokens,
            seed=run.seed,
            max_tokens=int(run.task.get("max_tokens", 160)),  # type: ignore[arg-type]
            stop_token_ids=chat.tokenizer_for(run.task.get("tokenizer")).stop_token_ids,  # type: ignore[arg-type]
            policy_version=run.policy_version,
        )
        self._start_turn(live, index, replayed=False)
        self._set_state(live, AWAITING_MODEL)  # parked at the boundary just passed
        self.history.record(_about_call(ModelCallSent, run, index))
        # A reply, or an error, that arrives mid-checkpoint waits here: the rollout stays parked at its
        # boundary until resume, so what the snapshot saved is still what the agent holds. (A cancellation
        # does not wait: a stopping agent must not hang on a checkpoint that will never resume.)
        try:
            reply = await self._request(self.policy_address, request, staging_key(ck, index))
        except RolloutFailure:
            await self._released.wait()
            raise
        await self._released.wait()
        if not isinstance(reply, Generated):
            raise RolloutFailure("policy_error", f"unexpected reply {type(reply).__name__}")
        self.history.record(_about_call(ModelReplyReceived, run, index))
        live.model.append(
            ModelStep(
                prompt_sha256=digest,
                token_ids=reply.token_ids,
                logprobs=reply.logprobs,
                finish_reason=reply.finish_reason,
                staging_key=staging_key(ck, index),
            )
        )
        self._set_state(live, RUNNING)
        return reply

    async def _call_tool(
        self, live: LiveRollout, ck: str, resources: str, index: int, tool: str, arguments: dict[str, object]
    ) -> ToolOutcome:
        run = live.run
        if live.replay is not None and index < len(live.replay.tools):
            step = live.replay.tools[index]
            if (step.tool, step.arguments) != (tool, arguments):
                raise RolloutFailure("replay_diverged", f"tool call {index} differs from the saved one")
            live.tools.append(step)
            self.counts["tool_calls_replayed"] += 1
            self.history.record(
                ToolCallReplayed(rollout_id=run.rollout_id, attempt=run.attempt, call_index=index, tool=tool)
            )
            return ToolOutcome(step.ok, dict(step.output))
        call = ToolCall(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            env=run.env,
            tool=tool,
            arguments=arguments,
            seed=run.seed,
        )
        self._set_state(live, IN_TOOL)
        self.history.record(
            ToolCallSent(
                rollout_id=run.rollout_id,
                attempt=run.attempt,
                call_index=index,
                tool=tool,
                resources=resources,
            )
        )
        try:
            reply = await self._request(resources, call, f"{ck}:t{index}")
        finally:
            self._set_state(live, RUNNING)
        if not isinstance(reply, ToolResult):
            raise RolloutFailure("resources_error", f"unexpected reply {type(reply).__name__}")
        self.history.record(
            ToolResultReceived(
                rollout_id=run.rollout_id,
                attempt=run.attempt,
                call_index=index,
                ok=reply.ok,
                revision=reply.revision,
            )
        )
        live.tools.append(ToolStep(tool=tool, arguments=arguments, ok=reply.ok, output=dict(reply.output)))
        return ToolOutcome(reply.ok, dict(reply.output))

    async def _request(self, address: str, message: Message, correlation_id: str) -> Message:
        """One model or tool call. A transport failure (the broker connection lost, the reply with it)
        sends the same call again: each is idempotent by its key (a model call's request id gives the
        same tokens, a tool call's (attempt, index) is applied once), so the rollout keeps its turns."""
        for pause in (*TRANSPORT_RETRIES_S, None):
            try:
                reply = await self.client.request(
                    address, message, correlation_id=correlation_id, deadline=time.time() + CALL_TIMEOUT_S
                )
                break
            except RequestTimeout as exc:
                raise RolloutFailure("call_failed", f"{address}: {exc}") from exc
            except (BrokerError, OSError) as exc:
                if pause is None:
                    raise RolloutFailure("call_failed", f"{address}: {exc}") from exc
                self.counts["calls_resent"] += 1
                log.warning("call_resent", to=address, correlation_id=correlation_id, error=str(exc))
                await asyncio.sleep(pause)
            except ProtocolError as exc:
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
