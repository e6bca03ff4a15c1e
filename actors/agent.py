"""Agent replicas (``agent/N``): run the multi-turn loop of each rollout and park at boundaries.

For now an agent is a checkpoint participant with nothing in flight; the turn loop comes with the
rollout engine.
"""

from __future__ import annotations

from parkway.actors.participant import Participant


class Agent(Participant):
    role = "agent"
