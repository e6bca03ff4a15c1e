"""Running a command in a workspace: the executor interface, its limits, and the local executor.

The local executor runs ``/bin/sh -c <command>`` as a subprocess in its own session (process group) with
the workspace as its working directory and a small fixed environment, under resource limits set in the
child before it executes: address space (``RLIMIT_AS``), processes (``RLIMIT_NPROC``, which Linux does not
apply to root), file size (``RLIMIT_FSIZE``) and CPU time. A command past its time limit has its whole
process group killed; once it exits, whatever it left running in its group is killed too. Without
network: in a new network namespace (``unshare -n``, or ``unshare -rn`` where only user namespaces are
allowed) when the machine permits one; ``network_isolation()`` says which. A deployment that needs more
(file-system isolation, cgroups) plugs in its own ``Executor``, a container runtime for instance.
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
    it may use for its own files (captured output)."""

    async def run(self, command: str, cwd: Path, limits: Limits, scratch: Path) -> CommandResult: ...


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


class LocalExecutor:
    """A subprocess on this machine, under the limits above."""

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
        out, err = scratch / "stdout", scratch / "stderr"
        prefix = () if limits.network else network_isolation()
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
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
            killed = None
            try:
                await asyncio.wait_for(process.wait(), timeout=limits.time_s)
            except TimeoutError:
                killed = "timeout"
            except asyncio.CancelledError:
                _kill_group(process.pid)
                raise
            _kill_group(process.pid)  # the command, or what it left behind in its group
            code = await process.wait()
        if killed is None and code < 0:
            killed = signal.Signals(-code).name
        return CommandResult(
            exit_code=None if killed else code,
            stdout=_read(out, limits.output_bytes),
            stderr=_read(err, limits.output_bytes),
            killed=killed,
        )


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
