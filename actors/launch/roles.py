"""Which class plays which role, and the order ``parkway up`` starts them in."""

from __future__ import annotations

from parkway.actors.roles.agent import Agent
from parkway.actors.roles.controller.controller import Controller
from parkway.actors.roles.policy import Policy
from parkway.actors.roles.resources import Resources
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.roles.trainer import TrainerActor
from parkway.actors.runtime.actor import Actor
from parkway.protocol.ids import Role

ROLES: dict[Role, type[Actor]] = {
    Role.TQ: TransferQueue,
    Role.POLICY: Policy,
    Role.RESOURCES: Resources,
    Role.AGENT: Agent,
    Role.TRAINER: TrainerActor,
    Role.CONTROLLER: Controller,
}

# The default embedded cluster: role -> number of replicas.
DEFAULT_TOPOLOGY: dict[Role, int] = {
    Role.TQ: 1,
    Role.POLICY: 1,
    Role.RESOURCES: 2,
    Role.AGENT: 2,
    Role.TRAINER: 1,  # pairs with a workload of trainer.host: service (inline, its controller hosts one)
    Role.CONTROLLER: 1,
}
