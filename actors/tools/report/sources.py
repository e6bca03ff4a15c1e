"""Where a report's log lines come from: saved files (or stdin) and the run's log stream on the broker.

Both return raw lines, unparsed: ``records.parse_lines`` decides what each one is worth.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path


def read_files(paths: Sequence[str]) -> list[bytes]:
    """Every line of each file in turn (``-`` is stdin)."""
    lines: list[bytes] = []
    for path in paths:
        if path == "-":
            lines += sys.stdin.buffer.read().splitlines()
        else:
            lines += Path(path).read_bytes().splitlines()
    return lines


async def read_broker(url: str, run: str, *, idle: float) -> list[bytes]:
    """Every line of the run's log stream, from the start, until ``idle`` seconds pass without one."""
    from parkway.brokers import connect

    lines: list[bytes] = []
    async with connect(url, run) as broker:
        stream = broker.follow_logs(from_start=True)
        try:
            while True:
                try:
                    lines.append(await asyncio.wait_for(anext(stream), idle))
                except TimeoutError:
                    break
        finally:
            await stream.aclose()
    return lines
