"""One rollout attempt on an agent: its program's loop, its model and tool calls, its boundaries.

The agent (``agent.py``) starts an ``Attempt`` per ``Run`` and keeps what outlives it (receipts until
they are acknowledged, continuations restored from a snapshot). The attempt runs the task's
``AgentProgram`` through a ``RolloutContext`` and ends in a receipt, ``Completed`` or ``Failed``.

Where it stands is what a checkpoint needs: an attempt is parked when it waits at a boundary (before a
model call, after a tool round) or for a model reply issued right after one; while the agent holds it
(``AttemptHost.hold``: until the agent's cut is taken, and for a rollout whose environment keeps no round
copies until the checkpoint ends) it stays there. Its transcript up to the last boundary is what a snapshot
saves; an attempt continuing a saved one answers its first calls from that transcript (``replay``).

An attempt whose environment keeps a copy of each session as it was at the last boundary while a tool
round runs (``Environment.keeps_round_copy``) can be cut anywhere, mid-round too: the cut saves its last
boundary and the tool server saves the session as it was there (``ToolCall.boundary_tools`` tells it
where that is). Such an attempt is never waited for; one that finishes while the cut is held keeps its
receipt until the checkpoint ends (``DONE``), since the cut still holds it as running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import NamedTuple, Protocol, TypeVar

import structlog
from msgspec import UNSET, UnsetType
from parkway.actors.runtime import tracing
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.history import History
from parkway.actors.sdk import chat
from parkway.actors.sdk.environments import Environment
from parkway.actors.sdk.rollout import AgentProgram, RolloutContext, RolloutFailure, ToolOutcome
from parkway.brokers.base import BrokerError, RequestTimeout
from parkway.protocol.errors import ProtocolError
from parkway.protocol.history import (
    CallRecord,
    ModelCallReplayed,
    ModelCallSent,
    ModelReplyReceived,
    RolloutStopped,
    RunReceived,
    ToolCallReplayed,
    ToolCallSent,
    ToolResultReceived,
)
from parkway.protocol.ids import capture_key, staging_key
from parkway.protocol.messages import (
    Completed,
    EpisodeRef,
    Error,
    Failed,
    Generate,
    Generated,
    Message,
    Run,
    ToolCall,
    ToolResult,
)
from parkway.protocol.transcript import ModelStep, SavedRollout, ToolStep, prompt_digest

log = structlog.get_logger("parkway.agent")

CALL_TIMEOUT_S = 600.0  # a model or tool call that takes longer is a failure of the attempt
# Pauses before a call is sent again after a broker error (its reply was lost with the connection).
TRANSPORT_RETRIES_S = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)

RUNNING, AT_BOUNDARY, AWAITING_MODEL, IN_TOOL = "running", "boundary", "model", "tool"
# Waiting for a ``boundary_before`` tool call (a command) sent right after a boundary: parked there.
AWAITING_TOOL = "tool_parked"
DONE = "done"  # the program ended while a cut held the attempt: its receipt waits for the release
PARKED_STATES = frozenset({AT_BOUNDARY, AWAITING_MODEL, AWAITING_TOOL})
# Where an attempt whose environment keeps round copies may be cut as well: at its last boundary.
MID_ROUND_STATES = frozenset({RUNNING, IN_TOOL, DONE})


class CutEntry(NamedTuple):
    """What a cut keeps of an attempt (``Attempt.cut_entry``)."""

    saved: SavedRollout  # its transcript up to its last boundary
    ref: EpisodeRef  # what the cut names it by (its tool calls there)
    trace: tracing.AttemptTrace  # where its ``parked by`` span goes


class AttemptHost(Protocol):
    """What an attempt needs of the agent that runs it."""

    replica: int
    policy_address: str
    client: Client
    counts: Counter[str]
    history: History

    def held(self, attempt: Attempt) -> bool:
        """Whether a checkpoint holds this attempt where it is (at its boundary) right now."""

    async def hold(self, attempt: Attempt) -> None:
        """Return once no checkpoint holds the attempt (at once when none does)."""

    def environment(self, name: str) -> type[Environment] | None:
        """The environment tasks call ``name`` (its tools are what the program sees)."""

    def program(self, name: str) -> type[AgentProgram] | None:
        """The agent program ``name`` names."""

    def state_changed(self, attempt: Attempt) -> None:
        """An attempt moved (parked, or left its boundary): a Prepare waiting for them looks again."""


CallKind = TypeVar("CallKind", bound=CallRecord)


def _about_call(kind: type[CallKind], run: Run, index: int) -> CallKind:
    """A history record of model call ``index`` of ``run``'s attempt."""
    return kind(rollout_id=run.rollout_id, attempt=run.attempt, call_index=index)


def received(run: Run, outcome: str, continue_from: int | UnsetType | None = UNSET) -> RunReceived:
    """The history record of a Run received: accepted (with the turns it continues from), or not."""
    return RunReceived(
        rollout_id=run.rollout_id,
        attempt=run.attempt,
        epoch=run.epoch,
        outcome=outcome,
        continue_from=continue_from,
    )


class Attempt:
    """One attempt in progress: where it is, and its transcript (all of it, and up to its boundary)."""

    def __init__(self, host: AttemptHost, run: Run, replay: SavedRollout | None = None) -> None:
        self.host = host
        self.run = run
        self.replay = replay  # the saved transcript this attempt continues, if it continues one
        self.capture_key = capture_key(run.rollout_id, run.attempt)
        resources = run.task.resources
        self.resources = f"resources/{host.replica if resources is None else resources}"
        # Every model call of the attempt goes to one policy replica (the controller's choice).
        self.policy = host.policy_address if run.task.policy is None else f"policy/{run.task.policy}"
        self.state = RUNNING
        self.model: list[ModelStep] = []
        self.tools: list[ToolStep] = []
        self.mark = (0, 0, 0)  # (model steps, tool steps, boundaries) at the last boundary
        env = host.environment(run.env)
        self.boundary_tools: frozenset[str] = env.boundary_before if env is not None else frozenset()
        # Cut anywhere (mid-round too): its tool server keeps the session as it was at the last boundary.
        self.keeps_round_copy = env is not None and env.keeps_round_copy()
        # The turn in progress, (index, replayed, perf_counter at its start): logged for ``parkway report``.
        self.turn: tuple[int, bool, float] | None = None
        self.trace = tracing.rollout(run.rollout_id, run.attempt, host.replica)  # no-op unless tracing
        # What a cut takes of it: made as it passes a boundary, so a cut (inside the admission-closed
        # window) reads one attribute per rollout instead of copying transcripts there.
        self.cut_entry = self._make_cut_entry()

    @property
    def cut_ready(self) -> bool:
        """Whether a cut may be taken of it now: parked, or mid-round where its environment allows."""
        return self.state in PARKED_STATES or (self.keeps_round_copy and self.state in MID_ROUND_STATES)

    def saved(self) -> SavedRollout:
        """Its transcript up to its last boundary (the same object until it passes the next one)."""
        return self.cut_entry.saved

    def _make_cut_entry(self) -> CutEntry:
        """``saved()`` at ``mark``, the episode ref a cut names it by (its tool calls there) and its
        trace."""
        models, tools, boundaries = self.mark
        replay = self.replay
        if replay is not None and boundaries < replay.boundaries:
            # Still replaying what it continues: its tool server holds the sessions as they were at the
            # end of that transcript, so that end is its boundary, not the replayed one it is at.
            saved = SavedRollout(
                run=self.run, model=replay.model, tools=replay.tools, boundaries=replay.boundaries
            )
        else:
            saved = SavedRollout(
                run=self.run,
                model=tuple(self.model[:models]),
                tools=tuple(self.tools[:tools]),
                boundaries=boundaries,
            )
        ref = EpisodeRef(
            rollout_id=self.run.rollout_id,
            attempt=self.run.attempt,
            replica=self.host.replica,
            tools=len(saved.tools),
        )
        return CutEntry(saved, ref, self.trace)

    async def run_to_receipt(self) -> Completed | Failed:
        """Run the program to its end. Cancelled (retired, or the agent stopping): the tool session is
        released and the cancellation goes on; every other ending is a receipt."""
        run, host = self.run, self.host
        env = host.environment(run.env)  # the resources' tool catalogue
        program_cls = host.program(run.task.agent)
        ctx = RolloutContext(
            run=run,
            tools=env.tools if env is not None else (),
            _generate=self._generate,
            _call_tool=self._call_tool,
            _boundary=self._at_boundary,
        )
        kept = len(self.replay.model) if self.replay is not None else 0
        log.info("rollout_started", replica=host.replica, continuing=self.replay is not None, kept_turns=kept)
        try:
            if env is None:
                raise RolloutFailure("unknown_env", f"no environment {run.env!r}")
            if program_cls is None:
                raise RolloutFailure("unknown_agent", f"no agent program {run.task.agent!r}")
            if run.task.continue_from is not None and self.replay is None:
                raise RolloutFailure("no_continuation", "this replica restored no transcript for it")
            continues = self.replay.run.attempt if self.replay is not None else None
            reward = await self.trace.running(program_cls().run(ctx), continues=continues)
        except asyncio.CancelledError:
            host.counts["rollouts_retired"] += 1
            host.history.record(
                RolloutStopped(rollout_id=run.rollout_id, attempt=run.attempt, turns=ctx.turns)
            )
            log.info("rollout_stopped", turns=ctx.turns)  # a turn in progress stays unfinished
            await self._release_session(ctx.tool_calls)
            raise
        except RolloutFailure as failure:
            receipt = self._failed(failure.code, failure.detail, ctx)
            await self._release_session(ctx.tool_calls)
            return receipt
        except Exception as exc:  # a bug in a program is that attempt's failure, not the agent's death
            log.exception("program_failed")
            receipt = self._failed("agent_error", f"{type(exc).__name__}: {exc}", ctx)
            await self._release_session(ctx.tool_calls)
            return receipt
        host.counts["rollouts_completed"] += 1
        self._end_turn()
        log.info("rollout_completed", turns=ctx.turns, reward=reward)
        return Completed(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            capture_key=self.capture_key,
            reward=reward,
            turns=ctx.turns,
            staging_keys=tuple(step.staging_key for step in self.model),
            replica=self.host.replica,
            epoch=run.epoch,
        )

    def _failed(self, code: str, detail: str, ctx: RolloutContext) -> Failed:
        self.host.counts["rollouts_failed"] += 1
        log.info("rollout_failed", code=code, detail=detail, turns=ctx.turns)
        return Failed(
            rollout_id=self.run.rollout_id,
            attempt=self.run.attempt,
            code=code,
            detail=detail,
            turns=ctx.turns,
            replica=self.host.replica,
            epoch=self.run.epoch,
        )

    def _start_turn(self, index: int, replayed: bool) -> None:
        """A turn starts with its model call (the report draws it from here to the next boundary)."""
        self.turn = (index, replayed, time.perf_counter())
        self.trace.turn_started(index, replayed)
        log.info("turn_started", turn=index, replayed=replayed)

    def _end_turn(self) -> None:
        self.trace.turn_ended()
        if self.turn is None:
            return
        index, replayed, started = self.turn
        self.turn = None
        log.info(
            "turn_finished",
            turn=index,
            replayed=replayed,
            ms=round((time.perf_counter() - started) * 1000, 3),
        )

    def saved_tools(self) -> int:
        """The tool calls its last boundary holds: where its tool server keeps the session for a cut."""
        return len(self.saved().tools) if self.replay is not None else self.mark[1]

    def _set_state(self, state: str) -> None:
        self.state = state
        self.host.state_changed(self)

    async def _at_boundary(self) -> None:
        self.host.counts["boundaries"] += 1
        self._end_turn()
        self.mark = (len(self.model), len(self.tools), self.mark[2] + 1)
        self.cut_entry = self._make_cut_entry()  # (no await since the mark: a cut sees both or neither)
        hold = self.run.task.hold_at_turn
        if hold == len(self.model) and self.run.attempt == 0:
            # A demo's hold (``parkway demo``): stay parked here until the cluster goes away.
            self.host.counts["held_at_boundary"] += 1
            self._set_state(AT_BOUNDARY)
            await asyncio.Event().wait()
        if self.host.held(self):
            self._set_state(AT_BOUNDARY)
            await self.host.hold(self)
        self._set_state(RUNNING)

    async def _generate(self, index: int, tokens: tuple[int, ...]) -> Generated:
        run, ck = self.run, self.capture_key
        digest = prompt_digest(tokens)
        if self.replay is not None and index < len(self.replay.model):
            step = self.replay.model[index]
            if step.prompt_sha256 != digest:
                raise RolloutFailure(
                    "replay_diverged", f"model call {index} has another prompt than the saved one"
                )
            self._start_turn(index, replayed=True)
            self.model.append(step)
            self.host.counts["model_calls_replayed"] += 1
            self.host.history.record(_about_call(ModelCallReplayed, run, index))
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
            max_tokens=run.task.max_tokens,
            stop_token_ids=chat.tokenizer_for(run.task.tokenizer).stop_token_ids,
            policy_version=run.policy_version,
            epoch=run.epoch,
        )
        self._start_turn(index, replayed=False)
        self._set_state(AWAITING_MODEL)  # parked at the boundary just passed
        self.host.history.record(_about_call(ModelCallSent, run, index))
        # A reply, or an error, that arrives while a checkpoint holds the rollout waits here: it stays
        # parked at its boundary, so what the cut saves is still what the agent holds. (A cancellation
        # does not wait: a stopping agent must not hang on a checkpoint that will never resume.)
        try:
            reply = await self.trace.call(
                "model", index, self._request(self.policy, request, staging_key(ck, index))
            )
        except RolloutFailure:
            await self.host.hold(self)
            raise
        await self.host.hold(self)
        if not isinstance(reply, Generated):
            raise RolloutFailure("policy_error", f"unexpected reply {type(reply).__name__}")
        self.host.history.record(_about_call(ModelReplyReceived, run, index))
        self.model.append(
            ModelStep(
                prompt_sha256=digest,
                token_ids=reply.token_ids,
                logprobs=reply.logprobs,
                finish_reason=reply.finish_reason,
                staging_key=staging_key(ck, index),
            )
        )
        self._set_state(RUNNING)
        return reply

    async def _call_tool(self, index: int, tool: str, arguments: dict[str, object]) -> ToolOutcome:
        run, ck, resources = self.run, self.capture_key, self.resources
        if self.replay is not None and index < len(self.replay.tools):
            step = self.replay.tools[index]
            if (step.tool, step.arguments) != (tool, arguments):
                raise RolloutFailure("replay_diverged", f"tool call {index} differs from the saved one")
            self.tools.append(step)
            self.host.counts["tool_calls_replayed"] += 1
            self.host.history.record(
                ToolCallReplayed(rollout_id=run.rollout_id, attempt=run.attempt, call_index=index, tool=tool)
            )
            return ToolOutcome(step.ok, dict(step.output))
        parks = tool in self.boundary_tools
        if parks:
            # A boundary right before the call: the session records its state as the call starts, so a
            # checkpoint keeps this boundary and need not wait for the call (docs/workspace.md).
            await self._at_boundary()
        call = ToolCall(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            env=run.env,
            tool=tool,
            arguments=arguments,
            seed=run.seed,
            epoch=run.epoch,
            boundary_tools=self.saved_tools(),
        )
        self._set_state(AWAITING_TOOL if parks else IN_TOOL)
        self.host.history.record(
            ToolCallSent(
                rollout_id=run.rollout_id,
                attempt=run.attempt,
                call_index=index,
                tool=tool,
                resources=resources,
            )
        )
        try:
            reply = await self.trace.call("tool", index, self._request(resources, call, f"{ck}:t{index}"))
            if parks:  # a reply that arrives while a checkpoint holds it waits: it stays at its boundary
                await self.host.hold(self)
        finally:
            self._set_state(RUNNING)
        if not isinstance(reply, ToolResult):
            raise RolloutFailure("resources_error", f"unexpected reply {type(reply).__name__}")
        self.host.history.record(
            ToolResultReceived(
                rollout_id=run.rollout_id,
                attempt=run.attempt,
                call_index=index,
                ok=reply.ok,
                revision=reply.revision,
            )
        )
        self.tools.append(ToolStep(tool=tool, arguments=arguments, ok=reply.ok, output=dict(reply.output)))
        return ToolOutcome(reply.ok, dict(reply.output))

    async def _request(self, address: str, message: Message, correlation_id: str) -> Message:
        """One model or tool call. A transport failure (the broker connection lost, the reply with it)
        sends the same call again: each is idempotent by its key (a model call's request id gives the
        same tokens, a tool call's (attempt, index) is applied once), so the rollout keeps its turns."""
        for pause in (*TRANSPORT_RETRIES_S, None):
            try:
                reply = await self.host.client.request(
                    address, message, correlation_id=correlation_id, deadline=time.time() + CALL_TIMEOUT_S
                )
                break
            except RequestTimeout as exc:
                raise RolloutFailure("call_failed", f"{address}: {exc}") from exc
            except (BrokerError, OSError) as exc:
                if pause is None:
                    raise RolloutFailure("call_failed", f"{address}: {exc}") from exc
                self.host.counts["calls_resent"] += 1
                log.warning("call_resent", to=address, correlation_id=correlation_id, error=str(exc))
                await asyncio.sleep(pause)
            except ProtocolError as exc:
                raise RolloutFailure("call_failed", f"{address}: {exc}") from exc
        if isinstance(reply, Error):
            raise RolloutFailure(reply.code.value, f"{address}: {reply.detail}")
        return reply

    async def _release_session(self, index: int) -> None:
        """A rollout that ends without verify still retires its tool session (no leaked sessions)."""
        run = self.run
        call = ToolCall(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            env=run.env,
            tool="release",
            seed=run.seed,
            epoch=run.epoch,
        )
        with contextlib.suppress(Exception):
            await self.host.client.request(
                self.resources, call, correlation_id=f"{self.capture_key}:release", deadline=time.time() + 10
            )
