"""Named fault points: a test or the chaos harness asks a process to kill itself at an exact step.

``PARKWAY_FAULTS="after_reply_journaled:Probe,after_publish@2"`` makes the process SIGKILL itself when it
reaches one of those points: the first time, or (``@N``) the N-th time; ``:QUALIFIER`` narrows a point
to one message type. A real signal, so what survives is what a real crash leaves behind.
"""

from __future__ import annotations

import os
import signal

FAULTS_ENV = "PARKWAY_FAULTS"


class FaultPoints:
    def __init__(self, spec: str | None = None) -> None:
        self._armed: dict[tuple[str, str | None], int] = {}  # point -> the hit that kills
        self._hits: dict[tuple[str, str | None], int] = {}
        for item in (spec if spec is not None else os.environ.get(FAULTS_ENV, "")).split(","):
            item, _, nth = item.strip().partition("@")
            name, _, qualifier = item.partition(":")
            if name:
                self._armed[(name, qualifier or None)] = int(nth) if nth.isdigit() else 1

    def reach(self, point: str, qualifier: str | None = None) -> None:
        for key in {(point, None), (point, qualifier)}:
            if key in self._armed:
                self._hits[key] = self._hits.get(key, 0) + 1
                if self._hits[key] == self._armed[key]:
                    os.kill(os.getpid(), signal.SIGKILL)
