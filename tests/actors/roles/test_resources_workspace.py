"""The tool server with the workspace environment: a command runs while other calls go on, a snapshot
taken while it runs keeps the workspace as the command found it, a cut saves the state its agent's
boundary holds (before the command, or after it), and a session that ends or a server that stops kills
the command still running, the call answered with a typed error."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import pytest
from parkway.actors.builtin.workspace.environment import Workspace
from parkway.actors.roles.resources import Resources
from parkway.actors.roles.session_cuts import SavedSession, cut_sessions
from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import (
    AttemptRef,
    Commit,
    EpisodeRef,
    Error,
    Forget,
    Message,
    Restore,
    Retire,
    ToolCall,
    ToolResult,
)
from structlog.testing import capture_logs

from tests.support.signed import SECRET
from tests.support.workspace import command_started, gone, walk_digest

pytestmark = pytest.mark.slow  # commands are processes

RUN = "unit"


async def request(client: Client, index: int, tool: str, arguments: dict, attempt: int = 0) -> Message:
    return await client.request(
        "resources/0",
        ToolCall(
            rollout_id="r1",
            attempt=attempt,
            call_index=index,
            env="workspace",
            tool=tool,
            arguments=arguments,
        ),
        correlation_id=f"c{attempt}-{index}-{time.monotonic_ns()}",
        deadline=time.time() + 30,
    )


async def call(client: Client, index: int, tool: str, arguments: dict, attempt: int = 0) -> ToolResult:
    reply = await request(client, index, tool, arguments, attempt)
    assert isinstance(reply, ToolResult), reply
    return reply


def commit(tools: int) -> Commit:
    """The cut of r1's attempt 0, its agent's last boundary after ``tools`` tool calls."""
    return Commit(
        checkpoint_id="ck-1",
        deadline=time.time() + 30,
        location="tmp_ck-1",
        episodes=(EpisodeRef(rollout_id="r1", attempt=0, replica=0, tools=tools),),
    )


def saved_at(actor: Resources, tools: int) -> SavedSession:
    """What a cut at that boundary saves of r1."""
    [encoded] = cut_sessions(actor, commit(tools).episodes)
    return msgspec.msgpack.decode(encoded, type=SavedSession)


async def restored(tmp_path: Path, saved_dir: Path, first_index: int) -> tuple[Resources, ToolResult]:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(
            broker, secret=SECRET, snapshot_root=tmp_path, environments={"workspace": Workspace}
        )
        await actor.start()
        command = Restore(
            checkpoint_id="ck-2",
            deadline=time.time() + 30,
            location="snapshot_1",
            episodes=(EpisodeRef(rollout_id="r1", attempt=1, replica=0),),
        )
        await actor.install_snapshot(saved_dir, command)
        client = Client(broker, secret=SECRET, sender="agent/0")
        listing = await call(client, first_index, "list_files", {"path": "."}, attempt=1)
        await actor.stop()
    return actor, listing


async def test_a_snapshot_during_a_command_keeps_the_workspace_as_it_started(tmp_path: Path) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(
            broker, secret=SECRET, snapshot_root=tmp_path, environments={"workspace": Workspace}
        )
        await actor.start()
        client = Client(broker, secret=SECRET, sender="agent/0")
        await call(client, 0, "write_file", {"path": "a.txt", "content": "before"})
        running = asyncio.ensure_future(call(client, 1, "run", {"command": "sleep 1; echo after > b.txt"}))
        for _ in range(500):  # until the command has started (its session holds it as running)
            if "r1" in actor.sessions and actor.sessions["r1"].running:
                break
            await asyncio.sleep(0.01)
        saved = saved_at(actor, 1)  # its agent parked at the boundary right before the command
        directory = tmp_path / RUN / "snapshot_1" / "participants" / "resources" / "0"
        directory.mkdir(parents=True)
        await actor.write_snapshot(directory, commit(1))
        done = await running
        root = actor.sessions["r1"].env.root
        assert root is not None
        after = walk_digest(root)
        still_before = saved_at(actor, 1)  # the command ended, its agent still at that boundary
        now = saved_at(actor, 2)  # its agent went on past the command
        await actor.stop()
    assert done.ok and done.output["exit_code"] == 0
    assert saved.revision == 1 and saved.applied == (0,) and saved.before is None
    assert saved.env is not None and [row[0] for row in saved.env["state"]["manifest"]] == ["a.txt"]
    assert still_before == saved
    assert now.env is not None and now.env["state"]["digest"] == after and now.revision == 2
    assert now.applied == (0, 1)
    # A restore whose agent saved the boundary before the command: the command is sent again.
    actor, listing = await restored(tmp_path, directory, first_index=1)
    assert [e["name"] for e in listing.output["entries"]] == ["a.txt"]
    root = actor.sessions["r1"].env.root
    assert root is not None and walk_digest(root) == saved.env["state"]["digest"]


async def test_a_restore_after_the_command_takes_its_result(tmp_path: Path) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = Resources(
            broker, secret=SECRET, snapshot_root=tmp_path, environments={"workspace": Workspace}
        )
        await actor.start()
        client = Client(broker, secret=SECRET, sender="agent/0")
        await call(client, 0, "run", {"command": "echo made > made.txt"})
        directory = tmp_path / RUN / "snapshot_1" / "participants" / "resources" / "0"
        directory.mkdir(parents=True)
        await actor.write_snapshot(directory, commit(1))  # its agent passed the boundary after it
        await actor.stop()
    actor, listing = await restored(tmp_path, directory, first_index=1)
    assert [e["name"] for e in listing.output["entries"]] == ["made.txt"]
    assert actor.sessions["r1"].revision == 1


def workspace_of(actor: Resources) -> Workspace:
    env = actor.sessions["r1"].env
    assert isinstance(env, Workspace) and env.root is not None
    return env


async def end_session(actor: Resources, client: Client, ending: str, tmp_path: Path) -> None:
    refs = (AttemptRef(rollout_id="r1", attempt=0),)
    controller = Client(client.broker, secret=SECRET, sender="controller/0")
    if ending == "release":
        assert (await call(client, 2, "release", {})).output == {"released": True}
    elif ending == "retire":
        await controller.call(
            "resources/0", Retire(checkpoint_id="rt-1", deadline=time.time() + 30, attempts=refs)
        )
    elif ending == "forget":
        await controller.call(
            "resources/0", Forget(checkpoint_id="fg-1", deadline=time.time() + 30, attempts=refs)
        )
    elif ending == "restore":  # the sessions are replaced by a snapshot's, taken as the command runs
        directory = tmp_path / RUN / "snapshot_1" / "participants" / "resources" / "0"
        directory.mkdir(parents=True)
        await actor.write_snapshot(directory, commit(1))  # at the boundary before the command
        restore = Restore(
            checkpoint_id="ck-2",
            deadline=time.time() + 30,
            location="snapshot_1",
            episodes=(EpisodeRef(rollout_id="r1", attempt=1, replica=0),),
        )
        await actor.install_snapshot(directory, restore)
    else:  # a newer attempt's first call supersedes the session
        listing = await call(client, 0, "list_files", {"path": "."}, attempt=1)
        assert listing.ok and listing.output["entries"] == []  # its own fresh workspace, kept


async def server_with_a_session(broker: MemoryBroker, tmp_path: Path) -> tuple[Resources, Client, Workspace]:
    """A started tool server whose rollout r1 has a workspace with one file written by attempt 0."""
    actor = Resources(broker, secret=SECRET, snapshot_root=tmp_path, environments={"workspace": Workspace})
    await actor.start()
    client = Client(broker, secret=SECRET, sender="agent/0")
    await call(client, 0, "write_file", {"path": "a.txt", "content": "before"})
    return actor, client, workspace_of(actor)


@pytest.mark.parametrize("ending", ["release", "retire", "forget", "restore", "newer_attempt"])
async def test_a_session_that_ends_kills_its_running_command(tmp_path: Path, ending: str) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor, client, env = await server_with_a_session(broker, tmp_path)
        with capture_logs() as events:
            running = asyncio.ensure_future(request(client, 1, "run", {"command": "exec sleep 30"}))
            pid = await command_started(env)
            await end_session(actor, client, ending, tmp_path)
            reply = await running
        root = env.root
        assert root is not None
        left = sorted(os.listdir(root)) if root.exists() else None
        await actor.stop()
    assert isinstance(reply, Error) and reply.code is ErrorCode.STALE_ATTEMPT, reply
    assert gone(pid) and env.ended
    # The directory went with the session; the same path is a newer attempt's (fresh) or the restored
    # session's (as the snapshot saved it), kept.
    assert left == {"newer_attempt": [], "restore": ["a.txt"]}.get(ending)
    assert not [e for e in events if e["event"] == "handler_failed" or e.get("log_level") == "error"]


async def test_a_stopping_server_kills_its_running_commands(tmp_path: Path) -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor, client, env = await server_with_a_session(broker, tmp_path)
        with capture_logs() as events:
            running = asyncio.ensure_future(request(client, 1, "run", {"command": "exec sleep 30"}))
            pid = await command_started(env)
            await actor.stop()  # returns once the handler answered: the command was not waited out
            assert gone(pid)
            reply = await running
    assert isinstance(reply, Error) and reply.code is ErrorCode.UNAVAILABLE and reply.retryable, reply
    assert env.root is not None and not env.root.exists()
    assert not [e for e in events if e["event"] == "handler_failed" or e.get("log_level") == "error"]


async def test_a_workspace_session_is_not_taken_over_from_another_tool_server(tmp_path: Path) -> None:
    """A restore onto another number of tool servers names the saved server's directory
    (``sources``): a workspace's saved manifest names blobs in that server's own store, so taking it
    over is refused by name, and nothing changes here."""
    saved = tmp_path / "elastic" / "snapshot_1" / "participants" / "resources" / "1"
    saved.mkdir(parents=True)
    session = SavedSession(
        rollout_id="r1", attempt=0, env_name="workspace", seed=1, revision=1, applied=(0,), env=None
    )
    (saved / "sessions.msgpack").write_bytes(msgspec.msgpack.encode([session]))
    async with MemoryBroker(MemoryHub(), "elastic") as broker:
        actor = Resources(
            broker, secret=SECRET, snapshot_root=tmp_path, environments={"workspace": Workspace}
        )
        await actor.start()
        client = Client(broker, secret=SECRET, sender="controller/0")
        reply = await client.request(
            "resources/0",
            Restore(
                checkpoint_id="rs-1",
                deadline=time.time() + 30,
                location="snapshot_1",
                episodes=(EpisodeRef(rollout_id="r1", attempt=1, replica=0),),
                sources=(1,),
            ),
        )
        assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_MESSAGE, reply
        assert "a workspace session cannot move to another tool server" in reply.detail
        assert not actor.sessions and actor.phases.phase.value == "idle"
        await actor.stop()
