"""The controller: the run's only coordinator, its snapshots and its restore.

controller.py    the actor: its handlers and its run loop
dispatch.py      admission from the task cursor, dispatch, the stall watchdog
receipts.py      Completed and Failed receipts      outbox.py   the ACK outbox
retire.py        retiring and fencing attempts      gate.py     the admission gate
cluster.py       who must answer, restart-only participants, agents that came back
training.py      the trainer hook and its checkpoints
state.py         what a snapshot carries of the run; adopt.py: taking it over at a restore
host.py          the interface the save and the restore use to reach the controller
snapshots.py     when to snapshot, what a failure costs; save.py and restore.py: the sequences
participants.py  asking a stage's participants at once
summary.py       RunSummary; metrics.py: what the snapshots cost; fingerprints.py: what they match
"""

from parkway.actors.roles.controller.controller import Controller
from parkway.actors.roles.controller.errors import (
    ClusterUnavailable,
    SetupError,
    SimulatedCrash,
    SnapshotsEnded,
    Unauthorized,
)
from parkway.actors.roles.controller.summary import RunSummary

__all__ = [
    "ClusterUnavailable",
    "Controller",
    "RunSummary",
    "SetupError",
    "SimulatedCrash",
    "SnapshotsEnded",
    "Unauthorized",
]
