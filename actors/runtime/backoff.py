"""Trying an operation again after a failure that a later try may not meet (a broker restarting, a
state directory unwritable for a while): the pause doubles from ``first_s`` up to ``max_s``, and the
failure is raised once the next pause would end more than ``for_s`` after the first try began."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    *,
    retry_on: type[E],
    for_s: float,
    first_s: float,
    max_s: float,
    on_retry: Callable[[E, float], None],
    final: Callable[[E], bool] = lambda _: False,
) -> T:
    """``attempt()``'s result; a ``retry_on`` failure is tried again (``on_retry(failure, pause)``
    first) unless ``final(failure)`` says no later try can help, or the time is up."""
    give_up_at = time.monotonic() + for_s
    pause = first_s
    while True:
        try:
            return await attempt()
        except retry_on as failure:
            if final(failure) or time.monotonic() + pause > give_up_at:
                raise
            on_retry(failure, pause)
            await anyio.sleep(pause)
            pause = min(pause * 2, max_s)
