"""Tool calls that run long (a workspace command): awaited while the server answers other calls, and
the session as it was when such a call started kept for the snapshot, so a command in flight does not
hold the cut (docs/workspace.md). A restore whose continuing attempt sends that same call again starts
it from that state (``take_alternative``). A session that ends while such a call runs (released,
retired, forgotten, replaced by a restore or a newer attempt) kills it as its environment closes, and the
call is answered ``stale_attempt``; a server that stops kills them too, answering ``unavailable``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from parkway.actors.sdk.environments import CallAnswer, CallKey, ToolError
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import ToolCall, ToolResult

if TYPE_CHECKING:
    from parkway.actors.roles.resources import Resources, Session


class SavedBefore(msgspec.Struct, frozen=True, kw_only=True):
    """A session as it was when a ``boundary_before`` call started."""

    call_index: int
    revision: int
    applied: tuple[int, ...]
    env: dict[str, Any]


def take_alternative(resources: Resources, call: ToolCall, session: Session) -> None:
    alternative, session.alternative = session.alternative, None
    if alternative is None or call.call_index != alternative.call_index:
        return
    env = resources.environment(session.env.name).restore(alternative.env)
    session.env.close()
    env.locate(resources.files_home)
    env.bind(call.rollout_id, session.attempt)
    session.env, session.revision, session.applied = env, alternative.revision, set(alternative.applied)


def end_running(resources: Resources) -> None:
    """The server stops: each session with a long call running ends now (its environment closes and
    kills the command), so the stop does not wait the command out; the call answers ``unavailable``."""
    for session in resources.sessions.values():
        if session.running and not session.retired:
            session.env.close()


async def run_async(
    resources: Resources, session: Session, call: ToolCall, key: tuple[int, int]
) -> ToolResult:
    """A call of an ``async_tools`` tool: awaited, while other calls go on; a second delivery while it
    runs waits for the first. A ``boundary_before`` tool's session is exported first."""
    if key in session.running:
        resources.counts["tool_duplicates"] += 1
        return await asyncio.shield(session.running[key])
    if resources.stopping:  # what starts now would hold the stop up
        raise ProtocolError(ErrorCode.UNAVAILABLE, f"{resources.address} is stopping")
    future: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
    session.running[key] = future
    try:
        if call.tool in session.env.boundary_before:
            session.before = SavedBefore(
                call_index=call.call_index,
                revision=session.revision,
                applied=tuple(sorted(session.applied)),
                env=session.env.export(),
            )
        answer: CallAnswer | ToolError
        try:
            answer = await session.env.call_async(
                CallKey(call.rollout_id, call.attempt, call.call_index), call.tool, dict(call.arguments)
            )
        except ToolError as err:
            answer = err
        except Exception:
            _refuse_if_ended(resources, session, call)  # what a call cut short raised is moot
            raise
        _refuse_if_ended(resources, session, call)
        if isinstance(answer, ToolError):
            result = resources._result(session, call, ok=False, output=answer.output())
        else:
            result = resources._answered(session, call, answer)
        session.results[key] = (call, result)
        future.set_result(result)
        return result
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved: a lone delivery leaves no one else to
        raise
    finally:
        session.running.pop(key, None)


def _refuse_if_ended(resources: Resources, session: Session, call: ToolCall) -> None:
    """The session ended (or its server is stopping) while the call ran: its command was killed, and
    whatever it answered belongs to no session any more."""
    if resources.stopping:
        raise ProtocolError(
            ErrorCode.UNAVAILABLE,
            f"{resources.address} stopped while call {call.call_index} of {call.rollout_id} ran",
        )
    if resources.sessions.get(call.rollout_id) is not session or session.retired:
        raise ProtocolError(
            ErrorCode.STALE_ATTEMPT, f"{call.rollout_id} attempt {call.attempt} ended while it ran"
        )
