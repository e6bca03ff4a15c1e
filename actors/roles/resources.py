"""Resources (tool servers): per-rollout sessions with a revision counter and exactly-once tool calls.

A session belongs to one attempt of one rollout. The first ``ToolCall`` of a rollout opens it in the
environment the call names (initial state from the call's seed); every call is keyed by
(rollout_id, attempt, call_index), so a call delivered twice (a retry after a lost reply, a redelivery
after a crash) returns the stored result instead of mutating again. Attempts only move forward: a call
from an older attempt than the session's is refused, one from a newer attempt starts a fresh session.
A session opens at its attempt's first call only: a server that restarted lost its sessions, and the
later calls of an attempt it no longer holds are refused (``stale_attempt``) rather than answered from a
fresh state that silently lacks the mutations applied before.

Two tool names are reserved: ``verify`` scores the session from the agent's record and retires it,
``release`` retires it without a score. A retired session keeps only its ending (a repeated verify or
release gets the same answer) until the controller's ``Forget`` drops it; from then on only the
attempt's id stays, in the participant's bounded fence, and a late call of it gets ``stale_attempt``
(never a fresh session). Retired sessions the controller never forgets are bounded too: beyond
``PARKWAY_FORGET_FENCE`` of them the oldest go (their ids stay fenced). A snapshot and a prepare look at
the live sessions only, never at every session served (docs/memory.md).

Tool errors (unknown tool, bad arguments, insufficient funds) are the model's mistakes, answered as
``ToolResult(ok=False)``; protocol errors (stale attempt, unknown environment) are ``Error`` replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
from parkway.actors.roles import long_calls, session_cuts
from parkway.actors.roles.long_calls import SavedBefore
from parkway.actors.roles.session_cuts import keep_round_copy
from parkway.actors.runtime.forgetting import AttemptKey
from parkway.actors.runtime.participant import Cut, ParkReport, Participant
from parkway.actors.sdk.environments import CallAnswer, CallKey, Environment, Record, ToolError
from parkway.actors.sdk.plugins import Kind, find_environment, installed_names
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import (
    DuplicateToolCall,
    MutationApplied,
    SessionOpened,
    SessionReleased,
    SessionVerified,
)
from parkway.protocol.ids import Role
from parkway.protocol.messages import (
    AttemptRef,
    Commit,
    FileDigest,
    Message,
    Prepare,
    Restore,
    Retire,
    ToolCall,
    ToolResult,
)

log = structlog.get_logger("parkway.resources")

MODES = ("exported", "stateless", "restart_only")
VERIFY = "verify"
RELEASE = "release"
RESERVED_TOOLS = frozenset({VERIFY, RELEASE})


@dataclass
class Session:
    """One attempt's environment and every call answered in it, keyed by (attempt, call_index)."""

    attempt: int
    env: Environment
    revision: int = 0  # +1 per applied mutation
    results: dict[tuple[int, int], tuple[ToolCall, ToolResult]] = field(default_factory=dict)
    retired: bool = False
    ending: ToolResult | None = None  # the verify or release answer that retired it, if any
    # Call indices whose mutation this session's state holds, across a restore: the record that shows
    # a mutation applied twice (a continued attempt must never send a saved call again).
    applied: set[int] = field(default_factory=set)
    # The session as it was when its latest ``boundary_before`` call started (docs/workspace.md): what a
    # snapshot saves while that call runs, and beside the state after it while no later call came.
    before: SavedBefore | None = None
    running: dict[tuple[int, int], asyncio.Future[ToolResult]] = field(default_factory=dict)
    # Restored: the saved ``before`` state, taken instead when the continuing attempt's first call is
    # that call again (its agent saved the boundary before it).
    alternative: SavedBefore | None = None
    # The session as it was at its agent's boundaries, each taken before the first mutation of the round
    # that followed one (``keeps_round_copy`` environments), by the boundary's tool calls: what a cut
    # mid-round saves. The newest few are kept (a rollout runs on once its agent cut it, and its tool
    # server cuts after), and after the session retires, until it is forgotten (a cut may hold its
    # rollout at a boundary before the verify).
    round_copies: dict[int, SavedBefore] = field(default_factory=dict)
    # The encoded ``SavedSession`` of the last cut and what it was of: reused while nothing changed.
    encoded: tuple[tuple[int, int, int], bytes] | None = None


class Resources(Participant):
    role = Role.RESOURCES
    takes_over_replicas = True  # sessions are saved per rollout: any server can reopen a portable one
    # Tool calls of every rollout of its replicas run concurrently; a low prefetch would queue them here,
    # and a queued call counts as in flight for a checkpoint (prepare waits for it).
    prefetch = 1024

    def __init__(
        self,
        *args: Any,
        mode: str = "exported",
        tool_delay_s: float = 0.0,
        environments: Mapping[str, type[Environment]] | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        if tool_delay_s < 0:
            raise ValueError("tool_delay_s must be >= 0")
        super().__init__(*args, **kwargs)
        self.mode = mode
        # The run's environments by name (its configuration's plugins); None: any installed one.
        self.environments = dict(environments) if environments is not None else None
        self.tool_delay_s = tool_delay_s  # simulated duration of each tool call (benchmarks, demos)
        # rollout id -> its newest attempt's session; a retired one keeps its ending until Forget.
        self.sessions: dict[str, Session] = {}
        self._live: set[str] = set()  # rollouts whose session is not retired: what snapshots cover
        self._retired_order: OrderedDict[str, None] = OrderedDict()  # retired sessions, oldest first
        self.handlers[ToolCall] = self.on_tool_call
        self._files_home: Path | None = None
        self.stopping = False  # stop began: long calls are refused, the running ones were cut short

    @property
    def files_home(self) -> Path:
        """Where environments that keep files keep them (``Environment.locate``): beside the run's
        snapshots, so a restarted server finds the blobs its snapshots refer to."""
        if self._files_home is None:
            if self.snapshot_root is not None:
                self._files_home = self.snapshot_root / self.run / "workspace" / str(self.replica)
            else:
                self._files_home = Path(tempfile.mkdtemp(prefix="parkway-workspace-"))
        return self._files_home

    # -- the tool call -------------------------------------------------------------------------
    async def on_tool_call(self, call: ToolCall) -> Message:
        if self.tool_delay_s and call.tool != RELEASE:
            await asyncio.sleep(self.tool_delay_s)  # the tool's own work, before anything is checked
        # No await from here on: checking the key and applying the call happen in one step of the loop,
        # so two deliveries of the same call can never both apply it.
        self.counts["tool_calls"] += 1
        session = self._session_for(call)
        key = (call.attempt, call.call_index)
        if session.alternative is not None:
            long_calls.take_alternative(self, call, session)
        if session.before is not None and call.call_index > session.before.call_index:
            session.before = None  # a later call: the boundary before that one no longer matters
        if not session.retired and call.tool in session.env.async_tools and key not in session.results:
            return await long_calls.run_async(self, session, call, key)
        if session.retired:
            result = self._after_retirement(session, call)
        elif call.tool == RELEASE:
            result = self._release(session, call)
        elif key in session.results:
            result = self._duplicate(session.results[key], call)
        else:
            result = self._run(session, call)
            if not session.retired:  # a retired session keeps only its ending
                session.results[key] = (call, result)
        log.debug(
            "tool_call", tool=call.tool, call_index=call.call_index, ok=result.ok, revision=result.revision
        )
        return result

    def _session_for(self, call: ToolCall) -> Session:
        """The session this call belongs to, opening (or replacing) it for a new attempt."""
        self.refuse_forgotten(call.rollout_id, call.attempt)  # finished and forgotten: never reopened
        session = self.sessions.get(call.rollout_id)
        if session is not None and call.attempt < session.attempt:
            raise ProtocolError(
                ErrorCode.STALE_ATTEMPT,
                f"{call.rollout_id} attempt {call.attempt} was replaced by attempt {session.attempt}",
            )
        current = session is not None and session.attempt == call.attempt
        if not current and (call.rollout_id, call.attempt) in self.retired:
            raise ProtocolError(
                ErrorCode.STALE_ATTEMPT, f"{call.rollout_id} attempt {call.attempt} is retired"
            )
        if session is None or not current:
            reattached = self.reattach_session(call) if call.call_index > 0 and call.tool != RELEASE else None
            if reattached is not None:
                if session is not None and not session.retired:
                    session.env.close()
                session = self._hold(call.rollout_id, reattached)
                self.counts["sessions_reattached"] += 1
            elif call.call_index > 0 and call.tool != RELEASE:
                # A session opens at its attempt's first call. One that arrives mid-way belongs to a
                # session this server does not hold (it restarted and lost it): answering it from a
                # fresh state would lose the mutations already applied, silently.
                raise ProtocolError(
                    ErrorCode.STALE_ATTEMPT,
                    f"{self.address} holds no session of {call.rollout_id} attempt {call.attempt}: call "
                    f"{call.call_index} cannot continue it (its earlier calls are lost with a restarted server)",
                )
            else:
                if session is not None:
                    # Superseded by the newer attempt (one that names a known environment), and closed
                    # first: its commands die before the new session takes the directory (the same
                    # one: it is named by the rollout).
                    self.environment(call.env)
                    self._drop(call.rollout_id)
                session = self._hold(call.rollout_id, self.open_session(call))
                self.counts["sessions_opened"] += 1
                self.history.record(
                    SessionOpened(
                        rollout_id=call.rollout_id, attempt=call.attempt, call_index=call.call_index
                    )
                )
        if (session.env.name, session.env.seed) != (call.env, call.seed):
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"{call.rollout_id} attempt {call.attempt} runs in {session.env.name} with seed "
                f"{session.env.seed}, not {call.env} with seed {call.seed}",
            )
        return session

    def _hold(self, rollout_id: str, session: Session) -> Session:
        """Make ``session`` the rollout's (live), in place of whatever it held."""
        self.sessions[rollout_id] = session
        self._live.add(rollout_id)
        self._retired_order.pop(rollout_id, None)
        return session

    def _drop(self, rollout_id: str) -> None:
        """Let go of the rollout's session entirely (its env closed if it was still open)."""
        session = self.sessions.pop(rollout_id, None)
        if session is not None and not session.retired:
            self.counts["sessions_retired"] += 1
            session.env.close()
        self._live.discard(rollout_id)
        self._retired_order.pop(rollout_id, None)

    def open_session(self, call: ToolCall) -> Session:
        """A fresh session for the first call of an attempt: a live retry starts from the prompt, so
        the environment's state (in an external store too) is reset to the seed's."""
        env = self.environment(call.env)(call.seed)
        env.locate(self.files_home)
        env.bind(call.rollout_id, call.attempt)
        env.reset()
        return Session(attempt=call.attempt, env=env)

    def reattach_session(self, call: ToolCall) -> Session | None:
        """A mid-attempt call of a session this server does not hold (it restarted): an environment
        whose state lives outside the process may still hold it, with a journal of the calls applied,
        which then answers a call delivered again. None: nothing to reattach (in-process state is lost)."""
        env_class = self.environment(call.env)
        if env_class.state_lives_in == "process":
            return None
        env = env_class(call.seed)
        env.locate(self.files_home)
        env.bind(call.rollout_id, call.attempt)
        applied = env.reattach()
        if applied is None:
            env.close()
            return None
        log.info("session_reattached", rollout_id=call.rollout_id, attempt=call.attempt, applied=len(applied))
        return Session(attempt=call.attempt, env=env, revision=len(applied), applied=set(applied))

    def environment(self, name: str) -> type[Environment]:
        """The environment class ``name`` names: one of the run's, or (no configuration) an installed one."""
        found = self.environments.get(name) if self.environments is not None else find_environment(name)
        if found is None:
            names = self.environments if self.environments is not None else installed_names(Kind.ENVIRONMENT)
            have = ", ".join(sorted(names))
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE, f"unknown environment {name!r}; this server has {have}"
            )
        return found

    def _duplicate(self, seen: tuple[ToolCall, ToolResult], call: ToolCall) -> ToolResult:
        """The stored answer of a call already applied, after checking it is really the same call."""
        first, result = seen
        if (first.tool, first.arguments) != (call.tool, call.arguments):
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"call {call.call_index} of {call.rollout_id} attempt {call.attempt} was {first.tool} "
                f"with other arguments; a call index names one call",
            )
        self.counts["tool_duplicates"] += 1
        self.history.record(
            DuplicateToolCall(
                rollout_id=call.rollout_id, attempt=call.attempt, call_index=call.call_index, tool=call.tool
            )
        )
        return result

    def _after_retirement(self, session: Session, call: ToolCall) -> ToolResult:
        """A repeated verify or release gets the ending again; anything else is too late."""
        if call.tool not in RESERVED_TOOLS or session.ending is None:
            raise ProtocolError(
                ErrorCode.STALE_ATTEMPT, f"{call.rollout_id} attempt {call.attempt} is retired"
            )
        self.counts["tool_duplicates"] += 1
        return msgspec.structs.replace(session.ending, call_index=call.call_index)

    def _run(self, session: Session, call: ToolCall) -> ToolResult:
        if call.tool == VERIFY:
            return self._verify(session, call)
        key = CallKey(call.rollout_id, call.attempt, call.call_index)
        if call.boundary_tools is not None and session.env.keeps_round_copy():
            with contextlib.suppress(ToolError):  # an unknown tool mutates nothing: no copy needed
                if session.env.spec(call.tool).mutates:
                    keep_round_copy(session, call.boundary_tools)
        try:
            answer = session.env.call(key, call.tool, dict(call.arguments))
        except ToolError as err:
            return self._result(session, call, ok=False, output=err.output())
        return self._answered(session, call, answer)

    def _answered(self, session: Session, call: ToolCall, answer: CallAnswer) -> ToolResult:
        output = answer.output
        if answer.from_journal:  # applied before (by a server that died): the store answered it
            self.counts["tool_duplicates"] += 1
            self.history.record(
                DuplicateToolCall(
                    rollout_id=call.rollout_id,
                    attempt=call.attempt,
                    call_index=call.call_index,
                    tool=call.tool,
                )
            )
        elif session.env.spec(call.tool).mutates:
            session.revision += 1
            self.counts["tool_mutations_applied"] += 1
            if call.call_index in session.applied:
                self.counts["tool_mutations_duplicated"] += 1
                log.error("mutation_applied_twice", call_index=call.call_index, tool=call.tool)
            session.applied.add(call.call_index)
            self.history.record(
                MutationApplied(
                    rollout_id=call.rollout_id,
                    attempt=call.attempt,
                    call_index=call.call_index,
                    tool=call.tool,
                    revision=session.revision,
                    effect=output,
                )
            )
        return self._result(session, call, ok=True, output=output)

    def _release(self, session: Session, call: ToolCall) -> ToolResult:
        """Retire without a score. It skips the index check: clean-up must work whatever index it
        comes with (an agent that lost a call's reply releases under that call's index)."""
        self.history.record(SessionReleased(rollout_id=call.rollout_id, attempt=call.attempt))
        return self._retire(call, session, self._result(session, call, ok=True, output={"released": True}))

    def _verify(self, session: Session, call: ToolCall) -> ToolResult:
        """Score the session from the agent's record; a malformed record is a tool error, not an ending."""
        try:
            record = parse_record(call.arguments)
            reward = session.env.verify(record)
        except ToolError as err:
            return self._result(session, call, ok=False, output={"error": err.message})
        if self.history.enabled:
            self.history.record(
                SessionVerified(
                    rollout_id=call.rollout_id,
                    attempt=call.attempt,
                    reward=reward,
                    revision=session.revision,
                    applied=tuple(sorted(session.applied)),
                    recorded=sum(1 for tool, _, _ in record if session.env.spec(tool).mutates),
                )
            )
        return self._retire(call, session, self._result(session, call, ok=True, output={"reward": reward}))

    def _retire(self, call: ToolCall, session: Session, ending: ToolResult) -> ToolResult:
        """End the session with ``ending``, which a repeated verify or release gets again."""
        self._fence(call.rollout_id, session)
        session.ending = ending
        return ending

    def _fence(self, rollout_id: str, session: Session) -> None:
        """Retire the attempt: drop its call results (only the ending is kept) and refuse later calls."""
        if not session.retired:
            self.counts["sessions_retired"] += 1
            session.env.close()
        session.retired = True
        session.results.clear()
        self.retired.add((rollout_id, session.attempt))
        self._live.discard(rollout_id)
        self._retired_order[rollout_id] = None
        self._retired_order.move_to_end(rollout_id)
        # Retired sessions the controller never forgets (it is down, its Forget was lost) are bounded:
        # the oldest go, their attempts stay refused by the fence above.
        while len(self._retired_order) > self.retired.capacity:
            oldest, _ = self._retired_order.popitem(last=False)
            self.sessions.pop(oldest, None)

    @staticmethod
    def _result(session: Session, call: ToolCall, *, ok: bool, output: dict[str, Any]) -> ToolResult:
        return ToolResult(
            rollout_id=call.rollout_id,
            attempt=call.attempt,
            call_index=call.call_index,
            ok=ok,
            output=output,
            revision=session.revision,
        )

    async def stop(self) -> None:
        """Long calls still running end with their sessions (a command is killed), not waited out."""
        self.stopping = True
        long_calls.end_running(self)
        await super().stop()

    # -- checkpoints -----------------------------------------------------------------------------
    def parked_now(self, command: Prepare) -> ParkReport:
        """Tool calls are short and handled in one step; a restart-only server reports its sessions
        as restarts instead of making the snapshot wait (they restart from the prompt after a crash)."""
        if self.mode == "restart_only":
            live = tuple(
                AttemptRef(rollout_id=r, attempt=self.sessions[r].attempt) for r in sorted(self._live)
            )
            return ParkReport(restarts=live)
        return ParkReport(parked=len(self._live))

    def take_cut(self, command: Commit) -> Cut:
        """Each session of the cut's episodes as it was at its agent's boundary, encoded now (a few
        microseconds a session, and reused from the last cut while a session did not change): the
        bytes are the immutable copy, written at Persist."""
        encoded = [] if self.mode == "restart_only" else session_cuts.cut_sessions(self, command.episodes)

        def write(directory: Path) -> tuple[FileDigest, ...]:
            return self.records.packed(
                directory / session_cuts.SESSIONS, [msgspec.Raw(item) for item in encoded]
            )

        return Cut(write=write)

    async def install_snapshot(self, directory: Path, command: Restore) -> tuple[AttemptRef, ...]:
        """Reopen each saved session under its continuing attempt (the one in the restore's scope),
        from this server's directory or, onto another topology, from those of ``sources``."""
        saved = session_cuts.read_saved(self, directory, command)
        continuing = {e.rollout_id: e.attempt for e in command.episodes}
        restored = []
        for session in self.sessions.values():  # the timeline that died (work its queues left)
            if not session.retired:
                self.counts["sessions_retired"] += 1  # ended here: counted, or it would show leaked
                session.env.close()
        self.sessions.clear()
        self._live.clear()
        self._retired_order.clear()
        for item in saved:
            attempt = continuing.get(item.rollout_id)
            if attempt is None:
                continue  # not continued (finished, or restarted from the prompt): nothing to reopen
            env = session_cuts.reopen(self, item, attempt)
            revision, applied = item.revision, set(item.applied)
            session = Session(
                attempt=attempt, env=env, revision=revision, applied=applied, alternative=item.before
            )
            self._hold(item.rollout_id, session)
            restored.append(AttemptRef(rollout_id=item.rollout_id, attempt=attempt))
        return tuple(restored)

    # -- the controller's retire and forget ----------------------------------------------------
    async def on_retire(self, command: Retire) -> Message:
        """Retiring an attempt also ends its session here: no score, and later calls are refused."""
        reply = await super().on_retire(command)
        for ref in command.attempts:
            session = self.sessions.get(ref.rollout_id)
            if session is not None and session.attempt == ref.attempt and not session.retired:
                self._fence(ref.rollout_id, session)
        return reply

    def forget_attempts(self, keys: list[AttemptKey]) -> None:
        """A forgotten attempt's session goes, retired or not (a program that never verified leaves
        it open: it is closed here). A session of a newer attempt of the rollout stays."""
        for rollout_id, attempt in keys:
            session = self.sessions.get(rollout_id)
            if session is not None and session.attempt == attempt:
                self._drop(rollout_id)

    def structure_sizes(self) -> dict[str, int]:
        return {
            **super().structure_sizes(),
            "sessions": len(self.sessions),
            "sessions_live": len(self._live),
            "sessions_ended": len(self._retired_order),
        }


def parse_record(arguments: dict[str, Any]) -> Record:
    """The ``calls`` argument of ``verify``: a list of {"tool", "arguments", "output"} objects."""
    if set(arguments) != {"calls"}:
        raise ToolError(f"verify takes exactly one argument, 'calls', not {sorted(map(str, arguments))}")
    calls = arguments["calls"]
    if not isinstance(calls, list):
        raise ToolError(f"verify: 'calls' must be a list, not {type(calls).__name__}")
    record: Record = []
    for position, entry in enumerate(calls):
        if (
            not isinstance(entry, dict)
            or set(entry) != {"tool", "arguments", "output"}
            or not isinstance(entry["tool"], str)
            or not isinstance(entry["arguments"], dict)
            or not isinstance(entry["output"], dict)
        ):
            raise ToolError(
                f"verify: calls[{position}] must be an object with a string 'tool' and object "
                f"'arguments' and 'output', not {repr(entry)[:200]}"
            )
        record.append((entry["tool"], entry["arguments"], entry["output"]))
    return record
