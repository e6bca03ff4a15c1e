"""``parkway trace CHECKPOINT_ID``: one snapshot's waterfall in the terminal, with no trace backend.

The spans come from the run's log stream on the broker (actors export them there with
``OTEL_TRACES_EXPORTER=parkway``) or from files of span lines (``OTEL_TRACES_EXPORTER=file``, or
``parkway logs --json`` saved to a file). docs/tracing.md#parkway-trace shows the output; ``--png``
also draws it as a picture (matplotlib, the ``report`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
from parkway.actors.runtime.settings import RunSettings
from parkway.actors.tools import waterfall
from parkway.actors.tools.commands.logs import read_log_files
from parkway.actors.tools.commands.options import Subcommands, common
from parkway.actors.tools.report import INSTALL_HINT
from parkway.brokers import connect
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import validate_checkpoint_id
from parkway.protocol.tracecontext import checkpoint_trace_id, trace_id_hex


def add_trace(sub: Subcommands) -> None:
    p = sub.add_parser(
        "trace", help="one snapshot's waterfall (which participant, which step, queued vs handled)"
    )
    common(p)
    p.add_argument("checkpoint_id", metavar="CHECKPOINT_ID", help="the snapshot's (or restore's) id")
    p.add_argument(
        "files", nargs="*", metavar="FILE", help="files of span lines to read instead of the broker"
    )
    p.add_argument("--critical", action="store_true", help="only the rows on the critical path")
    p.add_argument("--json", action="store_true", help="print the trace's span records instead")
    p.add_argument(
        "--png",
        metavar="FILE",
        type=Path,
        help=f"also draw the waterfall into this PNG file (needs matplotlib: {INSTALL_HINT})",
    )
    p.add_argument(
        "--idle", type=float, default=1.0, help="stop reading the broker after this many seconds idle"
    )
    p.set_defaults(func=_cmd_trace)


def _records_from_files(paths: list[str]) -> list[dict[str, Any]]:
    decoder = msgspec.json.Decoder(dict[str, Any])
    records = []
    for line in read_log_files(paths):
        try:
            records.append(decoder.decode(line))
        except msgspec.DecodeError:
            continue  # not a JSON line of ours
    return records


async def _records_from_broker(url: str, run: str, trace_id: str, idle_s: float) -> list[dict[str, Any]]:
    decoder = msgspec.json.Decoder(dict[str, Any])
    records = []
    async with connect(url, run) as broker:
        lines = broker.follow_logs(from_start=True)
        while True:
            try:
                raw = await asyncio.wait_for(anext(lines), idle_s)
            except (TimeoutError, StopAsyncIteration):
                break
            if trace_id.encode() not in raw:  # most lines are not this trace's: skip them undecoded
                continue
            try:
                records.append(decoder.decode(raw))
            except msgspec.DecodeError:
                continue
        await lines.aclose()
    return records


def _cmd_trace(args: argparse.Namespace) -> int:
    try:
        checkpoint_id = validate_checkpoint_id(args.checkpoint_id)
    except ProtocolError as exc:
        print(f"parkway: trace: {exc.detail}", file=sys.stderr)
        return 2
    trace_id = trace_id_hex(checkpoint_trace_id(checkpoint_id))
    if args.files:
        try:
            records = _records_from_files(args.files)
        except OSError as exc:
            print(f"parkway: trace: {exc}", file=sys.stderr)
            return 2
    else:
        settings = RunSettings.from_env(broker_url=args.broker, run=args.run, allow_ephemeral_secret=True)
        if settings.broker_url.startswith("memory://"):
            print(
                "parkway: trace: no broker configured: give --broker or PARKWAY_BROKER_URL (the spans "
                "are on the run's log stream), or FILEs of span lines",
                file=sys.stderr,
            )
            return 2
        records = asyncio.run(_records_from_broker(settings.broker_url, settings.run, trace_id, args.idle))
    if args.json:
        for record in waterfall.spans_of(records, trace_id):
            print(json.dumps(record, sort_keys=True))
    built = waterfall.build(records, checkpoint_id)
    if built is None:
        print(
            f"parkway: trace: no span of trace {trace_id} (checkpoint {checkpoint_id}) found; were the "
            "actors started with OTEL_TRACES_EXPORTER=parkway (or file)?",
            file=sys.stderr,
        )
        return 1
    if not args.json:
        print(waterfall.render(built, critical_only=args.critical))
    if args.png is not None:
        return _draw(built, args.png)
    return 0


def _draw(built: waterfall.Waterfall, path: Path) -> int:
    try:
        waterfall.render_png(built, path)
    except ImportError as exc:
        print(f"parkway: trace: drawing needs matplotlib: {INSTALL_HINT} ({exc})", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"parkway: trace: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"parkway: trace: drew {path}", file=sys.stderr)
    return 0
