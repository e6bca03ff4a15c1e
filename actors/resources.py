"""Resources (tool servers): per-rollout sessions with a revision counter and idempotent mutations.

For now a checkpoint participant with no sessions; environments come with the rollout engine.
"""

from __future__ import annotations

from parkway.actors.participant import Participant


class Resources(Participant):
    role = "resources"
