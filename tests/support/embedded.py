"""Whole runs embedded on the in-memory broker: one workload on a fresh cluster (a fresh "machine" each
call), the crashed run whose snapshots several tests read, and the digest an uncrashed run reaches."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from tests.support.signed import SECRET


async def started_cluster(config: Any, state: Path, trainer: Any) -> tuple[Any, list[Any], asyncio.Task[Any]]:
    """Every actor of ``config`` and a controller started on a fresh in-memory broker, and its workload
    running as a task (which stops them all and closes the broker when it ends, or is cancelled: a
    cluster that dies): ``(controller, actors, workload)``, for a test that acts while it runs."""
    from parkway.actors.launch.workload import embedded_actors
    from parkway.actors.roles.controller.controller import Controller
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub
    from parkway.protocol.layout import SNAPSHOTS_DIR

    broker = MemoryBroker(MemoryHub(), config.run)
    await broker.__aenter__()
    actors = embedded_actors(broker, SECRET, config, state)
    controller = Controller(broker, secret=SECRET)
    for actor in [*actors, controller]:
        await actor.start()

    async def workload() -> Any:
        try:
            return await controller.run_workload(
                config, load_tasks(config.tasks), trainer, snapshot_root=state / SNAPSHOTS_DIR
            )
        finally:
            for actor in reversed([*actors, controller]):
                with contextlib.suppress(Exception):
                    await actor.stop()
            await broker.close()

    return controller, actors, asyncio.ensure_future(workload())


async def embedded_run(
    data: dict[str, Any],
    state: Path,
    *,
    snapshots: bool = True,
    stop_after: int | None = None,
    trainer: Any = None,
) -> Any:
    """One workload of configuration ``data`` on a fresh in-memory cluster (a fresh "machine" each call)."""
    from parkway.actors.launch.workload import run_workload
    from parkway.actors.run.config import from_dict
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    config = from_dict(data)
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        return await run_workload(
            broker,
            SECRET,
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=state,
            snapshots=snapshots,
            stop_after_snapshots=stop_after,
            trainer=trainer,
        )


SNAPSHOT_RUN: dict[str, Any] = {
    "run": "snaps",
    "seed": 3,
    "policy": {"host": "inline", "per_token_delay_s": 0.0003},
    "tasks": {"builtin": "bank", "limit": 3},
    "rollout": {"group_size": 3, "max_turns": 6},
    "snapshot_interval_s": 0.05,
}


async def crashed_run(state: Path, published: int = 2) -> Path:
    """The run directory of ``SNAPSHOT_RUN`` stopped dead right after its ``published``-th snapshot:
    real snapshots on disk, no COMPLETED marker."""
    await crash_after(SNAPSHOT_RUN, state, published)
    return state / "snapshots" / SNAPSHOT_RUN["run"]


async def crash_after(data: dict[str, Any], state: Path, published: int = 2) -> None:
    """Run ``data`` until it stops dead right after its ``published``-th snapshot (``SimulatedCrash``,
    caught here); an ``AssertionError`` if the run ended first, so no crash test passes uncrashed.

    Generated at a slower pace than the runs that restore it (a tuning setting: the snapshots stay
    restorable under ``data``), so that its snapshots are published before its rollouts end even on a
    loaded machine, where one snapshot took half a second and the run ended before the second."""
    from parkway.actors.roles.controller.controller import SimulatedCrash

    pace = max(float(data.get("policy", {}).get("per_token_delay_s", 0.0)), 0.003)
    slower = {**data, "policy": {**data.get("policy", {}), "per_token_delay_s": pace}}
    try:
        await embedded_run(slower, state, stop_after=published)
    except SimulatedCrash:
        return
    raise AssertionError(f"the run finished before its snapshot {published} was published")


async def embedded_digest(config_path: Path, state: Path) -> str:
    """The transcripts digest of the same configuration run embedded, uncrashed, without snapshots."""
    from parkway.actors.launch.workload import run_workload
    from parkway.actors.run.config import load
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    config = load(config_path, environ={})
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        summary = await run_workload(
            broker,
            b"embedded",
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=state,
            snapshots=False,
        )
    return summary.transcripts_sha256
