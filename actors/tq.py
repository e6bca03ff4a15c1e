"""The TransferQueue actor: staging rows per model call and canonical rows per finished rollout.

For now a checkpoint participant with no rows; storage comes with the rollout engine.
"""

from __future__ import annotations

from parkway.actors.participant import Participant


class TransferQueue(Participant):
    role = "tq"
