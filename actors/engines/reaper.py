"""Engine processes that die with the process that started them, even when it is SIGKILLed.

vLLM runs its engine core in a child process (and its workers below that). The workers watch the
engine core, but nothing watches the process that started the engine: a policy process killed with
SIGKILL (a crash, the OOM killer, ``kill -9``) left ``VLLM::EngineCore`` and ``VLLM::Worker`` running,
orphans holding their memory (1.3 GB for the tiny CPU model; a GPU's memory on a GPU machine) until
someone noticed (seen in the prefix crash test).

``Reaper`` starts a small reaper process that holds the read end of a pipe whose write end only the
engine's process holds. When that process ends, however it ends, the pipe reads end of file, and the
reaper SIGKILLs the processes it was given that are still the same processes (pid and start time
match, so a reused pid is never hit). A graceful stop shuts the engine down first and then closes the
pipe: the reaper finds nothing left and exits.

Processes started while the engine starts up (before their pids can be known) are found by a mark:
``guard`` puts a random token in this process's environment (``PARKWAY_REAPER_TOKEN``) before the
engine starts, every process started from here on inherits it, and the reaper also kills every
process whose environment carries that token. A policy killed in the middle of vLLM's start-up leaves
nothing behind either.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

TOKEN_ENV = "PARKWAY_REAPER_TOKEN"


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from ``/proc`` (Linux; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


class Reaper:
    """A reaper process for ``pids``: they are SIGKILLed when this process ends, unless ``close``d."""

    def __init__(self, pids: list[int], *, token: str | None = None) -> None:
        marks = [f"{pid}:{start_time(pid)}" for pid in pids if start_time(pid) is not None]
        self.pids = [int(m.split(":")[0]) for m in marks]
        self.token = token
        self._process: subprocess.Popen[bytes] | None = None
        if marks or token:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "parkway.actors.engines.reaper",
                    *(["--token", token] if token else []),
                    *marks,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                # Not marked itself, and not in this process's group: a kill of the group spares it.
                env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},
                start_new_session=True,
            )

    def close(self) -> None:
        """The engine stopped on its own: the reaper kills what is left of it (nothing, normally)."""
        if self._process is not None and self._process.stdin is not None:
            self._process.stdin.close()
            self._process.wait(10)
            self._process = None


def guard() -> Reaper:
    """A reaper armed before an engine starts: every process started from this one after this call
    carries a token in its environment and is killed with what it was given when this process ends."""
    token = secrets.token_hex(12)
    os.environ[TOKEN_ENV] = token
    return Reaper([], token=token)


def marked(token: str) -> list[int]:
    """Every process whose environment carries ``token`` (``/proc/<pid>/environ``)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def watch_new_children(before: set[int]) -> Reaper:
    """A reaper for the processes below this one that were not there ``before`` (``descendants``
    taken just before the engine started)."""
    return Reaper([pid for pid in descendants(os.getpid()) if pid not in before])


def _reap(args: list[str]) -> int:
    """The reaper's own process: wait for end of file on stdin, then kill what is still the same, and
    every process marked with its token."""
    token = args[1] if args[:1] == ["--token"] else None
    marks = args[2:] if token else args
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    killed = 0
    for marked_pid in marked(token) if token else ():
        try:
            os.kill(marked_pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    for mark in marks:
        pid, _, started = mark.partition(":")
        if start_time(int(pid)) == int(started):  # the very process, not a reused pid
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


if __name__ == "__main__":
    _reap(sys.argv[1:])
