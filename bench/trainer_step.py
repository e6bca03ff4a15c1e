"""A slow trainer, before and after the trainer became its own actor: the step time the controller sees,
how long a snapshot takes while a step trains, the admission-closed window, and how long the
controller's event loop stood still.

The trainer plugin sleeps ``--train-s`` in every ``train`` call (a real step blocks its thread on the
GPU the same way). Before (the code at ``--before``, a ``PYTHONPATH`` link tree of the older code), the
controller ran ``train`` in its event loop under the snapshot lock; after (this tree), the trainer actor
runs it in a worker thread and the controller only waits for its answer. Each run is one embedded
workload (every actor in one process on the in-memory broker) in a fresh subprocess; ``--rounds``
rounds alternate before and after, and the table shows the medians, each run's 1-minute load average
beside it. The measures, the same code for both (wrapped around what each version has):

- *step*: from the controller handing a batch over to the batch leaving its ledger (before:
  ``TrainingHook._train_batch``; after: ``TrainingHook._train``);
- *snapshot*: one ``Controller.take_snapshot`` call, from the periodic loop asking to it returning
  (waiting for the snapshot lock included), and the longest gap between two attempts' starts (the
  loop asks every 0.1 s: a longer gap is time no snapshot could be taken);
- *pause*: the admission-closed window of each published snapshot (the controller's own metric);
- *loop stall*: the longest a 10 ms timer in the controller's process fired late.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def child(train_s: float, tasks: int) -> dict[str, Any]:
    from parkway.actors.builtin.trainers import ExampleTrainer
    from parkway.actors.launch.workload import run_workload
    from parkway.actors.roles.controller import training
    from parkway.actors.roles.controller.controller import Controller
    from parkway.actors.run.config import from_dict
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    class SlowTrainer(ExampleTrainer):
        def train(self, batch: Any) -> Any:
            time.sleep(train_s)
            return super().train(batch)

    steps: list[float] = []
    snapshots: list[float] = []
    asked: list[float] = []  # when each snapshot attempt began
    hook = training.TrainingHook
    name = "_train" if hasattr(hook, "sync") else "_train_batch"  # after has sync(): the actor
    original = getattr(hook, name)

    async def timed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await original(self, *args, **kwargs)
        finally:
            steps.append((time.perf_counter() - t0) * 1000)

    setattr(hook, name, timed_step)
    take = Controller.take_snapshot

    async def timed_snapshot(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        asked.append(t0)
        try:
            return await take(self, *args, **kwargs)
        finally:
            snapshots.append((time.perf_counter() - t0) * 1000)

    Controller.take_snapshot = timed_snapshot  # type: ignore[method-assign]
    config = from_dict(
        {
            "run": "trainer-bench",
            "seed": 11,
            "policy": {"host": "inline", "per_token_delay_s": 0.002},
            "tasks": {"builtin": "bank", "limit": tasks},
            "rollout": {"group_size": 3, "max_turns": 6},
            "trainer": {"batch_groups": 1},
            "snapshot_interval_s": 0.1,
        }
    )

    async def go() -> dict[str, Any]:
        lag = [0.0]

        async def watch() -> None:
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(0.01)
                lag[0] = max(lag[0], time.perf_counter() - t0 - 0.01)

        watcher = asyncio.get_running_loop().create_task(watch())
        state = Path(os.environ["TRAINER_BENCH_STATE"])
        t0 = time.perf_counter()
        async with MemoryBroker(MemoryHub(), config.run) as broker:
            summary = await run_workload(
                broker,
                b"bench-secret",
                config,
                load_tasks(config.tasks),
                embedded=True,
                state_root=state,
                trainer=SlowTrainer(),
            )
        wall = time.perf_counter() - t0
        watcher.cancel()
        return {
            "wall_s": round(wall, 3),
            "sealed": summary.rollouts_sealed,
            "steps_ms": [round(s, 1) for s in steps],
            "snapshot_ms": [round(s, 1) for s in snapshots],
            "snapshot_gap_ms_max": round(max(b - a for a, b in itertools.pairwise(asked)) * 1000, 1),
            "pause_ms": summary.pause_ms,
            "published": summary.snapshots_published,
            "loop_stall_ms": round(lag[0] * 1000, 1),
        }

    return asyncio.run(go())


def run_one(pythonpath: str, train_s: float, tasks: int, state: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": pythonpath, "TRAINER_BENCH_STATE": str(state)}
    load = os.getloadavg()[0]
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--train-s", str(train_s), "--tasks", str(tasks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["loadavg_1m"] = round(load, 2)
    return result


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1) if values else float("nan")


def main() -> None:
    p = common.parser(__doc__)
    common.add_name(p, "trainer_step")
    p.add_argument("--child", action="store_true", help=argparse_hidden())
    p.add_argument("--train-s", type=float, default=0.5, help="seconds every train call sleeps")
    p.add_argument("--tasks", type=int, default=4, help="bank tasks (groups of 3), one group a step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", help="PYTHONPATH of the older code (a link tree); without it, after only")
    p.add_argument("--after", default=os.environ.get("PYTHONPATH", ""), help="PYTHONPATH of this code")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.train_s, args.tasks)))
        return
    began = common.machine()
    versions = [("before", args.before)] if args.before else []
    versions.append(("after", args.after))
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in versions}
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"trainer-bench-{os.getpid()}"
    for round_ in range(args.rounds):
        for label, pythonpath in versions:  # interleaved: before, after, before, after, ...
            state = scratch / f"{label}-{round_}"
            runs[label].append(run_one(pythonpath, args.train_s, args.tasks, state))
            print(f"round {round_ + 1} {label}: {json.dumps(runs[label][-1])}", file=sys.stderr)
    rows = []
    results: dict[str, Any] = {}
    for label, samples in runs.items():
        figures = {
            "step_ms_median": median([statistics.median(r["steps_ms"]) for r in samples]),
            "snapshot_ms_median": median([statistics.median(r["snapshot_ms"]) for r in samples]),
            "snapshot_ms_max_median": median([max(r["snapshot_ms"]) for r in samples]),
            "snapshot_gap_ms_max_median": median([r["snapshot_gap_ms_max"] for r in samples]),
            "pause_ms_p50_median": median([r["pause_ms"]["p50"] for r in samples]),
            "loop_stall_ms_median": median([r["loop_stall_ms"] for r in samples]),
            "wall_s_median": round(statistics.median(r["wall_s"] for r in samples), 2),
            "loadavg_1m": [r["loadavg_1m"] for r in samples],
        }
        results[label] = {"figures": figures, "runs": samples}
        rows.append(
            [
                label,
                figures["step_ms_median"],
                figures["snapshot_ms_median"],
                figures["snapshot_ms_max_median"],
                figures["snapshot_gap_ms_max_median"],
                figures["pause_ms_p50_median"],
                figures["loop_stall_ms_median"],
                figures["wall_s_median"],
                " / ".join(str(x) for x in figures["loadavg_1m"]),
            ]
        )
    headers = [
        "code",
        "step ms",
        "snapshot ms p50",
        "snapshot ms max",
        "longest gap between snapshots ms",
        "pause ms p50",
        "loop stall ms",
        "wall s",
        "load (1 min)",
    ]
    print(common.markdown_table(headers, rows, "l" + "r" * 7 + "l"))
    path = common.write_record(args.name, "trainer_step", began, args, results, exclude=("name", "child"))
    print(f"wrote {path}", file=sys.stderr)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
