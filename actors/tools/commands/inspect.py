"""``parkway inspect memory ADDRESS``: what a live actor's memory holds (RSS, its structure sizes, the
top allocation sites by line while tracemalloc traces); ``--start`` / ``--stop`` tracing. Signs with the
key the operator gives: the query needs the controller's (``protocol/authorization.py``). What the
actor answers is ``parkway.actors.runtime.memory``."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from parkway.actors.runtime.client import Client
from parkway.actors.runtime.settings import RunSettings
from parkway.actors.tools.commands.options import Subcommands, cli_sender, common, print_json
from parkway.brokers import RequestTimeout, connect
from parkway.protocol import codec
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import new_checkpoint_id, parse_address
from parkway.protocol.inspection import MAX_TOP, MemoryReport, MemoryUsage
from parkway.protocol.messages import Error


def add_inspect(sub: Subcommands) -> None:
    p = sub.add_parser("inspect", help="look inside a live actor: `parkway inspect memory ROLE/REPLICA`")
    what = p.add_subparsers(required=True, metavar="WHAT")
    m = what.add_parser("memory", help="RSS, structure sizes and the top allocations by line of an actor")
    common(m)
    m.add_argument("address", metavar="ROLE/REPLICA")
    m.add_argument(
        "--top", type=int, default=10, help=f"allocation sites to list (0: sizes only, up to {MAX_TOP})"
    )
    tracing = m.add_mutually_exclusive_group()
    tracing.add_argument("--start", action="store_true", help="start tracing allocations (it costs) if off")
    tracing.add_argument("--stop", action="store_true", help="stop tracing allocations")
    m.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    m.add_argument("--json", action="store_true", help="the answer as one JSON object")
    m.set_defaults(func=_cmd_memory)


def _cmd_memory(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env(broker_url=args.broker, run=args.run)
    if not 0 <= args.top <= MAX_TOP:
        print(f"parkway: --top {args.top}: want 0 to {MAX_TOP}", file=sys.stderr)
        return 2
    try:
        parse_address(args.address)
        request = MemoryReport(
            checkpoint_id=new_checkpoint_id("mem"),
            deadline=time.time() + args.timeout,
            top=args.top,
            start=args.start,
            stop=args.stop,
        )
    except (ValueError, ProtocolError, TypeError) as exc:  # a typo of the operator's, not a crash
        print(f"parkway: {exc}", file=sys.stderr)
        return 2

    async def go() -> int:
        async with connect(settings.broker_url, settings.run) as broker:
            client = Client(broker, keyring=settings.keyring, sender=cli_sender())
            try:
                reply = await client.request(args.address, request)
            except RequestTimeout:
                print_json({"type": "Timeout", "to": args.address})
                return 4
        if args.json or not isinstance(reply, MemoryUsage):
            print_json(codec.to_builtins(reply))
        else:
            print(render(args.address, reply))
        return 1 if isinstance(reply, Error) else 0

    return asyncio.run(go())


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def render(address: str, usage: MemoryUsage) -> str:
    lines = [
        f"{address} pid {usage.pid}: RSS {_mb(usage.rss_bytes)} (peak {_mb(usage.peak_rss_bytes)})",
        f"tracing: {'on' if usage.tracing else 'off'}"
        + (
            f", traced {_mb(usage.traced_bytes)} (peak {_mb(usage.traced_peak_bytes)})"
            if usage.tracing
            else ""
        ),
    ]
    if usage.heap is not None:
        heap = usage.heap
        lines.append(
            f"heap: C in use {_mb(heap.c_in_use_bytes)}, C freed but kept {_mb(heap.c_free_bytes)}"
            f" (of {_mb(heap.c_arena_bytes)}), Python blocks {heap.python_blocks}"
        )
    if usage.note:
        lines.append(f"note: {usage.note}")
    if usage.structures:
        lines.append("structures:")
        lines += [f"  {name:<28} {size:>12}" for name, size in sorted(usage.structures.items())]
    if usage.top:
        lines.append(f"top {len(usage.top)} allocation sites (bytes held, blocks, line):")
        lines += [f"  {a.size_bytes:>12} {a.count:>8}  {a.file}:{a.line}" for a in usage.top]
    return "\n".join(lines)
