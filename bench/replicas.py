"""Rollouts per second and the snapshot pause against the number of agents and tool servers, on one
RabbitMQ node and on a three-node cluster with quorum queues, in interleaved rounds.

    python bench/replicas.py [--rounds 3] [--replicas 1 2 4] [--prompts 16]

Every actor its own ``parkway actor`` process, the controller in this process (``bench/cluster.py``):
TQ, one policy (the deterministic engine, ``--token-delay`` a token), ``r`` tool servers and ``r``
agents for each ``r`` of ``--replicas``, ``--prompts`` mixed tasks of 4 rollouts each, up to 32 in
flight, a snapshot every ``--interval`` seconds. Brokers:

- ``single``: the machine's RabbitMQ (``PARKWAY_BENCH_AMQP_URL``), classic queues;
- ``cluster``: a throwaway three-node cluster (``actors/launch/rabbit_cluster.py``, started once for
  the whole bench, about 20 s not counted), quorum queues, every process given the node list.

Each round runs every (broker, replicas) variant once, the order rotated from round to round; the table
gives medians over rounds and each variant's rollouts per second against one replica on one node. All
of it shares this machine's cores: more processes on two cores measure the framework's overhead per
replica, not what replicas on machines of their own would gain.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import cluster
import common
from parkway.actors.launch.rabbit_cluster import RabbitCluster
from parkway.brokers.rabbitmq_layout import QUEUE_TYPE_ENV

BROKERS = ("single", "cluster")
SINGLE_URL = cluster.URL


def workload(replicas: int, args: Any, index: int) -> dict[str, Any]:
    return {
        "run": f"replicas-{replicas}-{index}-{os.getpid()}",
        "seed": 4,
        "rollout": {"group_size": 4, "max_turns": 8, "max_in_flight": 32},
        "tasks": {"path": str(cluster.tasks_file(args.prompts, turns=(3, 6)))},
        "policy": {"host": "inline", "per_token_delay_s": args.token_delay},
        "topology": {"agents": replicas, "resources": replicas},
        "snapshot_interval_s": args.interval,
        "prepare_timeout_s": 30,
    }


@contextlib.contextmanager
def broker(kind: str, nodes: RabbitCluster | None) -> Any:
    """The bench's processes on ``kind``'s broker: the URL the cluster module hands every process, and
    the queue type in this process's environment (the actors inherit it)."""
    saved = os.environ.get(QUEUE_TYPE_ENV)
    if kind == "cluster":
        assert nodes is not None
        cluster.URL, os.environ[QUEUE_TYPE_ENV] = nodes.url_list, "quorum"
    try:
        yield
    finally:
        cluster.URL = SINGLE_URL
        if saved is None:
            os.environ.pop(QUEUE_TYPE_ENV, None)
        else:
            os.environ[QUEUE_TYPE_ENV] = saved


async def one(kind: str, replicas: int, args: Any, index: int, nodes: RabbitCluster | None) -> dict[str, Any]:
    data = workload(replicas, args, index)
    with broker(kind, nodes):
        async with cluster.started(data, "rabbitmq", kill_at_end=True) as c:
            summary = await c.run()
    if summary.rollouts_sealed != summary.rollouts_expected or summary.rollouts_failed:
        raise SystemExit(f"{kind} x{replicas}: the run did not complete: {summary}")
    return {
        "broker": kind,
        "replicas": replicas,
        "wall_s": summary.wall_s,
        "rollouts": summary.rollouts_sealed,
        "rollouts_per_s": summary.rollouts_per_s,
        "pause_p50_ms": summary.pause_ms["p50"],
        "pause_p95_ms": summary.pause_ms["p95"],
        "snapshots": summary.snapshots_published,
        "by_agent": summary.rollouts_by_agent,
        "load_1m": common.load_1m(),
    }


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=16, help="mixed tasks, 4 rollouts each")
    parser.add_argument("--token-delay", type=float, default=0.002, help="engine seconds a token")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between snapshots")
    common.add_name(parser, "replicas")
    args = parser.parse_args()
    began = common.machine()
    variants = [(kind, r) for kind in BROKERS for r in args.replicas]
    runs: list[dict[str, Any]] = []
    with RabbitCluster(f"parkway-replicas-{os.getpid()}-") as nodes:
        for index in range(args.rounds):
            shift = index % len(variants)
            for kind, replicas in variants[shift:] + variants[:shift]:
                run = asyncio.run(one(kind, replicas, args, index, nodes))
                run["round"] = index
                runs.append(run)
                print(
                    f"round {index} {kind} x{replicas}: {run['rollouts_per_s']:.2f} rollouts/s, "
                    f"pause p95 {run['pause_p95_ms']:.0f} ms, load {run['load_1m']}",
                    flush=True,
                )
    keys = ("wall_s", "rollouts_per_s", "pause_p50_ms", "pause_p95_ms")
    names = [f"{kind} x{replicas}" for kind, replicas in variants]
    medians = common.medians_by(runs, names, lambda r: f"{r['broker']} x{r['replicas']}", keys)
    base = medians[f"single x{args.replicas[0]}"]["rollouts_per_s"]
    rows = [
        (
            name.split(" x")[0],
            name.split(" x")[1],
            f"{m['wall_s']:.1f}",
            f"{m['rollouts_per_s']:.2f}",
            f"{m['rollouts_per_s'] / base:.2f}",
            f"{m['pause_p50_ms']:.0f}",
            f"{m['pause_p95_ms']:.0f}",
        )
        for name, m in medians.items()
    ]
    print(f"\n{common.runs_line(began, runs)}")
    print(
        common.markdown_table(
            [
                "broker",
                "agents = tool servers",
                "wall s",
                "rollouts/s",
                "vs single x1",
                "pause p50 ms",
                "pause p95 ms",
            ],
            rows,
        )
    )
    path = common.write_record(args.name, "replicas", began, args, runs, medians=medians)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
