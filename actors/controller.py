"""The controller: the only coordinator of a run (admission gate, ledger, snapshots, restore).

The foundation gives it the actor runtime only: it answers Status, Discover and Probe. The rollout
engine and the snapshot coordinator are built on it by later work.
"""

from __future__ import annotations

from parkway.actors.runtime import Actor


class Controller(Actor):
    role = "controller"
