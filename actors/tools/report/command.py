"""``parkway report RUN``: its arguments, where it reads the lines from, and writing RUN.png and RUN.html."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
from parkway.actors.runtime.settings import SettingsError
from parkway.actors.tools import waterfall
from parkway.actors.tools.report.builder import build_timeline
from parkway.actors.tools.report.figure import ReportError, draw, render_png
from parkway.actors.tools.report.model import CONTROLLER, Timeline
from parkway.actors.tools.report.page import render_html
from parkway.actors.tools.report.sources import read_broker, read_files
from parkway.brokers.urls import redact_url
from parkway.protocol.ids import validate_name


def write_report(
    timeline: Timeline, out: Path, *, max_rows: int = 150, lines: list[bytes] | None = None
) -> tuple[Path, Path]:
    """``out/RUN.png`` and ``out/RUN.html`` (with the longest snapshot's waterfall where ``lines`` hold
    its spans: docs/tracing.md)."""
    out.mkdir(parents=True, exist_ok=True)
    drawing = draw(timeline, max_rows=max_rows)
    png = render_png(drawing, out / f"{timeline.run}.png")
    slowest = waterfall.slowest(span_records(lines or []))
    trace = waterfall.render_html(slowest) if slowest is not None else ""
    page = render_html(timeline, drawing, out / f"{timeline.run}.html", trace=trace)
    return png, page


def span_records(lines: list[bytes]) -> list[dict[str, Any]]:
    """The span lines among a run's log lines, decoded (the others are left alone)."""
    decoder = msgspec.json.Decoder(dict[str, Any])
    records = []
    for line in lines:
        if b'"event":"span"' not in line:
            continue
        with contextlib.suppress(msgspec.DecodeError):
            records.append(decoder.decode(line))
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run's name")
    parser.add_argument(
        "--logs",
        nargs="+",
        action="extend",
        default=[],
        metavar="FILE",
        help="saved JSON log lines (parkway run --log-level info 2> FILE, each actor's stderr; - for stdin)",
    )
    parser.add_argument(
        "--broker",
        help="read the run's log stream on this broker (default: $PARKWAY_BROKER_URL without --logs)",
    )
    parser.add_argument("--out", default=".", help="directory for RUN.png and RUN.html (default: .)")
    parser.add_argument("--json", action="store_true", help="print a summary object instead of the paths")
    parser.add_argument("--max-rows", type=int, default=150, help="rollouts drawn at most (default 150)")
    parser.add_argument(
        "--idle",
        type=float,
        default=2.0,
        help="reading the broker: stop after this many seconds with no new line",
    )


def command(args: argparse.Namespace) -> int:
    try:
        validate_name(args.run, "run")
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    url = args.broker or (None if args.logs else os.environ.get("PARKWAY_BROKER_URL"))
    if not args.logs and not url:
        print(
            "parkway: report: give --logs FILE ... or --broker URL (or set PARKWAY_BROKER_URL)",
            file=sys.stderr,
        )
        return 2
    if url and url.startswith("memory://"):
        print(
            "parkway: report: a memory:// broker's log stream lives only in its own process", file=sys.stderr
        )
        return 2
    try:
        lines = read_files(args.logs)
    except OSError as exc:
        print(f"parkway: report: {exc}", file=sys.stderr)
        return 2
    if url:
        lines += asyncio.run(read_broker(url, args.run, idle=args.idle))
    timeline = build_timeline(lines, args.run)
    sources = ", ".join([*args.logs, *([redact_url(url)] if url else [])])
    if not timeline.lines.used:
        counts = timeline.lines
        print(
            f"parkway: report: no log line of run {args.run!r} in {sources} ({counts.read} read, "
            f"{counts.other_runs} of other runs, {counts.no_run} without a run, {counts.malformed} malformed)",
            file=sys.stderr,
        )
        return 1
    if not timeline.incarnations:
        print(
            f"parkway: report: no run_started line of {CONTROLLER}: dispatches, snapshot pauses and seals "
            "are missing (run the workload with parkway run --log-level info)",
            file=sys.stderr,
        )
    try:
        png, page = write_report(timeline, Path(args.out), max_rows=args.max_rows, lines=lines)
    except ReportError as exc:
        print(f"parkway: report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**timeline.summary(), "png": str(png), "html": str(page)}, sort_keys=True))
    else:
        print(png)
        print(page)
    return 0
