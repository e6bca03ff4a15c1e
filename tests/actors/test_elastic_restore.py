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
from parkway.actors.roles.controller.controller import RunSummary, SimulatedCrash
from parkway.actors.runtime.packs import read_records
from parkway.protocol.ids import parse_capture_key
from parkway.protocol.placement import policy_of
from structlog.testing import capture_logs

from tests.support.embedded import embedded_run
from tests.support.restores import saved_by_agent, watch_ends

BASE = {
    "run": "elastic",
    "seed": 5,
    "policy": {"host": "inline", "per_token_delay_s": 0.001},
    "tasks": {"builtin": "bank", "limit": 4},
    "rollout": {"group_size": 3, "max_turns": 6},
    "topology": {"agents": 2, "resources": 2},
    "snapshot_interval_s": 0.05,
}


@pytest.mark.parametrize(("agents", "resources"), [(3, 1), (1, 3)])
async def test_a_snapshot_restores_onto_other_numbers_of_agents_and_tool_servers(
    tmp_path: Path, agents: int, resources: int
) -> None:
    await restore_elsewhere(tmp_path, {"agents": agents, "resources": resources, "policies": 1})


async def restore_elsewhere(tmp_path: Path, live_topology: dict[str, int], **overrides: object) -> RunSummary:
    """The run of ``BASE`` (with ``overrides``) crashed after its second snapshot and restored onto
    ``live_topology``: checked against an uncrashed run; the resumed run's summary."""
    base = {**BASE, **overrides}
    topology = live_topology
    agents, resources = topology["agents"], topology["resources"]
    reference = await embedded_run(base, tmp_path / "reference", snapshots=False)
    state = tmp_path / "crashy"
    with pytest.raises(SimulatedCrash):
        await embedded_run(base, state, stop_after=2)
    snapshot = sorted((state / "snapshots" / "elastic").glob("snapshot_*"))[-1]
    manifest = json.loads((snapshot / "manifest.json").read_text())
    saved = base["topology"]
    assert manifest["replicas"] == {
        "agent": saved["agents"],
        "policy": saved.get("policies", 1),
        "resources": saved["resources"],
        "tq": 1,
    }
    held = saved_by_agent(snapshot)
    assert held.get(0) and held.get(1), (
        f"both agents must hold rollouts mid-flight, or this proves less: {held}"
    )

    live = {**base, "topology": topology}
    with capture_logs() as logs:
        resumed = await embedded_run(live, state)
    [moved] = [e for e in logs if e["event"] == "restore_onto_another_topology"]
    assert (moved["agents"], moved["resources"], moved["policies"]) == (
        agents,
        resources,
        topology["policies"],
    )
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
    assert set(resumed.model_calls_by_policy) == {f"policy/{i}" for i in range(topology["policies"])}
    return resumed


@pytest.mark.parametrize(("saved", "live"), [(2, 1), (1, 3)])
async def test_a_snapshot_restores_onto_another_number_of_policy_replicas_keeping_prefixes(
    tmp_path: Path, saved: int, live: int
) -> None:
    """At ``prefix``: each saved policy replica's kept prefixes are taken over by one live replica,
    and the restored rollouts' calls go there and continue from them."""
    resumed = await restore_elsewhere(
        tmp_path,
        {"agents": 2, "resources": 2, "policies": live},
        topology={"agents": 2, "resources": 2, "policies": saved},
        recovery={"target_level": "prefix"},
        policy={"host": "inline", "per_token_delay_s": 0.0005, "filler_words": 40},
        rollout={"group_size": 3, "max_turns": 6, "max_tokens": 900},
    )
    assert resumed.calls_continued > 0 and resumed.prefix_tokens_kept > 0
    assert resumed.prefix_fallbacks == 0 and resumed.prefix_tokens_regenerated == 0
    # Every restored rollout's calls went to the replica that took over its saved one: from one saved
    # replica, that is live replica 0 (the others serve rollouts dispatched after the restore).
    assert resumed.model_calls_by_policy["policy/0"] > 0


async def test_policy_replicas_share_the_calls_and_generate_what_one_would(tmp_path: Path) -> None:
    """Each rollout's calls go to the replica its id hashes to; what is generated does not change."""
    one = await embedded_run(BASE, tmp_path / "one", snapshots=False)
    three = await embedded_run(
        {**BASE, "topology": {"agents": 2, "resources": 2, "policies": 3}}, tmp_path / "three"
    )
    assert three.rollouts_sealed == 12 and three.rollouts_failed == 0
    assert three.transcripts_sha256 == one.transcripts_sha256
    assert three.snapshots_published >= 1  # every replica took part in the snapshots
    assert sorted(three.model_calls_by_policy) == ["policy/0", "policy/1", "policy/2"]
    assert all(calls > 0 for calls in three.model_calls_by_policy.values())
    assert sum(three.model_calls_by_policy.values()) == three.model_calls == one.model_calls


async def test_tq_shards_hold_each_rollouts_rows_and_snapshot_and_restore_them(tmp_path: Path) -> None:
    """Three TQ shards: every staging row goes to its rollout's shard, each shard's cut is in every
    snapshot (``tq/``, ``tq/1/``, ``tq/2/``), a snapshot verifies with the rows spread over them, and
    a crash after the second snapshot restores each shard's rows: transcripts as one TQ's."""
    from parkway.actors.storage.checks import missing_staging_keys, staging_files
    from parkway.actors.storage.select import verify_snapshot
    from parkway.protocol.placement import tq_of
    from parkway.protocol.rows import StagingRow

    sharded = {**BASE, "run": "sharded", "topology": {"agents": 2, "resources": 2, "tq_shards": 3}}
    one = await embedded_run(BASE, tmp_path / "one", snapshots=False)
    state = tmp_path / "sharded"
    with pytest.raises(SimulatedCrash):
        await embedded_run(sharded, state, stop_after=2)
    snapshot = sorted((state / "snapshots" / "sharded").glob("snapshot_*"))[-1]
    manifest = json.loads((snapshot / "manifest.json").read_text())
    assert manifest["replicas"]["tq"] == 3
    assert staging_files(snapshot) == ["tq/staging.msgpack", "tq/1/staging.msgpack", "tq/2/staging.msgpack"]
    held = {}
    for shard, path in enumerate(staging_files(snapshot)):
        rows = read_records(snapshot / path, StagingRow)
        assert all(tq_of(parse_capture_key(r.capture_key)[0], 3) == shard for r in rows)  # its own only
        held[shard] = len(rows)
    assert all(held.values()), f"every shard must hold rows, or this proves less: {held}"
    verify_snapshot(snapshot)  # every file and every staging row an agent saved, across the shards
    assert missing_staging_keys(snapshot) == {}

    resumed = await embedded_run(sharded, state)
    assert resumed.restores == 1 and resumed.rollouts_restored == len(manifest["episodes"]) > 0
    assert resumed.rollouts_sealed == 12 and resumed.rollouts_failed == 0 and resumed.mean_reward == 1.0
    assert resumed.transcripts_sha256 == one.transcripts_sha256
    assert resumed.turns_regenerated <= resumed.rollouts_restored


@pytest.mark.parametrize("level", ["sibling", "prompt_group"])
async def test_levels_that_keep_no_turns_restore_onto_another_topology_too(
    tmp_path: Path, level: str
) -> None:
    """Nothing continues: every running rollout (or its whole group) starts again from its prompt, on
    the live agents (a saved agent that is gone is nobody's to run them on)."""
    base = {**BASE, "recovery": {"target_level": level}}
    reference = await embedded_run(base, tmp_path / "reference", snapshots=False)
    state = tmp_path / "crashy"
    with pytest.raises(SimulatedCrash):
        await embedded_run(base, state, stop_after=2)
    resumed = await embedded_run({**base, "topology": {"agents": 1, "resources": 3, "policies": 2}}, state)
    assert resumed.restores == 1 and resumed.rollouts_restored == 0
    assert resumed.rollouts_sealed == 12 and resumed.rollouts_failed == 0 and resumed.mean_reward == 1.0
    assert resumed.transcripts_sha256 == reference.transcripts_sha256  # same seeds, same tokens
    assert set(resumed.rollouts_by_agent) == {"agent/0"}


async def test_a_continued_rollout_no_agent_found_aborts_the_restore(tmp_path: Path, monkeypatch) -> None:
    """An agent that comes back without one of the rollouts it was told to continue (its records lack
    it): the restore is aborted everywhere, never resumed with a hole in it."""
    from parkway.actors.roles.agent import Agent

    state = tmp_path / "holey"
    with pytest.raises(SimulatedCrash):
        await embedded_run(BASE, state, stop_after=2)
    install = Agent.install_snapshot

    async def loses_one(self: Agent, directory: Path, command: object) -> tuple:
        restored = await install(self, directory, command)  # type: ignore[arg-type]
        return restored[1:]  # as if its records had lacked the first

    monkeypatch.setattr(Agent, "install_snapshot", loses_one)
    seen = watch_ends(monkeypatch)
    with pytest.raises(Exception, match="no agent restored"):
        await embedded_run({**BASE, "topology": {"agents": 3, "resources": 1}}, state)
    assert not [s for s in seen if s[1] == "resume"]
    assert {a for a, kind in seen if kind == "abort"} >= {"agent/0", "agent/1", "resources/0", "policy/0"}


async def test_a_rollout_pinned_by_one_restore_keeps_its_replica_through_the_next(tmp_path: Path) -> None:
    """Restored from one policy replica onto three, a continued rollout's calls stay on replica 0 (the
    one that took over its prefix), recorded in the ledger: crashed and restored again onto the same
    three, its next kept prefix is found there, not regenerated on the replica its id hashes to."""
    base = {
        **BASE,
        "recovery": {"target_level": "prefix"},
        "policy": {"host": "inline", "per_token_delay_s": 0.0005, "filler_words": 40},
        "rollout": {"group_size": 3, "max_turns": 6, "max_tokens": 900},
    }
    three = {**base, "topology": {"agents": 2, "resources": 2, "policies": 3}}
    reference = await embedded_run(base, tmp_path / "reference", snapshots=False)
    state = tmp_path / "twice"
    with pytest.raises(SimulatedCrash):
        await embedded_run(base, state, stop_after=2)
    with pytest.raises(SimulatedCrash):
        await embedded_run(three, state, stop_after=2)  # restored onto three, crashed again
    snapshot = sorted((state / "snapshots" / "elastic").glob("snapshot_*"))[-1]
    assert json.loads((snapshot / "manifest.json").read_text())["replicas"]["policy"] == 3
    kept = {}  # the prefixes each replica kept of calls in flight, by rollout
    for path in snapshot.glob("participants/policy/*/participant.msgpack"):
        [record] = msgspec.msgpack.decode(path.read_bytes())
        kept.update({p["rollout_id"]: int(path.parent.name) for p in record["prefixes"]})
    pinned = {r: replica for r, replica in kept.items() if replica != policy_of(r, 3)}
    assert pinned, f"the second snapshot must hold a pinned rollout's prefix, or this proves nothing: {kept}"
    resumed = await embedded_run(three, state)
    assert resumed.restores == 2 and resumed.rollouts_sealed == 12 and resumed.rollouts_failed == 0
    # Every kept prefix continued its call: the pinned ones too, on the replica that held them.
    assert resumed.calls_continued == len(kept) and resumed.prefix_fallbacks == 0
    assert resumed.prefix_tokens_regenerated == 0  # every kept prefix was where its call went
    assert resumed.transcripts_sha256 == reference.transcripts_sha256
