"""Named fault points: a test or the chaos harness asks a process to fail at an exact step.

``PARKWAY_FAULTS="after_reply_journaled:Probe,after_publish@2"`` makes the process SIGKILL itself when it
reaches one of those points: the first time, or (``@N``) the N-th time; ``:QUALIFIER`` narrows a point
to one message type (or, for the write points, one role). A real signal, so what survives is what a
real crash leaves behind.

``=ERRNO`` makes the point fail like the storage under it instead: ``commit_write:resources=ENOSPC@2``
raises ``OSError(ENOSPC)`` at the second commit write of a resources actor, half-way through the file
(a disk that fills up), and lets every other hit through (the fault clears); ``@2+`` fails the second
and every later one (a disk that stays full). Write points:

- ``commit_write:<role>``: a participant writing its cut at Persist (``packs.RecordWriter``);
- ``capture_write``: the controller writing its copy of the ledger taken at the cut;
- ``publish_write``: the controller writing the manifest;
- ``publish_fsync:files`` and ``publish_fsync:parent``: fsyncing the snapshot's directories before the
  rename, and the run directory after it;
- ``publish_rename``: renaming ``tmp_<id>`` to ``snapshot_<seq>``;
- ``trainer_checkpoint_write``: the controller writing a trainer checkpoint's files (before the write).

``=STOP`` makes the process SIGSTOP itself at the point instead, after one line on stderr naming it
(``parkway: fault point <point>: stopped``): whoever watches it (the chaos harness) breaks something
around it at that exact step, a broker outage or an unwritable state directory, and SIGCONTs it.

``=HOLD`` makes an awaited point (``hold``; only those in ``HOLD_POINTS``) wait for good: that one
message's handler never answers, while the rest of the process goes on. ``tq_seal=HOLD@1+``: TQ
holds every seal it is asked for, as a TQ whose answers are all still on their way when the cluster
dies (``tests/integration/test_sealing_crash.py``).

Kill points of the snapshot sequence: ``save_<step>`` and ``after_<step>`` (``protocol/snapshot.py``),
``after_abort`` (an aborted snapshot, cleaned up), ``participant_prepare:<role>``; of the restore
sequence: ``restore_<step>`` (at the start of each step) and ``after_restore_<stage>``; of the
data plane: ``tq_seal`` (TQ, as a seal arrives).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal

FAULTS_ENV = "PARKWAY_FAULTS"
KILL = "kill"
STOP = "STOP"
HOLD = "HOLD"
HOLD_POINTS = frozenset({"tq_seal"})  # the points reached by awaiting (``hold``)
STOPPED_LINE = "parkway: fault point {point}: stopped"  # what a STOP writes before it stops


class FaultSpecError(ValueError):
    """A ``PARKWAY_FAULTS`` item that cannot be read; the message names it."""


class FaultPoints:
    def __init__(self, spec: str | None = None) -> None:
        # point -> (the hit that fails, whether every later hit fails too, the action)
        self._armed: dict[tuple[str, str | None], tuple[int, bool, str]] = {}
        self._hits: dict[tuple[str, str | None], int] = {}
        for raw in (spec if spec is not None else os.environ.get(FAULTS_ENV, "")).split(","):
            item, _, nth = raw.strip().partition("@")
            item, _, action = item.partition("=")
            name, _, qualifier = item.partition(":")
            if not name:
                continue
            action = action or KILL
            if action == HOLD and name not in HOLD_POINTS:
                raise FaultSpecError(
                    f"{FAULTS_ENV} item {raw.strip()!r}: HOLD is for an awaited point ({', '.join(sorted(HOLD_POINTS))})"
                )
            if action not in (KILL, STOP, HOLD) and not isinstance(getattr(errno, action, None), int):
                raise FaultSpecError(f"{FAULTS_ENV} item {raw.strip()!r}: {action!r} is not an errno name")
            onwards = nth.endswith("+")
            nth = nth.removesuffix("+")
            if nth and not nth.isdigit():
                raise FaultSpecError(f"{FAULTS_ENV} item {raw.strip()!r}: want @N or @N+ with N a number")
            self._armed[(name, qualifier or None)] = (int(nth) if nth else 1, onwards, action)

    def reach(self, point: str, qualifier: str | None = None, *, path: object = None) -> None:
        """SIGKILL this process, or raise the armed ``OSError`` (naming ``path``), when this is the hit."""
        self._act(self._fires(point, qualifier), point, path)

    async def hold(self, point: str, qualifier: str | None = None) -> None:
        """An awaited point: as ``reach``, and armed ``=HOLD``, this task waits until the process ends."""
        action = self._fires(point, qualifier)
        if action == HOLD:
            await asyncio.Event().wait()  # (never set)
        self._act(action, point, None)

    def _fires(self, point: str, qualifier: str | None) -> str | None:
        """The action armed at this point when this hit is the one it fires at, else None."""
        fired = None
        for key in {(point, None), (point, qualifier)}:
            if key in self._armed:
                self._hits[key] = self._hits.get(key, 0) + 1
                nth, onwards, action = self._armed[key]
                if self._hits[key] == nth or (onwards and self._hits[key] > nth):
                    fired = action
        return fired

    @staticmethod
    def _act(action: str | None, point: str, path: object) -> None:
        if action is None or action == HOLD:
            return
        if action == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if action == STOP:
            # One write(2), before the stop: the watcher reads which point this is.
            os.write(2, (STOPPED_LINE.format(point=point) + "\n").encode())
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # continued (SIGCONT): the step goes on
        code = getattr(errno, action)
        raise OSError(code, f"{os.strerror(code)} (fault point {point})", *([str(path)] if path else []))
