"""The policy's own records of a run's generations: one line per generation the engine finished, kept
in the policy's state directory across its processes, so the work of a timeline that died (a crash
after the last snapshot) is still counted when the run is restored and redoes it.

A line is ``<rollout id> <call index>``, the id percent-quoted (``urllib.parse.quote``): the ids parkway
makes are written as they are, and one from a foreign client (spaces, newlines, any character) cannot
break a line or the file's ASCII. Counts are of the newest session of the run (the session tag
of its group ids, ``ids.task_group_id``): a session started afresh starts counting from zero.

The file is append-only between compactions: once it holds many more lines than there are per-turn
counts still kept (``forget`` drops those of finished rollouts), it is rewritten as one totals line
(``#totals <session> <total> <repeated>``, the generations of rollouts no longer counted per turn) and
the lines of the turns still counted, atomically. So it is bounded by the rollouts in flight. A
``-<rollout id>`` line records a ``forget``, so a restarted policy does not count that rollout per turn
again.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import TextIO
from urllib.parse import quote, unquote

import structlog
from parkway.protocol.ids import parse_group_session, parse_rollout_id
from parkway.protocol.layout import POLICY_GENERATIONS_FILE as GENERATIONS_FILE

log = structlog.get_logger("parkway.policy")

__all__ = ["GENERATIONS_FILE", "GenerationRecords", "session_of"]

TOTALS = "#totals"
FORGOTTEN = "-"  # ``-<rollout id>``: its per-turn counts were dropped (``forget``)
COMPACT_MIN_LINES = 20_000  # below this many lines the file is never rewritten


def session_of(rollout_id: str) -> int:
    """The session tag of a rollout id; 0 for one no builder makes (a foreign client's)."""
    try:
        return parse_group_session(parse_rollout_id(rollout_id)[0])[1]
    except ValueError:
        return 0


class GenerationRecords:
    """How often each (rollout, turn) of the run's current session was generated, in any process."""

    def __init__(self, journal: Path | None = None) -> None:
        self.session = 0
        self.turns: collections.Counter[tuple[str, int]] = collections.Counter()
        self._turns_of: dict[str, set[int]] = {}  # rollout id -> its turns counted in ``turns``
        self.total = 0
        self.repeated = 0  # generations of a (rollout, turn) generated before
        self._file: TextIO | None = None
        self._journal = journal
        self._lines = 0  # lines in the file since it was last rewritten
        if journal is not None:
            self._load(journal)
            journal.parent.mkdir(parents=True, exist_ok=True)
            self._file = journal.open("a", encoding="ascii")

    def _load(self, journal: Path) -> None:
        if not journal.exists():
            return
        for number, line in enumerate(journal.read_text(encoding="ascii", errors="replace").splitlines()):
            self._lines += 1
            if line.startswith(TOTALS):
                self._load_totals(number, line)
                continue
            if line.startswith(FORGOTTEN):
                self._drop_turns(unquote(line[len(FORGOTTEN) :]))
                continue
            rollout, _, turn = line.partition(" ")
            if not turn.isdigit():  # a line cut short by a crash while it was written
                log.warning("generation_record_skipped", line=number + 1, text=line[:80])
                continue
            self._count(unquote(rollout), int(turn))

    def _load_totals(self, number: int, line: str) -> None:
        fields = line.split()[1:]
        if len(fields) != 3 or not all(f.isdigit() for f in fields):
            log.warning("generation_record_skipped", line=number + 1, text=line[:80])
            return
        session, total, repeated = (int(f) for f in fields)
        if session >= self.session:
            self.session, self.total, self.repeated = session, total, repeated
            self.turns.clear()
            self._turns_of.clear()

    def _count(self, rollout_id: str, turn: int) -> None:
        session = session_of(rollout_id)
        if session < self.session:  # an earlier session's call, still queued: not this session's work
            return
        if session > self.session:  # a new session of the run: its ids are new, so are its counts
            self.session = session
            self.turns.clear()
            self._turns_of.clear()
            self.total = self.repeated = 0
        self.turns[(rollout_id, turn)] += 1
        self._turns_of.setdefault(rollout_id, set()).add(turn)
        self.total += 1
        if self.turns[(rollout_id, turn)] > 1:
            self.repeated += 1

    def adopt(self, session: int, total: int, repeated: int) -> None:
        """A snapshot's totals, when these records know less (a policy without a state directory,
        restored in a new process): the generations up to the cut are counted, those of the timeline
        that died after it cannot be."""
        if session > self.session or (session == self.session and total > self.total):
            self.session, self.total, self.repeated = session, total, repeated
            self.turns.clear()
            self._turns_of.clear()

    def forget(self, rollout_ids: set[str]) -> None:
        """Drop the per-turn counts of finished rollouts: their generations stay in the totals, and a
        forgotten rollout is never generated again (the participant's fence refuses it)."""
        dropped = [rollout_id for rollout_id in sorted(rollout_ids) if self._drop_turns(rollout_id)]
        if self._file is not None and dropped:
            # Written too, so a restarted policy does not count them per turn again.
            self._file.write("".join(f"{FORGOTTEN}{quote(rollout_id)}\n" for rollout_id in dropped))
            self._file.flush()
            self._lines += len(dropped)

    def _drop_turns(self, rollout_id: str) -> bool:
        turns = self._turns_of.pop(rollout_id, None)
        for turn in turns or ():
            self.turns.pop((rollout_id, turn), None)
        return turns is not None

    def generated(self, rollout_id: str, turn: int) -> None:
        """The engine finished a generation of this rollout's turn: recorded before anything else."""
        self._count(rollout_id, turn)
        if self._file is not None:
            # Flushed, not fsynced: a killed process loses nothing the kernel has; a lost machine
            # loses the newest lines of a count that is a report, not state.
            self._file.write(f"{quote(rollout_id)} {turn}\n")
            self._file.flush()
            self._lines += 1
            if self._lines > max(COMPACT_MIN_LINES, 4 * len(self.turns)):
                self.compact()

    def compact(self) -> None:
        """Rewrite the file as the totals of what is no longer counted per turn, then each turn still
        counted (as often as it was generated); written aside, fsynced, then renamed over the old."""
        if self._journal is None or self._file is None:
            return
        kept = sum(self.turns.values())
        repeated_kept = sum(count - 1 for count in self.turns.values())
        lines = [f"{TOTALS} {self.session} {self.total - kept} {self.repeated - repeated_kept}\n"]
        for (rollout_id, turn), count in self.turns.items():
            lines.extend([f"{quote(rollout_id)} {turn}\n"] * count)
        tmp = self._journal.with_suffix(".tmp")
        with tmp.open("w", encoding="ascii") as handle:
            handle.writelines(lines)
            handle.flush()
            os.fsync(handle.fileno())
        self._file.close()
        os.replace(tmp, self._journal)
        self._file = self._journal.open("a", encoding="ascii")
        self._lines = len(lines)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
