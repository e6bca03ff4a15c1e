"""The tool server with the workspace environment: a command runs while other calls go on, a snapshot
taken while it runs keeps the workspace as the command found it, and a restore takes the state its
agent's boundary needs (before the command, or after it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from parkway.actors.builtin.workspace.environment import Workspace
from parkway.actors.roles.resources import Resources, _saved_sessions
from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Commit, EpisodeRef, Restore, ToolCall, ToolResult

from tests.support.signed import SECRET
from tests.support.workspace import walk_digest

pytestmark = pytest.mark.slow  # commands are processes

RUN = "unit"


async def call(client: Client, index: int, tool: str, arguments: dict, attempt: int = 0) -> ToolResult:
    reply = await client.request(
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
    assert isinstance(reply, ToolResult), reply
    return reply


def commit() -> Commit:
    return Commit(
        checkpoint_id="ck-1",
        deadline=time.time() + 30,
        location="tmp_ck-1",
        episodes=(EpisodeRef(rollout_id="r1", attempt=0, replica=0),),
    )


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
        during = _saved_sessions(actor)
        directory = tmp_path / RUN / "snapshot_1" / "participants" / "resources" / "0"
        directory.mkdir(parents=True)
        await actor.write_snapshot(directory, commit())
        done = await running
        root = actor.sessions["r1"].env.root
        assert root is not None
        after = walk_digest(root)
        later = _saved_sessions(actor)
        await actor.stop()
    assert done.ok and done.output["exit_code"] == 0
    (saved,) = during
    assert saved.revision == 1 and saved.applied == (0,) and saved.before is None
    assert saved.env is not None and [row[0] for row in saved.env["state"]["manifest"]] == ["a.txt"]
    (now,) = later  # after the command: its state, with the one before it beside
    assert now.env is not None and now.env["state"]["digest"] == after and now.revision == 2
    assert now.before is not None and now.before.call_index == 1
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
        await actor.write_snapshot(directory, commit())
        await actor.stop()
    actor, listing = await restored(tmp_path, directory, first_index=1)
    assert [e["name"] for e in listing.output["entries"]] == ["made.txt"]
    assert actor.sessions["r1"].revision == 1
