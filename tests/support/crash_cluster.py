"""The cluster and workload the process-crash tests share: every actor its own process on the real
RabbitMQ, a bank workload whose snapshots catch rollouts mid-flight, killed and restarted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from parkway.actors.runtime.client import Client

from tests.support.embedded import embedded_digest
from tests.support.processes import Process, start_driver, wait_ready

__all__ = ["CONFIG", "ROLES", "cluster", "reference_digest", "start_driver"]

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
    spawn: Callable[..., Process], client: Client, config_path: Path, state: Path
) -> list[Process]:
    """Every actor of ``ROLES`` started (``spawn`` writes under the test's ``state``) and answering."""
    actors = [spawn(role, replica, args=("--config", str(config_path))) for role, replica in ROLES]
    for actor in actors:
        await wait_ready(client, actor, timeout=60)
    return actors
