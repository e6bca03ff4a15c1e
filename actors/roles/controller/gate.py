"""The admission gate in front of dispatch, and its clocks.

Closed for a snapshot's instant: no Run goes out, and reserved attempts waiting behind it are not
running. The time it stays closed is the pause a snapshot costs (``paused_s``); nothing is logged
while it is closed (``gate_closed`` and ``gate_opened`` are both written as it opens). The agents
hold their rollouts at their boundaries from the snapshot's Prepare until their Resume at the
latest, with the gate open again for all of it: the stall watchdog leaves out that time and the
gate's (``parked_s``): parked rollouts are not stalled.
"""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger("parkway.controller")


class Stopwatch:
    """Seconds spent stopped, a stop in progress included."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._total = 0.0

    @property
    def running(self) -> bool:
        return self._since is not None

    def start(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def stop(self) -> float:
        """Ends the current stretch; its seconds (0 when none was running)."""
        if self._since is None:
            return 0.0
        took, self._since = time.monotonic() - self._since, None
        self._total += took
        return took

    def total_s(self) -> float:
        return self._total + (time.monotonic() - self._since if self._since is not None else 0.0)


class AdmissionGate:
    def __init__(self) -> None:
        self._closed = Stopwatch()  # the gate closed: the window
        self._parked = Stopwatch()  # the gate closed, or a snapshot's agents holding their rollouts
        self._holding = False

    @property
    def is_open(self) -> bool:
        return not self._closed.running

    def close(self) -> None:
        self._closed.start()
        self._parked.start()

    def open(self) -> None:
        if not self.is_open:
            paused_ms = round(self._closed.stop() * 1000, 3)
            log.info("gate_closed")
            log.info("gate_opened", paused_ms=paused_ms)
        if not self._holding:
            self._parked.stop()

    def hold(self) -> None:
        """A snapshot's agents hold their rollouts (from its Prepare on), the gate open or not."""
        self._holding = True
        self._parked.start()

    def release(self) -> None:
        """They let them go (resumed, or the snapshot ended)."""
        self._holding = False
        if self.is_open:
            self._parked.stop()

    def paused_s(self) -> float:
        """Seconds spent with the gate closed, including a closure in progress."""
        return self._closed.total_s()

    def parked_s(self) -> float:
        """Seconds the running rollouts did not count as running: the gate closed, or held."""
        return self._parked.total_s()
