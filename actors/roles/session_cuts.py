"""What a snapshot's cut saves of each tool session: the session as it was at its agent's last boundary.

The Commit names, per rollout, the tool calls its agent's boundary holds (``EpisodeRef.tools``). A
session mid-round gives its state there from its round copy: the session as it was before the first
mutation of the round that followed that boundary (``keep_round_copy``, taken as the round runs, for
environments that allow it). A boundary_before call's session gives the state it was in when the call
started (``Session.before``). A session whose round mutated it with no such copy cannot be cut there:
the snapshot fails (``unavailable``) and the next one tries again. A restore reopens each saved session
under its continuing attempt (``reopen``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from parkway.actors.roles.long_calls import SavedBefore
from parkway.actors.runtime.packs import read_records
from parkway.actors.sdk.environments import Environment
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import SessionRestored
from parkway.protocol.messages import EpisodeRef, Restore

if TYPE_CHECKING:
    from parkway.actors.roles.resources import Resources, Session


SESSIONS = "sessions.msgpack"  # a tool server's saved sessions, in its participant directory


class SavedSession(msgspec.Struct, frozen=True, kw_only=True):
    """A session as a snapshot keeps it: its environment's state at the agents' boundaries."""

    rollout_id: str
    attempt: int
    revision: int
    env: dict[str, Any] | None  # None in stateless mode: the session reopens from its seed
    env_name: str
    seed: int
    applied: tuple[int, ...] = ()
    before: SavedBefore | None = None  # the state before its latest boundary_before call (docs/workspace.md)


ROUND_COPIES_KEPT = 8  # per session: the rounds a rollout may run between its agent's cut and its server's


def keep_round_copy(session: Session, boundary_tools: int) -> None:
    """Before a mutation of the round that follows the agent's boundary at call ``boundary_tools``:
    keep the session as it is, unless it is kept already or the round mutated it already (then the
    state there is gone: a cut at that boundary fails rather than save another)."""
    copies = session.round_copies
    if boundary_tools in copies or any(index >= boundary_tools for index in session.applied):
        return
    copies[boundary_tools] = SavedBefore(
        call_index=boundary_tools,
        revision=session.revision,
        applied=tuple(sorted(session.applied)),
        env=session.env.export(),
    )
    while len(copies) > ROUND_COPIES_KEPT:
        del copies[min(copies)]


def state_at(session: Session, tools: int) -> tuple[int, tuple[int, ...], dict[str, Any]] | None:
    """(revision, applied calls, exported state) of the session when its agent had made ``tools``
    calls; None when that state is gone (mutated since, no copy kept). A copy taken at a later
    boundary serves as well when nothing mutated the session between the two."""
    kept = [copy for copy in (session.before, *session.round_copies.values()) if copy is not None]
    for copy in sorted((c for c in kept if c.call_index >= tools), key=lambda c: c.call_index):
        if not any(tools <= index < copy.call_index for index in session.applied):
            return copy.revision, copy.applied, copy.env
        break  # a mutation since: a later copy holds it too
    if any(index >= tools for index in session.applied):
        return None
    return session.revision, tuple(sorted(session.applied)), session.env.export(copy_state=False)


def forget_round_copies(session: Session, cut_at: int) -> None:
    """A cut at boundary ``cut_at`` was taken: no later cut needs the rounds before it."""
    for index in [i for i in session.round_copies if i < cut_at]:
        del session.round_copies[index]


def cut_sessions(resources: Resources, episodes: tuple[EpisodeRef, ...]) -> list[bytes]:
    """Each session of these episodes as it was at its agent's boundary, encoded: the immutable copy a
    cut holds (reused from the last cut while a session did not change)."""
    encoded = []
    for episode in sorted(episodes, key=lambda e: e.rollout_id):
        session = resources.sessions.get(episode.rollout_id)
        if session is None or session.attempt != episode.attempt:
            continue  # another server's, or it made no tool call yet: it opens afresh after a restore
        encoded.append(encoded_at(resources, episode.rollout_id, session, episode.tools))
        forget_round_copies(session, episode.tools)
    return encoded


def encoded_at(resources: Resources, rollout_id: str, session: Session, tools: int) -> bytes:
    """The session as it was when its agent had made ``tools`` calls, encoded."""
    key = (tools, session.revision, len(session.applied))
    reusable = session.before is None and session.env.keeps_round_copy()  # in-process state only
    if reusable and session.encoded is not None and session.encoded[0] == key:
        resources.counts["cut_sessions_reused"] += 1
        return session.encoded[1]
    at = state_at(session, tools)
    if at is None:
        raise ProtocolError(
            ErrorCode.UNAVAILABLE,
            f"{rollout_id} attempt {session.attempt}: its round mutated the session after call "
            f"{tools}, where its agent's last boundary is, and no copy of it there was kept",
        )
    revision, applied, exported = at
    item = msgspec.msgpack.encode(
        SavedSession(
            rollout_id=rollout_id,
            attempt=session.attempt,
            revision=revision,
            env=exported if resources.mode == "exported" else None,
            env_name=session.env.name,
            seed=session.env.seed,
            applied=applied,
        )
    )
    session.encoded = (key, item)
    return item


def read_saved(resources: Resources, directory: Path, command: Restore) -> list[SavedSession]:
    """The sessions a restore reopens here, read before anything changes: from this server's
    ``directory``, or from the saved servers' named in ``sources`` (another topology), each session
    taken over from another server checked to be able to move (``Environment.portable``)."""
    saved = [
        item
        for source in resources.source_dirs(directory, command)
        for item in read_records(source / SESSIONS, SavedSession)
    ]
    if command.sources is not None and set(command.sources) - {resources.replica}:
        continued = {e.rollout_id for e in command.episodes}
        for item in saved:
            if item.rollout_id in continued and not resources.environment(item.env_name).portable:
                raise ProtocolError(
                    ErrorCode.INVALID_MESSAGE,
                    f"{item.rollout_id}: a {item.env_name} session cannot move to another tool server "
                    "(its saved state refers to files in the server that saved it): restore onto "
                    "the snapshot's number of tool servers",
                )
    return saved


def reopen(resources: Resources, item: SavedSession, attempt: int) -> Environment:
    """A saved session's environment, reopened for its continuing ``attempt``; the saved attempt is
    fenced here."""
    env_class = resources.environment(item.env_name)
    env = env_class.restore(item.env) if item.env is not None else env_class(item.seed)
    env.locate(resources.files_home)
    env.bind(item.rollout_id, attempt)
    if item.env is None:
        env.reset()  # stateless: the session reopens from its seed, in an external store too
    resources.retired.add((item.rollout_id, item.attempt))
    resources.counts["sessions_opened"] += 1
    resources.history.record(
        SessionRestored(
            rollout_id=item.rollout_id,
            attempt=attempt,
            saved_attempt=item.attempt,
            revision=item.revision,
            applied=tuple(sorted(item.applied)),
        )
    )
    return env
