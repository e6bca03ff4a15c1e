"""Waiting for a condition that another task or process brings about, with a bound, never a guess."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], bool], *, timeout: float = 10.0, poll: float = 0.005) -> None:
    """Return as soon as ``predicate()`` holds; raise TimeoutError after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - a plain attribute that another task changes
            await asyncio.sleep(poll)
