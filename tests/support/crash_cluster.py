"""The cluster and workload the process-crash tests share: every actor its own process on the real
RabbitMQ, a bank workload whose snapshots catch rollouts mid-flight, killed and restarted."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from parkway.actors.chaos.outages import is_stopped, stopped_at
from parkway.actors.runtime.client import Client
from parkway.actors.storage.runs import list_snapshots

from tests.support.embedded import embedded_digest
from tests.support.processes import Process, start_driver, wait_ready

__all__ = ["CONFIG", "CRASH_FAULTS", "ROLES", "cluster", "crash_at", "reference_digest", "start_driver"]

CONFIG = """
run: crash
seed: 21
rollout: {group_size: 3, max_turns: 6}
tasks: {builtin: bank, limit: 2}
policy: {host: inline, per_token_delay_s: 0.004}
topology: {agents: 2, resources: 2}
trainer: {batch_groups: 1}
recovery: {target_level: turn}
snapshot_interval_s: 0.3
prepare_timeout_s: 10
"""
ROLES = [("tq", 0), ("policy", 0), ("resources", 0), ("resources", 1), ("agent", 0), ("agent", 1)]


async def reference_digest(config_path: Path, tmp_path: Path) -> str:
    return await embedded_digest(config_path, tmp_path / "reference")


async def cluster(
    spawn: Callable[..., Process],
    client: Client,
    config_path: Path,
    state: Path,
    env: dict[str, dict[str, str]] | None = None,
) -> list[Process]:
    """Every actor of ``ROLES`` started (``spawn`` writes under the test's ``state``) and answering;
    ``env``: a role's extra environment (its ``PARKWAY_FAULTS``, say)."""
    extra = env or {}
    actors = [
        spawn(role, replica, args=("--config", str(config_path)), **extra.get(role, {}))
        for role, replica in ROLES
    ]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)
    return actors


CRASH_FAULTS = "after_publish=STOP@1+"  # the driver stops itself after each publish; see crash_at


def crash_at(driver: subprocess.Popen[str], run_dir: Path, holds: Callable[[Path], bool], what: str) -> Path:
    """SIGKILL ``driver`` (started with ``faults=CRASH_FAULTS``) right after the first snapshot it
    publishes that ``holds`` what the case needs (``what`` names it), and return that snapshot.

    The crash point is picked by what a snapshot holds, not by a count of snapshots: how far a run has
    gone by its N-th snapshot depends on how busy the machine is. The driver stops itself after each
    publish; a snapshot that does not hold enough lets it go on. Blocking: run it in a thread.
    """
    tail: deque[str] = deque(maxlen=60)
    assert driver.stderr is not None
    for line in driver.stderr:
        tail.append(line)
        if stopped_at(line) != "after_publish":
            continue
        while not is_stopped(driver.pid) and driver.poll() is None:
            time.sleep(0.005)  # the line is written just before the stop
        _, snapshot = list_snapshots(run_dir)[-1]
        if holds(snapshot):
            driver.kill()
            driver.wait()
            return snapshot
        driver.send_signal(signal.SIGCONT)
    driver.wait()
    raise AssertionError(
        f"the run ended (exit {driver.returncode}) before any snapshot held {what}:\n{''.join(tail)[-3000:]}"
    )
