"""A live progress line for long commands (``parkway run``, ``parkway demo``), on a terminal only.

The line is redrawn in place on stderr a few times a second and erased at the end, so what a command
prints to stdout (its table or its JSON) stays clean. Off when stderr is not a terminal or in ``--json``
mode, unless asked for with ``--progress always`` (then each update is a plain line: for logs and tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from typing import IO, Any, Literal

Mode = Literal["auto", "always", "never"]
EVERY_S = 0.25


def enabled(mode: Mode, *, json_output: bool, stream: IO[str]) -> bool:
    if mode == "never":
        return False
    if mode == "always":
        return True
    return not json_output and stream.isatty() and os.environ.get("TERM") != "dumb"


def describe(label: str, p: dict[str, Any]) -> str:
    """One line: ``run quickstart  running  24/36 sealed  0 failed  8 running  3 snapshots (14 ms)  12.3 s``."""
    parts = [label, p["stage"]]
    if p["expected"]:
        done = p["sealed"] + p["failed"]
        width = 20
        filled = width * done // p["expected"]
        parts.append(f"[{'#' * filled}{'.' * (width - filled)}] {p['sealed']}/{p['expected']} sealed")
    if p["failed"]:
        parts.append(f"{p['failed']} failed")
    parts.append(f"{p['running']} running")
    if p["restored"]:
        parts.append(f"{p['restored']} restored")
    if p["snapshots"]:
        pause = f" (last pause {p['last_pause_ms']:.0f} ms)" if p["last_pause_ms"] is not None else ""
        parts.append(f"{p['snapshots']} snapshot{'s' if p['snapshots'] != 1 else ''}{pause}")
    if p["train_steps"]:
        parts.append(f"{p['train_steps']} train steps")
    parts.append(f"{p['elapsed_s']:.1f} s")
    return "  ".join(parts)


class ProgressLine:
    def __init__(self, stream: IO[str] | None = None, *, in_place: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.in_place = self.stream.isatty() if in_place is None else in_place
        self._last = ""

    def show(self, text: str) -> None:
        if text == self._last:
            return
        self._last = text
        if self.in_place:
            columns = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r\x1b[2K" + text[: columns - 1])
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.in_place and self._last:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
        self._last = ""


@contextlib.asynccontextmanager
async def watching(
    render: Callable[[], str | None], line: ProgressLine | None, every_s: float = EVERY_S
) -> AsyncIterator[None]:
    """Redraw ``render()`` every ``every_s`` while the body runs (nothing at all without a line)."""
    if line is None:
        yield
        return

    async def tick() -> None:
        while True:
            text = render()
            if text:
                line.show(text)
            await asyncio.sleep(every_s)

    task = asyncio.get_running_loop().create_task(tick())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        text = render()  # the final state, then the line goes away (in place) or stays (plain)
        if text and not line.in_place:
            line.show(text)
        line.clear()
