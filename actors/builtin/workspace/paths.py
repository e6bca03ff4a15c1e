"""Paths a tool names, resolved inside the workspace or refused with a typed tool error.

A path is relative, never names ``..``, and resolves (symlinks followed) inside the workspace; what it
names must be a regular file or a directory, never a device, a FIFO or a socket. Nothing outside the
workspace is read or written: the checks run on the resolved path, and tools and commands of one session
never run at once, so no link changes between the check and the use.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from parkway.actors.sdk.environments import ToolError

ESCAPES = "path_escapes"  # names .., or a symlink leads outside the workspace
ABSOLUTE = "path_absolute"
INVALID = "path_invalid"  # empty, a NUL byte, or the workspace itself where a file is needed
SPECIAL = "special_file"  # a device, FIFO or socket
NOT_FOUND = "not_found"
NOT_A_FILE = "not_a_file"
QUOTA = "quota_exceeded"


def refuse(code: str, message: str) -> ToolError:
    return ToolError(f"{code}: {message}", code=code)


def inside(root: Path, real: str) -> bool:
    base = os.path.realpath(root)
    return real == base or real.startswith(base + os.sep)


def resolve(root: Path, path: str, *, allow_root: bool = False) -> Path:
    """The real path ``path`` names inside ``root``; ``ToolError`` (a code above) when it may not."""
    if "\x00" in path or not path.strip():
        raise refuse(INVALID, f"{path!r:.200} is not a path")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise refuse(ABSOLUTE, f"{path!r:.200} is absolute; paths are relative to the workspace")
    if ".." in pure.parts:
        raise refuse(ESCAPES, f"{path!r:.200} names '..'; paths stay inside the workspace")
    real = os.path.realpath(root.joinpath(*pure.parts))
    if not inside(root, real):
        raise refuse(ESCAPES, f"{path!r:.200} leads outside the workspace (through a symlink)")
    if not allow_root and real == os.path.realpath(root):
        raise refuse(INVALID, f"{path!r:.200} is the workspace itself")
    try:
        mode = os.lstat(real).st_mode
    except FileNotFoundError:
        return Path(real)
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise refuse(SPECIAL, f"{path!r:.200} is a device, FIFO or socket")
    return Path(real)
