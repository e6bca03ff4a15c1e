"""The moment a snapshot closes admission: after a progress check that came back fast.

The check before the gate closes is a ``Status`` round trip to each agent, answered on its control
lane behind whatever data work its event loop already holds. A slow answer says the agents' loops are
backlogged (a burst of model and tool replies, each waking its rollout to build and sign its next
call), and a window opened then waits behind the same backlog: over the benchmark's records at 1024
rollouts in flight, half the windows after a check in the slowest tenth were in the slowest tenth
themselves, against 6% after the others (docs/snapshots.md#the-moment-the-gate-closes). So the controller
checks again until one check comes back within ``FACTOR`` times the median of the recent ones, up to
``snapshots.quiet_checks`` checks and ``snapshots.quiet_max_wait_s`` in all, then closes the gate
whatever the last one said. The rollouts run on meanwhile: the wait is outside the window.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

FACTOR = 2.0  # a check within this many times the recent median is quiet
FLOOR_S = 0.005  # a check this fast is quiet whatever the median (a quiet run's checks vary by ms)
RECENT = 32  # checks the median is taken over


class QuietMoment:
    """Which progress check the gate closes after. ``quiet`` is the rule, on plain numbers."""

    def __init__(self, checks: int, max_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if checks < 1 or max_wait_s < 0:
            raise ValueError(f"quiet checks {checks} (>= 1), max wait {max_wait_s} s (>= 0)")
        self.checks, self.max_wait_s, self.clock = checks, max_wait_s, clock
        self.recent: deque[float] = deque(maxlen=RECENT)

    def quiet(self, round_trip_s: float) -> bool:
        """Record one check's round trip; whether it was fast enough to close the gate after it (the
        first one, with nothing to compare it with, is)."""
        limit = max(FLOOR_S, FACTOR * statistics.median(self.recent)) if self.recent else float("inf")
        self.recent.append(round_trip_s)
        return round_trip_s <= limit

    async def settle(self, check: Callable[[], Awaitable[T]]) -> tuple[T, int]:
        """Run ``check`` until one is quiet or the bounds are reached: its last result and how many ran."""
        started = self.clock()
        made = 0
        while True:
            sent = self.clock()
            result = await check()
            made += 1
            done = self.clock()
            if self.quiet(done - sent) or made >= self.checks or done - started >= self.max_wait_s:
                return result, made
