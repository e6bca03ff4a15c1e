"""Which replica serves a rollout, and where each rollout a restore continues runs when the live
cluster has other numbers of agents, tool servers or policy replicas than the snapshot's (an elastic
restore; docs/recovery.md#another-topology).

A rollout runs on agent replica ``a``, uses tool server ``a % resources`` and sends its model calls to
policy replica ``policy_of(rollout, policies)`` (a hash of its id: all its calls on one replica, where
the engine's prefix cache pays). A snapshot saves each rollout's transcript in its agent's directory,
its tool session in that tool server's and its model call's kept prefix in that policy replica's.
After a restore onto ``agents'``, ``resources'`` and ``policies'``:

- a continued rollout keeps its agent replica when that replica still exists, and otherwise goes to
  the live agent holding the fewest continued rollouts so far (lowest index first): deterministic,
  and balanced as far as the kept ones allow;
- its tool session moves to ``new agent % resources'``;
- saved policy replica ``s`` is taken over by live replica ``s % policies'`` (each saved one by
  exactly one live one), and a continued rollout's calls go there until it ends (its prefix and the
  engine's cache of it are there).

Each live agent, tool server and policy replica is told which saved replicas' directories hold its
rollouts (``Restore.sources``). Pure: no I/O, plain values in and out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def _hashed(rollout_id: str, count: int, salt: bytes) -> int:
    if count <= 1:
        return 0
    digest = hashlib.sha256(salt + rollout_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


def policy_of(rollout_id: str, policies: int) -> int:
    """The policy replica a rollout's model calls go to: the same in every process and run."""
    return _hashed(rollout_id, policies, b"")


def tq_of(rollout_id: str, shards: int) -> int:
    """The TQ shard that holds a rollout's rows (staging, canonical, lineage) and takes its seal."""
    return _hashed(rollout_id, shards, b"tq\x1f")


def tq_address(rollout_id: str, shards: int) -> str:
    """``tq/<shard>`` of a rollout."""
    return f"tq/{tq_of(rollout_id, shards)}"


def by_tq_shard(rollout_ids: Iterable[str], shards: int) -> dict[int, tuple[str, ...]]:
    """Rollout ids grouped by their TQ shard, in their order (shards with none left out)."""
    grouped: dict[int, list[str]] = {}
    for rollout_id in rollout_ids:
        grouped.setdefault(tq_of(rollout_id, shards), []).append(rollout_id)
    return {shard: tuple(ids) for shard, ids in sorted(grouped.items())}


class PlacementError(ValueError):
    """A topology no rollout can be placed on (no agent or no tool server)."""


@dataclass(frozen=True)
class Topology:
    """How many agents, tool servers and policy replicas a run has (TQ is one, always)."""

    agents: int
    resources: int
    policies: int = 1

    def __post_init__(self) -> None:
        if self.agents < 1 or self.resources < 1 or self.policies < 1:
            raise PlacementError(f"a run needs at least one agent, tool server and policy, not {self}")

    def tool_server_of(self, agent: int) -> int:
        """The tool server a rollout on ``agent`` calls (the dispatcher's rule)."""
        return agent % self.resources


@dataclass(frozen=True)
class Placement:
    """The continued rollouts' agents before and after, and the two topologies."""

    saved: Topology
    live: Topology
    origin: Mapping[str, int]  # rollout id -> the agent replica that saved it
    agent: Mapping[str, int]  # rollout id -> the live agent replica that continues it
    # rollout id -> the policy replica its calls went to, where not the one its id hashes to (pinned
    # by an earlier restore onto another number of replicas)
    policy_origin: Mapping[str, int] = field(default_factory=dict)

    @property
    def elastic(self) -> bool:
        return self.saved != self.live

    def agent_sources(self, replica: int) -> tuple[int, ...]:
        """The saved agent directories holding the rollouts live agent ``replica`` continues."""
        return tuple(sorted({self.origin[r] for r, a in self.agent.items() if a == replica}))

    def tool_server_sources(self, replica: int) -> tuple[int, ...]:
        """The saved tool server directories holding the sessions live tool server ``replica`` reopens."""
        return tuple(
            sorted(
                {
                    self.saved.tool_server_of(self.origin[r])
                    for r, a in self.agent.items()
                    if self.live.tool_server_of(a) == replica
                }
            )
        )

    def on_tool_server(self, rollout_id: str) -> int:
        return self.live.tool_server_of(self.agent[rollout_id])

    def saved_policy(self, rollout_id: str) -> int:
        """The policy replica a running rollout's calls went to when the snapshot was taken."""
        pinned = self.policy_origin.get(rollout_id)
        return policy_of(rollout_id, self.saved.policies) if pinned is None else pinned

    def on_policy(self, rollout_id: str) -> int:
        """The live policy replica a restored rollout's calls go to: the one that took over the saved
        replica its calls went to (which holds its kept prefix)."""
        return self.saved_policy(rollout_id) % self.live.policies

    def policy_sources(self, replica: int) -> tuple[int, ...]:
        """The saved policy replicas live ``replica`` takes over (their prefixes and counts)."""
        return tuple(s for s in range(self.saved.policies) if s % self.live.policies == replica)


def place(
    saved: Topology, live: Topology, origin: Mapping[str, int], policies: Mapping[str, int] | None = None
) -> Placement:
    """Every continued rollout's live agent: its own replica if it still exists, else the least loaded.
    ``policies``: the rollouts whose calls went to another policy replica than their hash's."""
    for rollout, replica in origin.items():
        if not 0 <= replica < saved.agents:
            raise PlacementError(f"{rollout} was saved by agent {replica}, outside the snapshot's {saved}")
    for rollout, replica in (policies or {}).items():
        if not 0 <= replica < saved.policies:
            raise PlacementError(
                f"{rollout}'s calls went to policy {replica}, outside the snapshot's {saved}"
            )
    load = [0] * live.agents
    agent: dict[str, int] = {}
    moved: list[str] = []
    for rollout in sorted(origin):
        replica = origin[rollout]
        if replica < live.agents:
            agent[rollout] = replica
            load[replica] += 1
        else:
            moved.append(rollout)
    for rollout in moved:
        least = min(range(live.agents), key=lambda i: (load[i], i))
        agent[rollout] = least
        load[least] += 1
    return Placement(
        saved=saved, live=live, origin=dict(origin), agent=agent, policy_origin=dict(policies or {})
    )


def counts_of(replicas: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Replicas per role from (role, replica) pairs, checking each role's replicas are 0..n-1."""
    seen: dict[str, set[int]] = {}
    for role, replica in replicas:
        seen.setdefault(role, set()).add(replica)
    counts = {}
    for role, indices in seen.items():
        if indices != set(range(len(indices))):
            raise PlacementError(
                f"{role} replicas {sorted(indices)} are not numbered 0 to {len(indices) - 1}"
            )
        counts[role] = len(indices)
    return counts


def saved_topology(saved: Mapping[str, int], live: Mapping[str, int]) -> Topology:
    """The snapshot's agents, tool servers and policy replicas, once its replicas (a manifest's
    ``replicas``) are found restorable onto the live ones: the same roles, and the TQ it had."""
    if set(saved) != set(live):
        raise PlacementError(f"the snapshot's roles {sorted(saved)} are not the live {sorted(live)}")
    for role in sorted(set(saved) - {"agent", "resources", "policy"}):
        if saved[role] != live[role]:
            raise PlacementError(
                f"the snapshot had {saved[role]} {role} replicas, the live cluster {live[role]}: only the "
                "numbers of agents, tool servers and policy replicas may change between a snapshot "
                "and its restore"
            )
    try:
        return Topology(agents=saved["agent"], resources=saved["resources"], policies=saved["policy"])
    except KeyError as exc:
        raise PlacementError(f"the snapshot names no {exc.args[0]} replicas") from exc
