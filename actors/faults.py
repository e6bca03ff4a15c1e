"""Named fault points: a test or the chaos harness asks a process to kill itself at an exact step.

``PARKWAY_FAULTS="after_reply_journaled:Probe,before_reply"`` makes the process SIGKILL itself the first
time it reaches one of those points (optionally only for that message type). A real signal, so what
survives is what a real crash leaves behind.
"""

from __future__ import annotations

import os
import signal

FAULTS_ENV = "PARKWAY_FAULTS"


class FaultPoints:
    def __init__(self, spec: str | None = None) -> None:
        self._armed: set[tuple[str, str | None]] = set()
        for item in (spec if spec is not None else os.environ.get(FAULTS_ENV, "")).split(","):
            name, _, qualifier = item.strip().partition(":")
            if name:
                self._armed.add((name, qualifier or None))

    def reach(self, point: str, qualifier: str | None = None) -> None:
        if (point, None) in self._armed or (point, qualifier) in self._armed:
            os.kill(os.getpid(), signal.SIGKILL)
