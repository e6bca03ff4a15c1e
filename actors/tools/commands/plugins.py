"""``parkway plugins``: the agent programs, environments and trainers installed, and where they come
from; ``parkway plugins check --config FILE``: resolve and check the plugins a run names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parkway.actors.launch.plugins import resolve_run
from parkway.actors.run.config import ConfigError
from parkway.actors.run.config import load as load_config
from parkway.actors.run.tasks import load_tasks
from parkway.actors.sdk import plugins
from parkway.actors.tools.commands.options import Subcommands, print_json


def add_plugins(sub: Subcommands) -> None:
    p = sub.add_parser("plugins", help="list installed agent, environment and trainer plugins; check a run's")
    p.add_argument("action", nargs="?", choices=("list", "check"), default="list")
    p.add_argument("--config", help="check: the run configuration whose plugins to resolve and check")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)


def _cmd_plugins(args: argparse.Namespace) -> int:
    if args.action == "check":
        return _check(args)
    rows = [
        {"kind": str(p.kind), "name": p.spec, "class": p.target, "from": p.source}
        for p in plugins.installed()
    ]
    if args.json:
        print_json(rows)
        return 0
    headers = ("kind", "name", "class", "from")
    widths = [max([len(h), *(len(r[h]) for r in rows)]) for h in headers]
    for line in (dict(zip(headers, headers, strict=True)), *rows):
        print("  ".join(f"{line[h]:<{w}}" for h, w in zip(headers, widths, strict=True)).rstrip())
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        tasks = load_tasks(config.tasks, base=Path(args.config).parent if args.config else None)
        found = resolve_run(config, tasks)
    except ConfigError as exc:
        print(f"parkway: config: {exc}", file=sys.stderr)
        return 2
    except plugins.PluginError as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    rows = [
        *({"kind": "agent", "name": n, "class": _path(c)} for n, c in found.programs.items()),
        *({"kind": "environment", "name": n, "class": _path(c)} for n, c in found.environments.items()),
        {"kind": "trainer", "name": found.trainer.spec, "class": found.trainer.target},
    ]
    if args.json:
        print_json(rows)
    else:
        for row in rows:
            print(f"ok  {row['kind']:<11}  {row['name']}  ({row['class']})")
    return 0


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
