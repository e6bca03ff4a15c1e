"""A child process's JSON log lines as they come: read by a thread, waited for by a test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any


class LogLines:
    """Every line ``stream`` writes (kept), and the JSON objects among them (``events``)."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self.lines.append(line)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            lines = list(self.lines)
        found = []
        for line in lines:
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    found.append(json.loads(line))
        return found

    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)

    def finish(self) -> None:
        """After the process ended: every line it wrote has been read."""
        self._reader.join(timeout=30)

    async def wait_for(
        self,
        condition: Callable[[list[dict[str, Any]]], bool],
        process: subprocess.Popen[str],
        *,
        bound_s: float = 180.0,
    ) -> bool:
        """Until ``condition`` holds over the events so far (True) or the process ended (False). The
        bound only stops a test that would hang; nothing is asserted about how long it took."""
        give_up = time.monotonic() + bound_s
        while time.monotonic() < give_up:
            if condition(self.events()):
                return True
            if process.poll() is not None:
                self.finish()
                return condition(self.events())
            await asyncio.sleep(0.05)
        raise TimeoutError(f"gave up waiting; last lines: {self.text()[-3000:]}")
