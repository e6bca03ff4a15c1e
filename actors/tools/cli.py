"""The ``parkway`` command line.

parkway up         every actor in one process (in-memory broker unless --broker)
parkway actor      one actor as a service
parkway publish    send one signed command to an actor and print its typed reply
parkway status     ask actors for their status
parkway logs       every actor's log lines (of one checkpoint id, actor, rollout), live or from saved files
parkway report     a run's timeline (rollouts, turns, snapshot pauses, crash, restore) as PNG and HTML
parkway chaos      the nemesis: seeded faults over a real cluster of processes, each run history-checked
parkway dead-letters   show, take or purge the run's dead-letter queue (show|take|purge)
parkway snapshots  list, show or verify the snapshots on disk (list|show|verify)
parkway plugins    the agent programs, environments and trainers installed (list), or a run's (check)
parkway sign       print the signature headers for a body (for rabbitmqadmin and other clients)
parkway keys       make a key pair for every role (generate --env prints .env lines)

Each command lives with its job under ``parkway.actors.tools.commands`` (or in its tool's own module:
``report``, ``snapshots``, the chaos ``nemesis``); this module builds the parser from them in the order
``parkway --help`` lists them, and maps the errors every command may raise to exit codes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from parkway.actors.chaos import command as chaos
from parkway.actors.run.config import ConfigError
from parkway.actors.runtime.settings import SettingsError
from parkway.actors.sdk.plugins import PluginError
from parkway.actors.tools import report
from parkway.actors.tools.commands import (
    control,
    dead_letters,
    inspect,
    keys,
    logs,
    model,
    plugins,
    services,
    status,
    workload,
)
from parkway.actors.tools.commands.options import Subcommands, broker_url_problem
from parkway.actors.tools.snapshots import register as add_snapshots
from parkway.brokers import BrokerError
from parkway.protocol.errors import ProtocolError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if hasattr(args, "broker"):  # the commands that talk to a broker: its URL must be one we speak
        problem = broker_url_problem(args.broker or os.environ.get("PARKWAY_BROKER_URL"))
        if problem is not None:
            print(f"parkway: broker: {problem}", file=sys.stderr)
            return 2
    try:
        return int(args.func(args) or 0)
    except SettingsError as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    except BrokerError as exc:
        print(f"parkway: broker: {exc}", file=sys.stderr)
        return 3
    except ProtocolError as exc:  # e.g. a reply whose signature does not verify: the wrong secret
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    except PluginError as exc:  # a plugin the configuration names, refused at set-up
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"parkway: config: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _add_report(sub: Subcommands) -> None:
    p = sub.add_parser("report", help="draw a run's timeline from its log lines: RUN.png and RUN.html")
    report.add_arguments(p)
    p.set_defaults(func=report.command)


def _add_chaos(sub: Subcommands) -> None:
    p = sub.add_parser(
        "chaos", help="kill, pause and restart a real cluster on a seeded schedule; check every history"
    )
    chaos.add_arguments(p)
    p.set_defaults(func=chaos.command)


# In the order ``parkway --help`` lists them.
SUBCOMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    services.add_up,
    services.add_actor,
    workload.add_run,
    model.add_model,
    workload.add_demo,
    control.add_snapshot,
    control.add_publish,
    status.add_status,
    inspect.add_inspect,
    logs.add_logs,
    _add_report,
    _add_chaos,
    dead_letters.add_dead_letters,
    plugins.add_plugins,
    add_snapshots,
    control.add_sign,
    keys.add_keys,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parkway", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
