"""A snapshot of two agents and two tool servers restored onto other numbers of them, on the in-memory
broker (the real-process version: tests/integration/test_elastic_restore_process.py).

The run "dies" after its second snapshot with rollouts of both agents mid-flight; a fresh cluster of
three agents and one tool server (or one agent and three tool servers) restores it: every saved
rollout continues on the agent it is placed on, its tool session moved with it, and the transcripts
are those of a run that never crashed.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from parkway.actors.roles.controller.controller import SimulatedCrash
from parkway.protocol.layout import AGENT_ROLLOUTS
from parkway.protocol.transcript import SavedRollout
from structlog.testing import capture_logs

from tests.support.embedded import embedded_run

BASE = {
    "run": "elastic",
    "seed": 5,
    "policy": {"host": "inline", "per_token_delay_s": 0.001},
    "tasks": {"builtin": "bank", "limit": 4},
    "rollout": {"group_size": 3, "max_turns": 6},
    "topology": {"agents": 2, "resources": 2},
    "snapshot_interval_s": 0.05,
}


def saved_by_agent(snapshot: Path) -> dict[int, list[str]]:
    """The rollouts each saved agent's directory holds."""
    held = {}
    for path in sorted(snapshot.glob(f"participants/agent/*/{AGENT_ROLLOUTS}")):
        items = msgspec.msgpack.decode(path.read_bytes(), type=list[SavedRollout])
        held[int(path.parent.name)] = [i.run.rollout_id for i in items]
    return held


@pytest.mark.parametrize(("agents", "resources"), [(3, 1), (1, 3)])
async def test_a_snapshot_restores_onto_other_numbers_of_agents_and_tool_servers(
    tmp_path: Path, agents: int, resources: int
) -> None:
    reference = await embedded_run(BASE, tmp_path / "reference", snapshots=False)
    state = tmp_path / "crashy"
    with pytest.raises(SimulatedCrash):
        await embedded_run(BASE, state, stop_after=2)
    snapshot = sorted((state / "snapshots" / "elastic").glob("snapshot_*"))[-1]
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert manifest["replicas"] == {"agent": 2, "policy": 1, "resources": 2, "tq": 1}
    held = saved_by_agent(snapshot)
    assert held.get(0) and held.get(1), (
        f"both agents must hold rollouts mid-flight, or this proves less: {held}"
    )

    live = {**BASE, "topology": {"agents": agents, "resources": resources}}
    with capture_logs() as logs:
        resumed = await embedded_run(live, state)
    [moved] = [e for e in logs if e["event"] == "restore_onto_another_topology"]
    assert (moved["agents"], moved["resources"]) == (agents, resources)
    assert resumed.restores == 1 and resumed.rollouts_restored == len(manifest["episodes"])
    assert resumed.rollouts_sealed == resumed.rollouts_expected == 12 and resumed.rollouts_failed == 0
    assert resumed.mean_reward == 1.0  # each moved bank session replays to its balances
    assert resumed.sessions_leaked == 0 and resumed.tool_mutations_duplicated == 0
    assert resumed.turns_regenerated <= resumed.rollouts_restored  # only the calls in flight
    assert resumed.transcripts_sha256 == reference.transcripts_sha256
    # One agent: agent 1's saved rollouts all moved to agent 0; three agents: nobody had to move.
    assert resumed.rollouts_moved == (len(held[1]) if agents == 1 else 0)
    assert set(resumed.rollouts_by_agent) <= {f"agent/{i}" for i in range(agents)}
    assert set(resumed.tool_calls_by_resources) <= {f"resources/{i}" for i in range(resources)}
