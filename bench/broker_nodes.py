"""One RabbitMQ node against a three-node cluster with quorum queues, and what losing a node costs: the
same workload's wall time, rollouts per second and snapshot pause, in interleaved rounds.

    python bench/broker_nodes.py [--rounds 3] [--tasks 4] [--down 8]

Each variant runs the chaos harness's workload (``actors/chaos/nemesis.py``: every actor and the
controller its own process, 3 rollouts of each of ``--tasks`` bank tasks, a snapshot every 0.5 s) on a
broker of its own started for it:

- ``single``: one throwaway node, classic queues (what ``docker compose up`` runs);
- ``cluster``: a throwaway three-node cluster, quorum queues, each process connected first to its own
  node and failing over along the list;
- ``cluster, node lost``: the same, with the node of some actors (not the controller's) stopped at a
  save step (``save_commit``) for ``--down`` seconds and started again.

Each round runs every variant once, in an order rotated from round to round; the table gives medians
over rounds and ratios to ``single``. The broker's own start (a node about 5 s, a cluster about 20 s)
is not in the figures: they are the run's (``parkway run``'s summary).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import common
from parkway.actors.chaos.nemesis import Options, run_chaos
from parkway.actors.chaos.schedule import FaultKind, OutagePoint, WorkloadPlan

VARIANTS = ("single", "cluster", "cluster, node lost")
SEED = 18


async def one(variant: str, args: Any, workdir: Path) -> dict[str, Any]:
    outage = [OutagePoint("save_commit", FaultKind.NODE_STOP, args.down, 2)] if "lost" in variant else []
    result = await run_chaos(
        Options(
            seed=SEED,
            workdir=workdir,
            broker_nodes=1 if variant == "single" else 3,
            plans=[WorkloadPlan(index=0, seed=SEED, outage_points=outage)],
            tasks=args.tasks,
            workload_timeout_s=300.0,
        )
    )
    [workload] = result.workloads
    summary = workload.summary or {}
    if workload.error or not summary or summary["rollouts_sealed"] != summary["rollouts_expected"]:
        raise SystemExit(f"{variant}: the run did not complete: {workload.error} {workload.notes}")
    return {
        "variant": variant,
        "wall_s": summary["wall_s"],
        "rollouts": summary["rollouts_sealed"],
        "rollouts_per_s": summary["rollouts_sealed"] / summary["wall_s"],
        "pause_p50_ms": summary["pause_ms"]["p50"],
        "pause_p95_ms": summary["pause_ms"]["p95"],
        "pause_max_ms": summary["pause_ms"]["max"],
        "snapshots": summary["snapshots_published"],
        "faults": [f.kind for f in workload.faults],
        "load_1m": common.load_1m(),
    }


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=4, help="bank tasks, 3 rollouts each (1 to 4)")
    parser.add_argument("--down", type=float, default=8.0, help="seconds the lost node stays down")
    common.add_name(parser, "broker_nodes")
    args = parser.parse_args()
    began = common.machine()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pk-broker-nodes-") as tmp:
        for index in range(args.rounds):
            order = VARIANTS[index % len(VARIANTS) :] + VARIANTS[: index % len(VARIANTS)]
            for variant in order:
                run = asyncio.run(one(variant, args, Path(tmp) / f"r{index}-{variant.replace(' ', '')}"))
                run["round"] = index
                runs.append(run)
                print(
                    f"round {index} {variant}: {run['wall_s']:.1f} s, pause p95 {run['pause_p95_ms']:.0f} ms",
                    flush=True,
                )
    keys = ("wall_s", "rollouts_per_s", "pause_p50_ms", "pause_p95_ms", "pause_max_ms")
    medians = common.medians_by(runs, VARIANTS, lambda r: r["variant"], keys)
    base = medians["single"]
    rows = [
        (
            variant,
            f"{m['wall_s']:.1f}",
            f"{m['rollouts_per_s']:.2f}",
            f"{m['rollouts_per_s'] / base['rollouts_per_s']:.2f}",
            f"{m['pause_p50_ms']:.0f}",
            f"{m['pause_p95_ms']:.0f}",
            f"{m['pause_max_ms']:.0f}",
        )
        for variant, m in medians.items()
    ]
    print(f"\n{common.runs_line(began, runs)}")
    print(
        common.markdown_table(
            ["broker", "wall s", "rollouts/s", "vs single", "pause p50 ms", "pause p95 ms", "pause max ms"],
            rows,
        )
    )
    path = common.write_record(args.name, "broker_nodes", began, args, runs, medians=medians)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
