"""What several commands share: the broker, run and metrics options, the topology syntax, the CLI's
sender name, and printing JSON."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any, TypeAlias

from parkway.actors.launch.roles import ROLES
from parkway.actors.runtime.settings import SettingsError
from parkway.brokers.urls import redact_url
from parkway.protocol.ids import Role, actor_address

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", help="broker URL (default: $PARKWAY_BROKER_URL, else memory://)")
    p.add_argument("--run", help="run name: the namespace on the broker (default: $PARKWAY_RUN or 'default')")


BROKER_SCHEMES = ("memory://", "amqp://", "amqps://")


def broker_url_problem(url: str | None) -> str | None:
    """Why a broker URL (``--broker`` or ``$PARKWAY_BROKER_URL``) cannot be used, or None: caught before
    a command connects, so a typo is one line, not a traceback from the transport factory."""
    if not url:
        return None
    parts = [part.strip() for part in url.split(",") if part.strip()] or [""]
    if len(parts) > 1 and not all(part.startswith(("amqp://", "amqps://")) for part in parts):
        return (
            f"broker URL list {redact_url(url)!r}: several nodes are amqp:// URLs, comma-separated, "
            "each of a node of one RabbitMQ cluster"
        )
    if parts[0].startswith(BROKER_SCHEMES):
        return None
    return f"unsupported broker URL {redact_url(url)!r}: use memory:// or amqp://user:pass@host:port/"


def metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics "
        "(default: $PARKWAY_METRICS_PORT; 0 or unset: off)",
    )


def progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        choices=["auto", "always", "never"],
        default="auto",
        help="a live progress line on stderr (auto: on a terminal, not with --json)",
    )


def topology_text(topology: Mapping[Role, int]) -> str:
    return ",".join(f"{role}={n}" for role, n in topology.items())


def parse_topology(text: str) -> dict[str, int]:
    topology: dict[str, int] = {}
    for item in text.split(","):
        role, _, count = item.partition("=")
        if role not in ROLES or not count.isdigit():
            raise SettingsError(f"topology item {item!r}: want ROLE=N with ROLE one of {sorted(ROLES)}")
        topology[role] = int(count)
    return topology


def addresses(topology: dict[str, int]) -> list[str]:
    return [actor_address(role, i) for role, n in topology.items() for i in range(n)]


def cli_sender() -> str:
    return f"cli/{os.getpid()}"


def print_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))
