"""The policy model: admission, in-flight calls, held replies, token lineage; engines in Ray actors.

For now a checkpoint participant with no engine; generation comes with the rollout engine.
"""

from __future__ import annotations

from parkway.actors.participant import Participant


class Policy(Participant):
    role = "policy"
