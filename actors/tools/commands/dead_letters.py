"""``parkway dead-letters show|take|purge``: the run's dead-letter queue, looked at, taken off, emptied.

``show`` leaves every letter in the queue (it prints how many the queue holds and its bounds, then the
oldest ``--limit``); ``take`` takes them off and prints one JSON object each; ``purge`` empties the
queue, and with ``--recreate`` declares it anew with the configured bounds (``PARKWAY_DEAD_LETTER_*``),
the way to bound a queue an older parkway declared without them."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from parkway.actors.runtime.settings import RunSettings
from parkway.actors.tools.commands.options import Subcommands, common, print_json
from parkway.brokers import connect
from parkway.brokers.base import Broker, DeadLetter
from parkway.protocol.signing import SENDER_HEADER


def add_dead_letters(sub: Subcommands) -> None:
    p = sub.add_parser("dead-letters", help="show, take or purge the run's dead-letter queue")
    verbs = p.add_subparsers(required=True, metavar="VERB")
    show = verbs.add_parser("show", help="print the oldest dead letters and leave them in the queue")
    common(show)
    show.add_argument("--limit", type=int, default=20, help="letters to print (default 20)")
    show.add_argument("--json", action="store_true", help="one JSON object: the count, bounds and letters")
    show.set_defaults(func=_cmd_show)
    take = verbs.add_parser("take", help="take dead letters off the queue, one JSON object each")
    common(take)
    take.add_argument("--limit", type=int, default=100)
    take.set_defaults(func=_cmd_take)
    purge = verbs.add_parser("purge", help="empty the dead-letter queue")
    common(purge)
    purge.add_argument(
        "--recreate", action="store_true", help="declare the queue anew with the configured bounds"
    )
    purge.set_defaults(func=_cmd_purge)


def _letter(letter: DeadLetter) -> dict[str, Any]:
    return {
        "origin": letter.origin,
        "code": letter.code,
        "detail": letter.detail,
        "correlation_id": letter.envelope.correlation_id,
        "sender": letter.envelope.headers.get(SENDER_HEADER, ""),
        "content_type": letter.envelope.content_type,
        "bytes": len(letter.envelope.body),
    }


def _bounds(broker: Broker) -> dict[str, Any]:
    return {
        "max_length": broker.dead_letter_bounds.max_length,
        "max_age_s": broker.dead_letter_bounds.max_age_s,
        "bounds_applied": broker.dead_letter_bounds_applied,
    }


def _broker(args: argparse.Namespace) -> Broker:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run, allow_ephemeral_secret=True)
    return connect(settings.broker_url, settings.run)


def _cmd_show(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with _broker(args) as broker:
            letters, held = await broker.peek_dead_letters(max(0, args.limit))
            bounds = _bounds(broker)
        if args.json:
            print_json({"run": broker.run, "held": held, **bounds, "letters": [_letter(d) for d in letters]})
            return 0
        kept = (
            f"at most {bounds['max_length']}, none older than {bounds['max_age_s']:g} s"
            if bounds["bounds_applied"]
            else "the queue's own, declared before these bounds: `parkway dead-letters purge --recreate`"
        )
        print(f"run {broker.run}: {held} dead letters (bounds: {kept}); the oldest {len(letters)}:")
        for letter in letters:
            row = _letter(letter)
            print(
                f"  {row['origin'] or '-'}  {row['code']}  {row['correlation_id'] or '-'}  "
                f"from {row['sender'] or '?'}  {row['bytes']} B  {row['detail'][:120]}"
            )
        return 0

    return asyncio.run(go())


def _cmd_take(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with _broker(args) as broker:
            letters = await broker.read_dead_letters(args.limit)
        for letter in letters:
            print_json(_letter(letter))
        return 0

    return asyncio.run(go())


def _cmd_purge(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with _broker(args) as broker:
            held = await broker.purge_dead_letters(recreate=args.recreate)
            bounds = _bounds(broker)
        again = (
            f"; declared anew: at most {bounds['max_length']}, none older than {bounds['max_age_s']:g} s"
            if args.recreate
            else ""
        )
        print(f"run {broker.run}: purged {held} dead letters{again}")
        return 0

    return asyncio.run(go())
