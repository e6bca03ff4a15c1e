"""The workspace environment under a crash: the coder agent over RabbitMQ, every actor its own process,
the whole cluster SIGKILLed while test commands run, then restored.

Asserts: every rollout sealed once with reward 1.0 (each session's mutations applied exactly once), the
transcripts equal an uncrashed run's, and each restored workspace, walked on disk by this test, has the
digest of the manifest its snapshot saved.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from parkway.actors.builtin.workspace.environment import dir_name
from parkway.actors.runtime.packs import read_records

from tests.support.embedded import embedded_digest
from tests.support.processes import start_driver, wait_ready
from tests.support.workspace import walk_digest

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

CONFIG = """
run: wscrash
seed: 3
agent: parkway.actors.builtin.agents:CoderAgent
environments: [parkway.actors.builtin.workspace.environment:Workspace]
rollout: {group_size: 2, max_turns: 6}
tasks: {path: TASKS_PATH}
policy: {host: inline, per_token_delay_s: 0.001}
topology: {agents: 1, resources: 2}
trainer: {batch_groups: 1}
recovery: {target_level: turn}
snapshot_interval_s: 0.3
prepare_timeout_s: 10
"""
TASKS = [
    {"env": "workspace", "prompt": "Fix the add function so its tests pass."},
    {"env": "workspace", "prompt": "Make test_calc.py pass."},
]
ROLES = [("tq", 0), ("policy", 0), ("resources", 0), ("resources", 1), ("agent", 0)]


def commands_running(state: Path) -> list[int]:
    """The pids of test commands whose working directory is one of this test's workspaces."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if b"test_calc.py" in cmdline and cwd.startswith(str(state)):
            found.append(int(proc.name))
    return found


def parked_before_a_command(snapshot: Path) -> list[str]:
    """The rollouts a snapshot saved at the boundary before a ``run`` (the coder's third and sixth
    calls, in its second and fifth turns): their command was in flight or about to be sent."""
    found = []
    for rollouts in sorted(snapshot.glob("participants/agent/*/rollouts.msgpack")):
        for saved in read_records(rollouts):
            if (len(saved["model"]), len(saved["tools"])) in ((2, 2), (5, 5)):
                found.append(saved["run"]["rollout_id"])
    return found


def saved_workspaces(snapshot: Path) -> dict[str, tuple[str, str]]:
    """rollout id -> (replica, manifest digest) of every session the snapshot saved."""
    saved = {}
    for sessions in sorted(snapshot.glob("participants/resources/*/sessions.msgpack")):
        for session in read_records(sessions):
            saved[session["rollout_id"]] = (sessions.parent.name, session["env"]["state"]["digest"])
    return saved


async def start(spawn, client, config: Path, template: Path) -> list:
    actors = [
        spawn(role, replica, args=("--config", str(config)), PARKWAY_WORKSPACE_TEMPLATE=str(template))
        for role, replica in ROLES
    ]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)
    return actors


async def test_the_cluster_killed_while_commands_run(
    spawn, client, amqp_url, run_name, tmp_path, monkeypatch
) -> None:
    template = tmp_path / "template"
    template.mkdir()
    (template / ".delay").write_text("1.0")
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.replace("TASKS_PATH", str(tmp_path / "tasks.jsonl")))
    monkeypatch.setenv("PARKWAY_WORKSPACE_TEMPLATE", str(template))
    reference = await embedded_digest(config, tmp_path / "reference")
    state = tmp_path / "state"
    run_dir = state / "snapshots" / run_name

    first = await start(spawn, client, config, template)
    driver = start_driver(config, run_name, state, amqp_url)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a published snapshot with rollouts in it, and commands running
        published = sorted(run_dir.glob("snapshot_*"))
        caught = published and parked_before_a_command(published[-1])
        if caught and commands_running(state):
            break
        await asyncio.sleep(0.05)
    running = commands_running(state)
    assert running and driver.poll() is None, "no command was running mid-run: this case proves nothing"
    driver.send_signal(signal.SIGKILL)
    for actor in first:
        actor.kill()
    for pid in running:  # a command outlives its killed server (docs/workspace.md): end it too
        os.kill(pid, signal.SIGKILL)
    driver.wait()

    # The restore, stopped once the tool servers have put the workspaces back: walk them on disk.
    second = await start(spawn, client, config, template)
    stopped = start_driver(config, run_name, state, amqp_url, faults="after_restore_resources")
    _, err = await asyncio.to_thread(stopped.communicate, timeout=240)
    assert stopped.returncode == -signal.SIGKILL, err[-3000:]
    for actor in second:
        actor.kill()
    snapshot = sorted(run_dir.glob("snapshot_*"))[-1]
    episodes = {e[0] for e in json.loads((snapshot / "manifest.json").read_text())["episodes"]}
    saved = saved_workspaces(snapshot)
    assert episodes and episodes <= set(saved)
    # Commands in flight did not hold the cut: rollouts were saved at the boundary before theirs.
    assert parked_before_a_command(snapshot)
    for rollout in sorted(episodes):
        replica, digest = saved[rollout]
        live = run_dir / "workspace" / replica / "live" / dir_name(rollout)
        assert walk_digest(live) == digest, rollout

    await start(spawn, client, config, template)
    driver = start_driver(config, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(episodes)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 4 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0 and summary["tool_mutations_duplicated"] == 0
    assert summary["transcripts_sha256"] == reference
