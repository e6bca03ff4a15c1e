"""Where a participant reads and writes inside a snapshot, checked: nothing a message names leads
outside the run's snapshot directory, and a restore reads another replica's records only where its
role can take them over (docs/recovery.md#another-topology)."""

from __future__ import annotations

import os
from pathlib import Path

from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import Restore


def inside(snapshot_root: Path | None, run: str, location: str, parts: tuple[str, ...], address: str) -> Path:
    """``<root>/<run>/<location>/<parts>``; refused (``invalid_message``) when a symlink planted
    anywhere on the way would lead it outside the run's snapshot directory. (``location`` itself is
    one checked path component: see ``layout.LOCATION_PATTERN``.)"""
    if snapshot_root is None:
        raise ProtocolError(ErrorCode.UNAVAILABLE, f"{address} has no snapshot root configured")
    run_dir = snapshot_root / run
    directory = run_dir.joinpath(location, *parts)
    base, target = os.path.realpath(run_dir), os.path.realpath(directory)
    if os.path.commonpath([base, target]) != base or target == base:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"{directory} leads to {target}, outside the snapshot directory {base}: refused",
        )
    return directory


def check_sources(command: Restore, *, role: str, replica: int, takes_over: bool, run_dir: Path) -> None:
    """A role whose records are not per rollout (TQ, the policy) restores only its own; a restore that
    reads no replica's records (an agent with nothing to take over) still names a snapshot that is
    there, so a stray Restore cannot empty a participant."""
    if not takes_over and command.sources is not None and set(command.sources) != {replica}:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"a {role} restores only its own records, not replicas {list(command.sources)}",
        )
    if command.sources == () and not (run_dir / command.location).is_dir():
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"{command.location} cannot be restored: no such snapshot in {run_dir}"
        )
