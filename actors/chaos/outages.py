"""Outages at an exact step: the broker down, or the state directory unwritable, for a while.

The controller stops itself at an armed ``=STOP`` fault point (``faults.py``) after writing which
point it is on stderr. The harness sees it stopped (``stopped_at``), breaks the broker or the run's
snapshot directory, continues the controller so that the step goes on under the outage, and repairs
everything ``down_s`` later (``outage``).

Tests run as root, so ``chmod`` does not stop a write: an unwritable snapshot directory is the
directory renamed aside and a plain file in its place (every write under it fails with ``ENOTDIR``),
and repaired by putting the directory back.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

from parkway.actors.chaos.schedule import FaultKind
from parkway.actors.launch.rabbit_cluster import RabbitCluster
from parkway.actors.launch.rabbit_node import RabbitNode
from parkway.actors.runtime.faults import STOPPED_LINE

_STOPPED = re.compile(re.escape(STOPPED_LINE).replace(re.escape("{point}"), r"(\S+)"))
ASIDE_SUFFIX = ".unwritable"  # where the snapshot directory waits out an outage


class OutageError(Exception):
    """An outage could not be started or repaired; the message says what."""


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP), from its state in ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(") ", 1)[1][:1] in ("T", "t")
    except (OSError, IndexError):
        return False


def stopped_at(log_text: str) -> str | None:
    """The fault point a process last stopped itself at, from its stderr."""
    found = _STOPPED.findall(log_text)
    return found[-1] if found else None


def make_unwritable(directory: Path) -> None:
    aside = directory.with_name(directory.name + ASIDE_SUFFIX)
    if aside.exists():
        raise OutageError(f"{aside} exists already: an earlier outage was never repaired")
    if directory.exists():
        directory.rename(aside)
    directory.write_bytes(b"")  # a file where the directory was: nothing can be created under it


def make_writable(directory: Path) -> None:
    aside = directory.with_name(directory.name + ASIDE_SUFFIX)
    if not directory.is_file() or directory.is_symlink():
        raise OutageError(f"{directory} is no longer the file the outage put there")
    directory.unlink()
    if aside.exists():
        aside.rename(directory)


async def outage(
    kind: FaultKind,
    down_s: float,
    *,
    node: RabbitNode | None,
    snapshots: Path,
    resume: Callable[[], None],
    cluster: RabbitCluster | None = None,
) -> None:
    """Break what ``kind`` names, ``resume`` the stopped controller, wait ``down_s``, repair."""
    breaks: Callable[[], object]
    repairs: Callable[[], object]
    if kind is FaultKind.STATE_UNWRITABLE:
        breaks, repairs = (lambda: make_unwritable(snapshots)), (lambda: make_writable(snapshots))
    elif kind in (FaultKind.NODE_STOP, FaultKind.NODE_STOP_CONTROLLERS):
        if cluster is None or len(cluster.nodes) < 2:
            raise OutageError(f"{kind}: the broker is not a cluster of this run's own")
        index = 0 if kind is FaultKind.NODE_STOP_CONTROLLERS else len(cluster.nodes) - 1
        breaks, repairs = (lambda: cluster.stop_node(index)), (lambda: cluster.start_node(index))
    elif node is None:
        raise OutageError(f"{kind}: the broker is not this run's own node")
    elif kind is FaultKind.BROKER_RESTART:
        breaks, repairs = node.stop_app, node.start_app
    elif kind is FaultKind.BROKER_KILL:
        breaks, repairs = node.kill, node.start
    else:
        raise OutageError(f"{kind} is not an outage")
    await asyncio.to_thread(breaks)
    try:
        resume()
        await asyncio.sleep(down_s)
    finally:
        await asyncio.to_thread(repairs)
