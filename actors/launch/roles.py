"""Which class plays which role, and the order ``parkway up`` starts them in."""

from __future__ import annotations

from parkway.actors.roles.agent import Agent
from parkway.actors.roles.controller.controller import Controller
from parkway.actors.roles.policy import Policy
from parkway.actors.roles.resources import Resources
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.runtime.actor import Actor

ROLES: dict[str, type[Actor]] = {
    "tq": TransferQueue,
    "policy": Policy,
    "resources": Resources,
    "agent": Agent,
    "controller": Controller,
}

# The default embedded cluster: role -> number of replicas.
DEFAULT_TOPOLOGY: dict[str, int] = {"tq": 1, "policy": 1, "resources": 2, "agent": 2, "controller": 1}
