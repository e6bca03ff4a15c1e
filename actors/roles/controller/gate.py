"""The admission gate in front of dispatch, and its clock.

Closed while a snapshot is cut: no Run goes out, and reserved attempts waiting behind it are not
running. The time it stays closed is the pause a snapshot costs, and the stall watchdog leaves it out
(parked rollouts are not stalled).
"""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger("parkway.controller")


class AdmissionGate:
    def __init__(self) -> None:
        self._open = True
        self._closed_at: float | None = None
        self._paused_total = 0.0  # seconds the gate was closed, closures that ended

    @property
    def is_open(self) -> bool:
        return self._open

    def close(self) -> None:
        if self._open:
            self._closed_at = time.monotonic()
            log.info("gate_closed")
        self._open = False

    def open(self) -> None:
        if not self._open and self._closed_at is not None:
            now = time.monotonic()
            self._paused_total += now - self._closed_at
            log.info("gate_opened", paused_ms=round((now - self._closed_at) * 1000, 3))
            self._closed_at = None
        self._open = True

    def paused_s(self) -> float:
        """Seconds spent with the gate closed (rollouts parked), including a closure in progress."""
        current = time.monotonic() - self._closed_at if self._closed_at is not None else 0.0
        return self._paused_total + current
