"""A workspace's digest computed by walking its directory, independently of the environment's records
(the format docs/workspace.md spells: ``kind mode size digest-or-target path`` lines, sorted by path),
and the process of a command running in one, seen through the executor's own handle."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from parkway.actors.builtin.workspace.environment import Workspace
from parkway.actors.builtin.workspace.executor import LocalExecutor

from tests.support.waiting import until


def walk_digest(root: Path) -> str:
    lines = []
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            rel = path.relative_to(root).as_posix()
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                lines.append((rel, f"link 0 0 {os.readlink(path)} {rel}\n"))
            elif stat.S_ISDIR(st.st_mode):
                lines.append((rel, f"dir {stat.S_IMODE(st.st_mode):o} 0  {rel}\n"))
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                lines.append((rel, f"file {stat.S_IMODE(st.st_mode):o} {st.st_size} {digest} {rel}\n"))
    hasher = hashlib.sha256()
    for _, line in sorted(lines):
        hasher.update(line.encode())
    return hasher.hexdigest()


def gone(pid: int) -> bool:
    """The process no longer exists (killed and reaped: a zombie still answers signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def command_started(env: Workspace) -> int:
    """The pid of the one command running in ``env`` (the leader of its group), once it exists."""
    executor = env.executor
    assert isinstance(executor, LocalExecutor)
    await until(lambda: len(env.commands) == 1 and executor.pid(next(iter(env.commands))) is not None)
    pid = executor.pid(next(iter(env.commands)))
    assert pid is not None
    return pid
