"""What a snapshot is judged by before a restore takes it: the work it belongs to and who took part."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
from parkway.actors.run.config import RunConfig
from parkway.protocol.ids import PARTICIPANT_ROLES, Role, actor_address
from parkway.protocol.messages import Capabilities
from parkway.protocol.placement import Topology


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_fingerprint(config: RunConfig) -> str:
    """What a snapshot depends on: the work and its identities, not tuning (intervals, hosts, timeouts)."""
    r = config.rollout
    return fingerprint(
        {
            "run": config.run,
            "seed": config.seed,
            "agent": config.agent,
            # The plugins a snapshot's sessions and trainer state belong to.
            "environments": list(config.environments),
            "trainer": config.trainer.kind,
            "tasks": msgspec.to_builtins(config.tasks),
            "rollout": [r.group_size, r.max_turns, r.max_tokens],
            # Not the topology: a snapshot restores onto other numbers of agents and tool servers
            # (protocol/placement.py); the manifest records its own.
            "resources": config.resources.mode,
            "engine": config.policy.engine,
        }
    )


def replica_count(config: RunConfig, role: Role) -> int:
    """How many replicas of a participant role the configuration runs."""
    return {
        Role.TQ: config.topology.tq_shards,
        Role.POLICY: config.topology.policies,
        Role.RESOURCES: config.topology.resources,
        Role.AGENT: config.topology.agents,
    }[role]


def replica_addresses(config: RunConfig, role: Role) -> list[str]:
    """The addresses of one participant role's replicas (``tq/0``, ``tq/1`` ...)."""
    return [actor_address(role, i) for i in range(replica_count(config, role))]


def live_topology(config: RunConfig) -> Topology:
    """The numbers of agents, tool servers and policy replicas a restore places rollouts on."""
    t = config.topology
    return Topology(agents=t.agents, resources=t.resources, policies=t.policies)


def replica_counts(config: RunConfig) -> dict[str, int]:
    """Replicas per participant role, as a manifest records them."""
    return {str(role): replica_count(config, role) for role in PARTICIPANT_ROLES}


def topology_of(capabilities: list[Capabilities]) -> list[dict[str, Any]]:
    """Who takes part, sorted; restart-only flags are excluded (they may change between runs)."""
    return sorted(
        ({"role": c.role, "replica": c.replica} for c in capabilities),
        key=lambda d: (d["role"], d["replica"]),
    )


def expected_topology(config: RunConfig) -> list[dict[str, Any]]:
    """The topology the configuration asks for, as ``topology_of`` writes a live one."""
    return sorted(
        (
            {"role": role, "replica": i}
            for role in PARTICIPANT_ROLES
            for i in range(replica_count(config, role))
        ),
        key=lambda d: (d["role"], d["replica"]),
    )
