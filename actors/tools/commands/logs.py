"""``parkway logs``: every actor's log lines of a run, filtered (checkpoint id, actor, rollout, event),
from the run's log stream on the broker or from saved files, once or followed."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from parkway.actors.runtime.heartbeat import HEARTBEAT_EVENT
from parkway.actors.runtime.settings import RunSettings
from parkway.actors.tools.commands.options import Subcommands, common
from parkway.brokers import connect
from parkway.protocol.tracecontext import SPAN_EVENT


def add_logs(sub: Subcommands) -> None:
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
    p.add_argument("--spans", action="store_true", help="include span lines (parkway trace reads them)")
    p.add_argument("--json", action="store_true", help="print the raw JSON lines")
    p.add_argument(
        "--idle",
        type=float,
        default=1.0,
        help="without --follow: stop after this many seconds with no new line",
    )
    p.set_defaults(func=_cmd_logs)


def format_log_line(record: dict[str, Any]) -> str:
    """A readable one-line form: time, actor, level, event, then the other fields."""
    skip = {"ts", "actor", "level", "event", "role", "replica", "run"}
    rest = " ".join(f"{k}={record[k]}" for k in sorted(record) if k not in skip)
    return f"{record.get('ts', '')} {record.get('actor', '-'):<14} {record.get('level', ''):<7} {record.get('event', '')} {rest}".rstrip()


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


def _cmd_logs(args: argparse.Namespace) -> int:
    decoder = msgspec.json.Decoder(dict[str, Any])

    def wanted(record: dict[str, Any]) -> bool:
        if record.get("event") == HEARTBEAT_EVENT and not args.heartbeats:
            return False
        if record.get("event") == SPAN_EVENT and not args.spans and args.event != SPAN_EVENT:
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
    if settings.broker_url.startswith("memory://"):  # this process's own in-memory broker: always empty
        print(
            "parkway: logs: no broker configured: give --broker or PARKWAY_BROKER_URL (the run's log "
            "stream is on its broker), or saved log FILEs",
            file=sys.stderr,
        )
        return 2

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
