"""What restore tests read and watch: the rollouts a snapshot's agents saved, and which participants
a restore ended how (aborted or resumed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parkway.actors.runtime.packs import read_records
from parkway.actors.runtime.participant import Participant
from parkway.protocol.layout import AGENT_ROLLOUTS
from parkway.protocol.messages import Abort, Resume
from parkway.protocol.transcript import SavedRollout


def saved_by_agent(snapshot: Path) -> dict[int, list[str]]:
    """The rollout ids each saved agent's directory holds, by agent replica."""
    held = {}
    for path in sorted(snapshot.glob(f"participants/agent/*/{AGENT_ROLLOUTS}")):
        items = read_records(path, SavedRollout)
        held[int(path.parent.name)] = [i.run.rollout_id for i in items]
    return held


def watch_ends(monkeypatch: Any) -> list[tuple[str, str]]:
    """Every participant's ``Abort`` and ``Resume`` from now on, as (address, "abort" | "resume")."""
    seen: list[tuple[str, str]] = []
    on_abort, on_resume = Participant.on_abort, Participant.on_resume

    async def count_abort(self: Participant, command: Abort) -> Any:
        seen.append((self.address, "abort"))
        return await on_abort(self, command)

    async def count_resume(self: Participant, command: Resume) -> Any:
        seen.append((self.address, "resume"))
        return await on_resume(self, command)

    monkeypatch.setattr(Participant, "on_abort", count_abort)
    monkeypatch.setattr(Participant, "on_resume", count_resume)
    return seen
