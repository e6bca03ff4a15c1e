"""Running a command in a workspace: the executor interface, its limits, and the local executor.

The local executor runs ``/bin/sh -c <command>`` as a subprocess in its own session (process group) with
the workspace as its working directory and a small fixed environment, under resource limits set in the
child before it executes: address space (``RLIMIT_AS``), processes (``RLIMIT_NPROC``, which Linux does not
apply to root), file size (``RLIMIT_FSIZE``) and CPU time. A command past its time limit has its whole
process group killed; once it exits, whatever it left running in its group is killed too; ``kill``
ends one at once the same way (its session ended, its server stops). Without network: in a new
network namespace (``unshare -n``, or ``unshare -rn`` where only user namespaces are allowed) when the
machine permits one; ``network_isolation()`` says which. A deployment that needs more (file-system
isolation, cgroups) plugs in its own ``Executor``, a container runtime for instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    """What one workspace and its commands may use."""

    time_s: float = 120.0  # wall clock per command
    memory_bytes: int = 2 << 30  # address space per process
    processes: int = 256  # processes of the command's user (not applied to root)
    output_bytes: int = 64 << 10  # of stdout and of stderr kept, each
    quota_bytes: int = 512 << 20  # the workspace's files, in all
    max_files: int = 20_000
    network: bool = False


@dataclass(frozen=True)
class CommandResult:
    exit_code: int | None  # None: killed
    stdout: str
    stderr: str
    killed: str | None = None  # "timeout", or the signal that ended it ("SIGKILL", ...)


class Executor(Protocol):
    """Runs one command in ``cwd`` under ``limits``; ``scratch`` is a directory outside the workspace
    it may use for its own files (captured output), one per run: it also names the run for ``kill``."""

    async def run(self, command: str, cwd: Path, limits: Limits, scratch: Path) -> CommandResult: ...

    def kill(self, scratch: Path) -> None:
        """Kill the command of the run given ``scratch`` now, with whatever it started (one still
        starting too); that run then returns it as killed. Nothing when no such run is going on."""
        ...


@functools.cache
def network_isolation() -> tuple[str, ...]:
    """The prefix that runs a command without network here: ``unshare -n``, ``unshare -rn``, or ()."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for flags in ("-n", "-rn"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            probe = subprocess.run([unshare, flags, "true"], capture_output=True, timeout=10, check=False)
            if probe.returncode == 0:
                return (unshare, flags, "--")
    return ()


def _limit_child(limits: Limits) -> None:
    """Runs in the child before exec: its limits (soft and hard, so it cannot raise them)."""
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.quota_bytes, limits.quota_bytes))
    cpu = int(limits.time_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as reader:
        data = reader.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + "\n[output truncated]" if len(data) > limit else text


@dataclass
class _Running:
    pid: int | None = None  # None while the process is being started
    killed: bool = False


class LocalExecutor:
    """A subprocess on this machine, under the limits above."""

    def __init__(self) -> None:
        self._running: dict[Path, _Running] = {}  # the runs going on, by their scratch directory

    def pid(self, scratch: Path) -> int | None:
        """The process of the run given ``scratch`` (its group's leader), once it has started."""
        running = self._running.get(scratch)
        return running.pid if running is not None else None

    def kill(self, scratch: Path) -> None:
        running = self._running.get(scratch)
        if running is None:
            return
        running.killed = True  # a run still starting kills its process as soon as it has one
        if running.pid is not None:
            _kill_group(running.pid)

    def environment(self, cwd: Path) -> dict[str, str]:
        # Fixed, so outputs do not depend on the server's own environment; no bytecode files, which
        # would put compile times into the workspace.
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(cwd),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "PYTHON": sys.executable,
        }

    async def run(self, command: str, cwd: Path, limits: Limits, scratch: Path) -> CommandResult:
        os.makedirs(scratch, exist_ok=True)
        # Registered before the first await: a kill that comes while the process starts is not lost.
        running = self._running[scratch] = _Running()
        try:
            killed, code = await self._wait(command, cwd, limits, scratch, running)
        finally:
            if self._running.get(scratch) is running:
                del self._running[scratch]
        if killed is None and code < 0:
            killed = signal.Signals(-code).name
        return CommandResult(
            exit_code=None if killed else code,
            stdout=_read(scratch / "stdout", limits.output_bytes),
            stderr=_read(scratch / "stderr", limits.output_bytes),
            killed=killed,
        )

    async def _wait(
        self, command: str, cwd: Path, limits: Limits, scratch: Path, running: _Running
    ) -> tuple[str | None, int]:
        """Start the command and wait for it: (``"timeout"`` or None, its exit status)."""
        prefix = () if limits.network else network_isolation()
        with open(scratch / "stdout", "wb") as stdout, open(scratch / "stderr", "wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *prefix,
                "/bin/sh",
                "-c",
                command,
                cwd=cwd,
                env=self.environment(cwd),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                preexec_fn=functools.partial(_limit_child, limits),
            )
            running.pid = process.pid
            if running.killed:
                _kill_group(process.pid)
            killed = None
            try:
                await asyncio.wait_for(process.wait(), timeout=limits.time_s)
            except TimeoutError:
                killed = "timeout"
            except asyncio.CancelledError:
                _kill_group(process.pid)
                raise
            _kill_group(process.pid)  # the command, or what it left behind in its group
            return killed, await process.wait()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
