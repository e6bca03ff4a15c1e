"""``parkway chaos``: the command line of the nemesis (``chaos.nemesis``), checked before anything starts."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from parkway.actors.chaos.nemesis import ChaosError, Options, run_chaos
from parkway.actors.launch.rabbit_node import BrokerNodeError


def add_arguments(parser: Any) -> None:
    parser.add_argument("--seed", type=int, default=1, help="the seed of the fault schedule (default 1)")
    parser.add_argument(
        "--minutes",
        type=float,
        help="a long run: random workloads from the full matrix until this many minutes have passed",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the full matrix of fault kinds by protocol step (default: the short one)",
    )
    parser.add_argument("--workloads", type=int, help="run at most this many workloads")
    parser.add_argument(
        "--broker",
        help="use this RabbitMQ (URL) instead of a throwaway node of its own; broker faults are then skipped",
    )
    parser.add_argument(
        "--broker-nodes",
        type=int,
        default=1,
        help="a throwaway RabbitMQ cluster of this many nodes (quorum queues), with node stops mid-snapshot "
        "in the matrix, instead of one node (default 1)",
    )
    parser.add_argument(
        "--workdir", default=".parkway/chaos", help="where each workload's state, history and logs go"
    )
    parser.add_argument(
        "--workload-timeout", type=float, default=240.0, help="seconds a workload may take (default 240)"
    )
    parser.add_argument(
        "--tasks", type=int, default=4, help="bank tasks per workload, 3 rollouts each (default 4)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the snapshots of passing workloads too")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def usage_error(args: Any) -> str | None:
    """What is wrong with the command line, or None."""
    if args.minutes is not None and not args.minutes > 0:
        return f"--minutes {args.minutes}: want a number of minutes more than 0"
    if args.workloads is not None and args.workloads < 1:
        return f"--workloads {args.workloads}: want at least 1"
    if not args.workload_timeout > 0:
        return f"--workload-timeout {args.workload_timeout}: want a number of seconds more than 0"
    if not 1 <= args.tasks <= 4:
        return f"--tasks {args.tasks}: want 1 to 4 (the built-in bank tasks, 3 rollouts each)"
    if not 1 <= args.broker_nodes <= 7:
        return f"--broker-nodes {args.broker_nodes}: want 1 to 7"
    if args.broker_nodes > 1 and args.broker:
        return "--broker-nodes starts a cluster of its own; drop --broker"
    if args.minutes is not None and args.full:
        return "--minutes draws its workloads from the full matrix already; drop --full"
    return None


def command(args: Any) -> int:
    problem = usage_error(args)
    if problem is not None:
        print(f"parkway: chaos: {problem}", file=sys.stderr)
        return 2
    options = Options(
        seed=args.seed,
        workdir=Path(args.workdir),
        broker_url=args.broker,
        broker_nodes=args.broker_nodes,
        minutes=args.minutes,
        quick=not args.full,
        workloads=args.workloads,
        workload_timeout_s=args.workload_timeout,
        tasks=args.tasks,
        keep_passing=args.keep,
        log=None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True)),
    )

    def terminate(*_: object) -> None:
        raise KeyboardInterrupt  # unwinds through every finally: processes reaped, the node stopped

    signal.signal(signal.SIGTERM, terminate)
    try:
        result = asyncio.run(run_chaos(options))
    except KeyboardInterrupt:
        print("parkway: chaos: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except (ChaosError, BrokerNodeError) as exc:
        print(f"parkway: chaos: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True, default=str))
    else:
        print(result.text())
    return 0 if result.passed else 1
