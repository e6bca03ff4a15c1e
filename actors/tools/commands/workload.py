"""Workloads run to completion: ``parkway run`` (a configured workload, embedded or driving services)
and ``parkway demo`` (the seed pages' example under two recovery levels)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import msgspec
from parkway.actors.launch import progress
from parkway.actors.launch.plugins import resolve_run
from parkway.actors.launch.progress import ProgressLine
from parkway.actors.launch.workload import run_workload, workload_controller
from parkway.actors.roles.controller import (
    ClusterUnavailable,
    RunSummary,
    SetupError,
    SnapshotsEnded,
    Unauthorized,
)
from parkway.actors.run.config import ConfigError
from parkway.actors.run.config import load as load_config
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.logs import configure_logging
from parkway.actors.runtime.settings import RunSettings, SettingsError
from parkway.actors.sdk.plugins import PluginError
from parkway.actors.storage.select import SnapshotInvalid
from parkway.actors.tools.commands.options import Subcommands, common, metrics, print_json, progress_option
from parkway.brokers import connect
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ProtocolError
from parkway.protocol.snapshot import SnapshotFailure


def add_run(sub: Subcommands) -> None:
    p = sub.add_parser("run", help="run a configured workload to completion and print a summary")
    common(p)
    metrics(p)
    p.add_argument("--config", help="YAML run configuration (see examples/); defaults apply without one")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--log-level", default="warning", help="log level of the actors' JSON lines on stderr")
    progress_option(p)
    p.set_defaults(func=_cmd_run)


def add_demo(sub: Subcommands) -> None:
    p = sub.add_parser(
        "demo", help="the seed pages' example, really run: turns thrown away under sibling vs turn"
    )
    p.add_argument("--json", action="store_true")
    progress_option(p)
    p.set_defaults(func=_cmd_demo)


def _progress_line(args: argparse.Namespace) -> ProgressLine | None:
    return (
        ProgressLine() if progress.enabled(args.progress, json_output=args.json, stream=sys.stderr) else None
    )


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        tasks = load_tasks(config.tasks, base=Path(args.config).parent if args.config else None)
        resolve_run(config, tasks)  # every plugin it names, checked before anything starts
    except ConfigError as exc:
        print(f"parkway: config: {exc}", file=sys.stderr)
        return 2
    except PluginError as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    run = args.run or os.environ.get("PARKWAY_RUN") or config.run
    settings = RunSettings.from_env(broker_url=args.broker, run=run, metrics_port=args.metrics_port)
    configure_logging(level=args.log_level)
    embedded = settings.broker_url.startswith("memory://")
    line = _progress_line(args)

    async def go() -> RunSummary:
        broker = connect(
            settings.broker_url,
            settings.run,
            connection_name=f"parkway-{settings.run}-run",
            wait_s=settings.broker_wait_s,
        )
        async with broker:
            controller = workload_controller(broker, settings.keyring, config)
            label = f"run {settings.run}"
            async with progress.watching(lambda: progress.describe(label, controller.progress()), line):
                return await run_workload(
                    broker,
                    settings.keyring,
                    config,
                    tasks,
                    embedded=embedded,
                    state_root=settings.state_root,
                    metrics_port=settings.metrics_port,
                    controller=controller,
                )

    try:
        summary = asyncio.run(go())
    except Unauthorized as exc:  # the actors refuse everything this driver signs: exit 2 at once
        print(f"parkway: unauthorized: {exc}", file=sys.stderr)
        return 2
    except SetupError as exc:
        print(f"parkway: setup: {exc}", file=sys.stderr)
        return 2
    except ClusterUnavailable as exc:  # exit 3, like a broker that is down: a later start may work
        print(f"parkway: cluster: {exc}", file=sys.stderr)
        return 3
    except SnapshotsEnded as exc:
        print(
            f"parkway: snapshots: {exc}; starting the run again restores its newest snapshot", file=sys.stderr
        )
        return 3
    except SnapshotFailure as exc:  # the restore at the start failed (its participants were told to abort it)
        print(f"parkway: restore failed at {exc.step}: {exc.detail}", file=sys.stderr)
        return 3 if exc.transient else 2
    except SnapshotInvalid as exc:  # nothing restorable (every snapshot corrupt), or another topology
        print(f"parkway: restore: {exc}", file=sys.stderr)
        return 2
    except (BrokerError, ProtocolError, SettingsError, ConfigError, PluginError):
        raise  # ``cli.main`` gives each its line and exit code
    except Exception as exc:  # anything else ends the run with a line, not a traceback (run_aborted logs it)
        print(f"parkway: run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    fields = msgspec.structs.asdict(summary)
    if args.json:
        print_json(fields)
    else:
        width = max(len(k) for k in fields)
        for key, value in fields.items():
            print(f"{key:<{width}}  {value}")
    complete = summary.rollouts_sealed + summary.rollouts_failed == summary.rollouts_expected
    return 0 if complete and summary.rollouts_failed == 0 else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from parkway.actors.launch.demo import run_demo, table

    configure_logging(level="warning")
    line = _progress_line(args)
    results = asyncio.run(run_demo(progress_line=line))
    if args.json:
        print_json(
            [
                {
                    "level": r.level,
                    "turns_at_snapshot": r.turns_at_snapshot,
                    "turns_regenerated": r.turns_regenerated,
                    "turns_thrown_away": r.thrown_away,
                    "rollouts_sealed": r.rollouts_sealed,
                }
                for r in results
            ]
        )
    else:
        print(table(results))
    return 0
