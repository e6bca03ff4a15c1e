"""``parkway status``: one table of every actor of a run (phase, checkpoint, lease, heartbeat), once or
refreshed with ``--watch``. What is asked and how the table looks is ``parkway.actors.tools.status``."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from parkway.actors.launch.roles import DEFAULT_TOPOLOGY
from parkway.actors.run.config import RunConfig, load
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.settings import RunSettings, SettingsError
from parkway.actors.tools import status as cluster_status
from parkway.actors.tools.commands.options import (
    Subcommands,
    addresses,
    cli_sender,
    common,
    parse_topology,
    print_json,
    topology_text,
)
from parkway.brokers import connect
from parkway.brokers.base import Broker


def add_status(sub: Subcommands) -> None:
    p = sub.add_parser(
        "status", help="one table of every actor of a run: phase, checkpoint, lease, heartbeat"
    )
    common(p)
    p.add_argument(
        "--topology",
        default=None,
        help=f"actors to ask even without a heartbeat ({topology_text(DEFAULT_TOPOLOGY)})",
    )
    p.add_argument(
        "--config",
        help="ask every actor of this run configuration's topology (its TQ shards, policy replicas, "
        "tool servers, agents, the controller, a trainer service) instead of --topology",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each actor's answer")
    p.add_argument(
        "--window", type=float, default=60.0, help="list actors heard from in the last N seconds (0: off)"
    )
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--json", action="store_true", help="one JSON array per refresh")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run)
    if args.config and args.topology:
        raise SettingsError("give --config or --topology, not both")
    if args.config:
        asked = addresses(config_topology(load(Path(args.config))))
    else:
        asked = addresses(parse_topology(args.topology or topology_text(DEFAULT_TOPOLOGY)))

    async def once(broker: Broker, client: Client) -> list[dict[str, Any]]:
        beats = await cluster_status.last_heartbeats(broker, window_s=args.window) if args.window > 0 else {}
        return await cluster_status.collect(client, asked, timeout=args.timeout, heartbeats=beats)

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            client = Client(broker, keyring=settings.keyring, sender=cli_sender())
            while True:
                rows = await once(broker, client)
                if args.json:
                    print_json(rows)
                else:
                    if args.watch:
                        print("\x1b[H\x1b[2J", end="")  # clear the terminal, like `watch`
                    print(cluster_status.table(rows), flush=True)
                if not args.watch:
                    return 0 if all(r["reachable"] for r in rows) else 1
                await asyncio.sleep(args.watch)

    try:
        return asyncio.run(go())
    except KeyboardInterrupt:
        return 0


def config_topology(config: RunConfig) -> dict[str, int]:
    """Every actor a run configuration's workload has, by role."""
    t = config.topology
    topology = {"tq": t.tq_shards, "policy": t.policies, "resources": t.resources, "agent": t.agents}
    topology["controller"] = 1
    if config.trainer.host == "service":
        topology["trainer"] = 1
    return topology
