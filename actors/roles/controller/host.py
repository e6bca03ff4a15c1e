"""The few things a save or a restore may do to the controller, and nothing else.

The save and restore sequences (``save.py``, ``restore.py``) reach the controller only through this
interface: the gate, the ACK outbox, retiring what was given up on, noticing a restarted agent, and
handing the ledger and anchor over (out at the cut, in at a restore).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

from parkway.actors.roles.controller.adopt import Continuation, SavedWork
from parkway.actors.roles.controller.gate import AdmissionGate
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.faults import FaultPoints
from parkway.actors.runtime.history import History
from parkway.actors.runtime.metrics import ActorMetrics
from parkway.protocol.anchor import ControllerAnchor, LedgerFile
from parkway.protocol.ledger import Ledger
from parkway.protocol.messages import Completed, StatusReport


class SnapshotHost(Protocol):
    @property
    def run(self) -> str: ...

    @property
    def client(self) -> Client: ...

    @property
    def faults(self) -> FaultPoints: ...

    @property
    def history(self) -> History: ...

    @property
    def counts(self) -> Counter[str]: ...

    @property
    def gate(self) -> AdmissionGate:
        """Its clocks: a snapshot's agents hold their rollouts from its Prepare to its Resume (``hold``,
        ``release``), which the stall watchdog does not count."""
        ...

    @property
    def metrics(self) -> ActorMetrics: ...

    @property
    def ledger(self) -> Ledger:
        """Read only: what is dispatched, for a save's scope and its checks."""
        ...

    @property
    def seals(self) -> int:
        """Seals this incarnation made (the history marks how many a capture holds)."""
        ...

    @property
    def gate_open(self) -> bool: ...

    def close_gate(self) -> None: ...

    def open_gate(self) -> None:
        """Open the admission gate and wake the dispatch loop."""
        ...

    def paused_s(self) -> float:
        """Seconds the gate was closed so far, a closure in progress included."""
        ...

    async def flush_acks(self) -> None: ...

    async def retire_pending(self) -> None: ...

    def observe(self, address: str, report: StatusReport) -> bool:
        """Note an agent's incarnation; True (and its rollouts restarted) when it is a new process."""
        ...

    async def finish_seals(self) -> int:
        """After a restore: seal the attempts the ledger saved SEALING; how many there were."""
        ...

    async def wait_for_receipts(self, timeout_s: float) -> None:
        """Return when a receipt (or anything else) changed the ledger, or after ``timeout_s``."""
        ...

    def receipts_with_cut(self, replica: int, receipts: tuple[Completed, ...]) -> None:
        """Take the receipts an agent's Prepared carried as arrived (those it may: ``Receipts.with_cut``)."""
        ...

    def export_ledger(self) -> LedgerFile:
        """The ledger and the anchor, at this instant (the cut)."""
        ...

    def adopt(self, ledger: Ledger, anchor: ControllerAnchor, saved: SavedWork) -> Continuation:
        """Take over a restored ledger and anchor."""
        ...

    def adopt_fallback(self, anchor: ControllerAnchor, trainer_state: dict[str, Any]) -> None:
        """Take over a trainer checkpoint's anchor and state, without a snapshot."""
        ...
