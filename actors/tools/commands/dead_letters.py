"""``parkway dead-letters``: take messages off the run's dead-letter queue and print one JSON object
each (where it was refused, why, and what it was)."""

from __future__ import annotations

import argparse
import asyncio

from parkway.actors.runtime.settings import RunSettings
from parkway.actors.tools.commands.options import Subcommands, common, print_json
from parkway.brokers import connect
from parkway.protocol.signing import SENDER_HEADER


def add_dead_letters(sub: Subcommands) -> None:
    p = sub.add_parser("dead-letters", help="take messages off the run's dead-letter queue and print them")
    common(p)
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=_cmd_dead_letters)


def _cmd_dead_letters(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, allow_ephemeral_secret=True)

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            letters = await broker.read_dead_letters(args.limit)
        for letter in letters:
            print_json(
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
