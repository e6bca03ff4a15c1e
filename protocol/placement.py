"""Where each rollout a restore continues runs, when the live cluster has another number of agents or
tool servers than the snapshot's (an elastic restore; docs/recovery.md#another-topology).

A rollout runs on agent replica ``a`` and uses tool server ``a % resources`` (``dispatch``). A snapshot
saves each rollout's transcript in its agent's directory and its tool session in that tool server's.
After a restore onto ``agents'`` agents and ``resources'`` tool servers:

- a continued rollout keeps its agent replica when that replica still exists, and otherwise goes to
  the live agent holding the fewest continued rollouts so far (lowest index first): deterministic,
  and balanced as far as the kept ones allow;
- its tool session moves to ``new agent % resources'``.

Each live agent and tool server is told which saved replicas' directories hold its rollouts
(``Restore.sources``). Pure: no I/O, plain values in and out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class PlacementError(ValueError):
    """A topology no rollout can be placed on (no agent or no tool server)."""


@dataclass(frozen=True)
class Topology:
    """How many agents and tool servers a run has (the singletons, TQ and the policy, never change)."""

    agents: int
    resources: int

    def __post_init__(self) -> None:
        if self.agents < 1 or self.resources < 1:
            raise PlacementError(f"a run needs at least one agent and one tool server, not {self}")

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


def place(saved: Topology, live: Topology, origin: Mapping[str, int]) -> Placement:
    """Every continued rollout's live agent: its own replica if it still exists, else the least loaded."""
    for rollout, replica in origin.items():
        if not 0 <= replica < saved.agents:
            raise PlacementError(f"{rollout} was saved by agent {replica}, outside the snapshot's {saved}")
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
    return Placement(saved=saved, live=live, origin=dict(origin), agent=agent)


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
    """The snapshot's agents and tool servers, once its replicas (a manifest's ``replicas``) are found
    restorable onto the live ones: the same roles, and one TQ and one policy as it had."""
    if set(saved) != set(live):
        raise PlacementError(f"the snapshot's roles {sorted(saved)} are not the live {sorted(live)}")
    for role in sorted(set(saved) - {"agent", "resources"}):
        if saved[role] != live[role]:
            raise PlacementError(
                f"the snapshot had {saved[role]} {role} replicas, the live cluster {live[role]}: only the "
                "numbers of agents and tool servers may change between a snapshot and its restore"
            )
    try:
        return Topology(agents=saved["agent"], resources=saved["resources"])
    except KeyError as exc:
        raise PlacementError(f"the snapshot names no {exc.args[0]} replicas") from exc
