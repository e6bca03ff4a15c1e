"""Which class plays which role, and the order ``parkway up`` starts them in."""

from __future__ import annotations

from parkway.actors.agent import Agent
from parkway.actors.controller import Controller
from parkway.actors.policy import Policy
from parkway.actors.resources import Resources
from parkway.actors.runtime import Actor
from parkway.actors.tq import TransferQueue

ROLES: dict[str, type[Actor]] = {
    "tq": TransferQueue,
    "policy": Policy,
    "resources": Resources,
    "agent": Agent,
    "controller": Controller,
}

# The default embedded cluster: role -> number of replicas.
DEFAULT_TOPOLOGY: dict[str, int] = {"tq": 1, "policy": 1, "resources": 2, "agent": 2, "controller": 1}
