"""Signed control messages from the command line: ``parkway snapshot`` (ask the controller for one now),
``parkway publish`` (any control command to any actor, its typed reply printed) and ``parkway sign``
(the signature headers, for clients that publish by themselves). Each signs with the key the operator
gives (``PARKWAY_SIGNING_KEY``): control commands need the controller's."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from parkway.actors.runtime.client import Client, signed_envelope
from parkway.actors.runtime.settings import RunSettings, SettingsError
from parkway.actors.tools.commands.options import Subcommands, cli_sender, common, print_json
from parkway.brokers import RequestTimeout, connect
from parkway.protocol import SCHEMA_VERSION, codec
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import new_checkpoint_id, parse_address, validate_checkpoint_id
from parkway.protocol.messages import CONTROL_COMMANDS, Error, Snapshot

COMMANDS = {cls.__name__.lower(): cls for cls in CONTROL_COMMANDS}


def add_snapshot(sub: Subcommands) -> None:
    p = sub.add_parser("snapshot", help="ask the controller of a running workload to take a snapshot now")
    common(p)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument(
        "--checkpoint-id",
        help="the snapshot's checkpoint id (follow it with `parkway logs`); fresh if omitted",
    )
    p.set_defaults(func=_cmd_snapshot)


def add_publish(sub: Subcommands) -> None:
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


def add_sign(sub: Subcommands) -> None:
    p = sub.add_parser("sign", help="print signature headers for a body read from stdin")
    p.add_argument("--run")
    p.add_argument("--correlation-id", required=True)
    p.add_argument(
        "--to", required=True, help="ROLE/REPLICA the message is for (it is refused anywhere else)"
    )
    p.add_argument("--sender", default="cli/sign")
    p.add_argument("--content-type", default=codec.JSON)
    p.set_defaults(func=_cmd_sign)


def _cmd_snapshot(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run)
    try:
        checkpoint_id = validate_checkpoint_id(args.checkpoint_id or new_checkpoint_id("ck"))
    except ProtocolError as exc:  # a bad --checkpoint-id is the user's typo, not a crash
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    request = Snapshot(checkpoint_id=checkpoint_id, deadline=time.time() + args.timeout)

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            client = Client(broker, keyring=settings.keyring, sender=cli_sender())
            try:
                reply = await client.request("controller/0", request)
            except RequestTimeout:
                print_json({"type": "Timeout", "to": "controller/0"})
                return 4
        print_json(codec.to_builtins(reply))
        return 1 if isinstance(reply, Error) else 0

    return asyncio.run(go())


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
    try:
        parse_address(args.to)
        checkpoint_id = validate_checkpoint_id(args.checkpoint_id or new_checkpoint_id("cli"))
    except (ValueError, ProtocolError) as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
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
            client = Client(broker, keyring=settings.keyring, sender=cli_sender())
            content_type = codec.JSON if args.json_body else codec.MSGPACK
            try:
                reply = await client.request(args.to, message, content_type=content_type)
            except RequestTimeout:
                print_json({"type": "Timeout", "to": args.to, "checkpoint_id": checkpoint_id})
                return 4
            print_json(codec.to_builtins(reply))
            return 1 if isinstance(reply, Error) else 0

    return asyncio.run(go())


def _cmd_sign(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(run=args.run, broker_url="amqp://unused")
    body = sys.stdin.buffer.read()
    try:
        parse_address(args.to)
        message_type = type(codec.decode(body, args.content_type)).__name__  # what the signature vouches for
    except (ValueError, ProtocolError) as exc:
        print(f"parkway: {exc}", file=sys.stderr)
        return 2
    envelope = signed_envelope(
        settings.keyring,
        body,
        run=settings.run,
        sender=args.sender,
        message_type=message_type,
        correlation_id=args.correlation_id,
        to=args.to,
        content_type=args.content_type,
    )
    print_json(envelope.headers)
    return 0
