"""``parkway demo``: the example of the seed pages, really run.

One prompt group of three siblings, five turns each. The cluster is killed right after a snapshot in
which sibling 0 has finished, sibling 1 has 2 turns and sibling 2 has 4; a fresh cluster restores it,
once under ``sibling`` and once under ``turn``, and the table counts the turns thrown away (generated
again): 6 against 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parkway.actors.launch.progress import ProgressLine, describe, watching
from parkway.actors.launch.workload import embedded_actors
from parkway.actors.roles.controller.controller import Controller
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.ids import Role
from parkway.protocol.layout import SNAPSHOTS_DIR

SECRET = b"demo"
HOLDS = {"t0000_g1": 2, "t0000_g2": 4}  # sibling 1 stops after 2 turns, sibling 2 after 4
SIBLINGS = ("t0000_g0", "t0000_g1", "t0000_g2")


@dataclass(frozen=True)
class DemoResult:
    level: str
    turns_at_snapshot: dict[str, int]
    turns_regenerated: dict[str, int]
    rollouts_sealed: int
    transcripts_sha256: str

    @property
    def thrown_away(self) -> int:
        return sum(self.turns_regenerated.values())


def demo_config(level: str) -> dict[str, object]:
    return {
        "run": "demo",
        "seed": 7,
        "rollout": {"group_size": 3, "max_turns": 5},
        "tasks": {"builtin": "bank", "limit": 1},
        "policy": {"host": "inline"},
        "recovery": {"target_level": level},
        "snapshot_interval_s": 3600.0,  # only the one snapshot the demo asks for
    }


async def _cluster(config, state: Path):
    broker = MemoryBroker(MemoryHub(), config.run)  # a fresh "machine" each time
    await broker.start()
    actors = embedded_actors(broker, SECRET, config, state)
    controller = Controller(broker, secret=SECRET, replica=0)
    for actor in [*actors, controller]:
        await actor.start()
    return broker, actors, controller


async def _stop(broker, actors) -> None:
    for actor in reversed(actors):
        with contextlib.suppress(Exception):
            await actor.stop()
    await broker.close()


def _ready(controller: Controller, agents: list) -> bool:
    """Sibling 0 sealed, siblings 1 and 2 parked at their turns: the moment of the seed pages."""
    return (
        controller.counts["rollouts_sealed"] >= 1 and sum(a.counts["held_at_boundary"] for a in agents) >= 2
    )


async def run_level(level: str, state: Path, progress_line: ProgressLine | None = None) -> DemoResult:
    config = from_dict(demo_config(level))
    tasks = load_tasks(config.tasks)
    # Phase 1: run until sibling 0 is sealed and siblings 1 and 2 are parked at their turns.
    broker, actors, controller = await _cluster(config, state)
    controller.holds = dict(HOLDS)
    workload = asyncio.create_task(
        controller.run_workload(config, tasks, snapshot_root=state / SNAPSHOTS_DIR)
    )
    agents = [a for a in actors if a.role == Role.AGENT]
    first = controller
    async with watching(lambda: describe(f"demo {level}: to the snapshot", first.progress()), progress_line):
        async with asyncio.timeout(60):
            while not _ready(controller, agents):  # noqa: ASYNC110 - watching another task's counters
                await asyncio.sleep(0.01)
        published = await controller.take_snapshot()
    assert published is not None, "the demo's snapshot did not publish"
    tq = next(a for a in actors if isinstance(a, TransferQueue))
    at_snapshot = {r: sum(1 for (k, _), n in tq.store.generations.items() if k == r) for r in SIBLINGS}
    # The crash: everything in memory is gone; only the published snapshot remains on disk.
    workload.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await workload
    await _stop(broker, [*actors, controller])
    # Phase 2: a fresh cluster restores and finishes.
    broker, actors, controller = await _cluster(config, state)
    second = controller
    async with watching(lambda: describe(f"demo {level}: after the crash", second.progress()), progress_line):
        summary = await controller.run_workload(config, tasks, snapshot_root=state / SNAPSHOTS_DIR)
    tq = next(a for a in actors if isinstance(a, TransferQueue))
    regenerated = {
        r: sum(n - 1 for (k, _), n in tq.store.generations.items() if k == r and n > 1) for r in SIBLINGS
    }
    await _stop(broker, [*actors, controller])
    return DemoResult(level, at_snapshot, regenerated, summary.rollouts_sealed, summary.transcripts_sha256)


async def run_demo(
    levels: tuple[str, ...] = ("sibling", "turn"), progress_line: ProgressLine | None = None
) -> list[DemoResult]:
    results = []
    for level in levels:
        with tempfile.TemporaryDirectory(prefix=f"parkway-demo-{level}-") as state:
            results.append(await run_level(level, Path(state), progress_line))
    return results


def table(results: list[DemoResult]) -> str:
    first = results[0]
    header = "level     " + "".join(f"{r:>16}" for r in SIBLINGS) + "   turns thrown away"
    lines = [
        "turns done at the snapshot: " + ", ".join(f"{r} {first.turns_at_snapshot[r]}" for r in SIBLINGS),
        "",
        "turns generated again after the restore:",
        header,
    ]
    for result in results:
        cells = "".join(f"{result.turns_regenerated[r]:>16}" for r in SIBLINGS)
        lines.append(f"{result.level:<10}{cells}   {result.thrown_away:>17}")
    same = len({r.transcripts_sha256 for r in results}) == 1
    lines += [
        "",
        f"every rollout sealed under each level: {all(r.rollouts_sealed == 3 for r in results)}; "
        f"identical transcripts: {same}",
    ]
    return "\n".join(lines)
