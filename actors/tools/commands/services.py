"""Actors as long-running services: ``parkway up`` (every actor in one process) and ``parkway actor``
(one actor, as each compose service runs it)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from parkway.actors.launch.roles import DEFAULT_TOPOLOGY, ROLES
from parkway.actors.launch.service import build_actor, lower_cpu_priority, serve
from parkway.actors.run.config import ConfigError
from parkway.actors.run.config import load as load_config
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.logs import configure_logging
from parkway.actors.runtime.settings import NICE_ENV, RunSettings, nice_increment, parse_nice
from parkway.actors.tools import status as cluster_status
from parkway.actors.tools.commands.options import (
    Subcommands,
    cli_sender,
    common,
    metrics,
    parse_topology,
    topology_text,
)
from parkway.brokers import connect
from parkway.brokers.urls import redact_url
from parkway.protocol.ids import new_checkpoint_id
from parkway.protocol.messages import Probe


def add_up(sub: Subcommands) -> None:
    p = sub.add_parser("up", help="start every actor in one process")
    common(p)
    metrics(p)
    p.add_argument("--topology", default=topology_text(DEFAULT_TOPOLOGY), help="role=replicas,... to start")
    p.add_argument(
        "--for", dest="duration", type=float, help="stop after this many seconds (default: run until Ctrl-C)"
    )
    p.add_argument(
        "--durable", action="store_true", help="give each actor a reply journal under $PARKWAY_STATE_DIR"
    )
    p.set_defaults(func=_cmd_up)


def add_actor(sub: Subcommands) -> None:
    p = sub.add_parser("actor", help="run one actor as a service")
    common(p)
    metrics(p)
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--no-journal", action="store_true", help="keep the reply cache in memory only")
    p.add_argument(
        "--config", help="run configuration: the role reads its section (policy engine, resources mode)"
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--nice",
        help=f"lower this process's CPU priority by 0 to 19 (default: ${NICE_ENV}, else 0): for the roles "
        "off a snapshot's window (policy, resources, tq) on a host they share with the agents",
    )
    p.set_defaults(func=_cmd_actor)


def _cmd_up(args: argparse.Namespace) -> int:
    # In memory a throwaway secret is fine; on a real broker other processes must share it.
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, metrics_port=args.metrics_port)
    topology = parse_topology(args.topology)
    configure_logging()

    async def go() -> None:
        broker = connect(settings.broker_url, settings.run, wait_s=settings.broker_wait_s)
        async with broker:
            actors = [
                build_actor(role, replica, broker, settings, durable=args.durable)
                for role, n in topology.items()
                for replica in range(n)
            ]
            client = Client(broker, keyring=settings.keyring, sender=cli_sender())

            async def announce() -> None:
                rows = await cluster_status.collect(client, [a.address for a in actors], timeout=3.0)
                print(cluster_status.table(rows), file=sys.stderr, flush=True)
                probe = Probe(checkpoint_id=new_checkpoint_id("probe"), deadline=time.time() + 5)
                for actor in actors:
                    await client.call(actor.address, probe)
                print(
                    f"parkway up: {len(actors)} actors of run {settings.run!r} on {redact_url(settings.broker_url)} "
                    "answer; Ctrl-C stops them",
                    file=sys.stderr,
                    flush=True,
                )

            await serve(
                broker,
                actors,
                duration_s=args.duration,
                on_started=announce,
                metrics_port=settings.metrics_port,
            )

    asyncio.run(go())
    return 0


def _cmd_actor(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, metrics_port=args.metrics_port)
    settings.refuse_shared_secret(f"parkway actor {args.role}")
    nice = parse_nice(args.nice) if args.nice is not None else nice_increment()
    try:
        config = load_config(args.config) if args.config else None
    except ConfigError as exc:
        print(f"parkway: config: {exc}", file=sys.stderr)
        return 2
    configure_logging(level=args.log_level)
    lower_cpu_priority(nice)

    async def go() -> None:
        broker = connect(
            settings.broker_url,
            settings.run,
            connection_name=f"parkway-{settings.run}-{args.role}-{args.replica}",
            wait_s=settings.broker_wait_s,
        )
        async with broker:
            actor = build_actor(
                args.role, args.replica, broker, settings, durable=not args.no_journal, config=config
            )
            await serve(broker, [actor], metrics_port=settings.metrics_port)

    asyncio.run(go())
    return 0
