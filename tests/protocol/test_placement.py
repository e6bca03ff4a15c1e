"""Where a restore onto another number of agents and tool servers runs each rollout: plain values."""

from __future__ import annotations

import pytest
from parkway.protocol.placement import PlacementError, Topology, counts_of, place, policy_of, saved_topology

TWO_BY_TWO = Topology(agents=2, resources=2)
# Six running rollouts, three saved by each agent (agent a's tool server was a % 2).
ORIGIN = {"r0": 0, "r1": 1, "r2": 0, "r3": 1, "r4": 0, "r5": 1}


def test_the_same_topology_moves_nothing() -> None:
    placement = place(TWO_BY_TWO, TWO_BY_TWO, ORIGIN)
    assert not placement.elastic
    assert placement.agent == ORIGIN
    assert placement.agent_sources(0) == (0,) and placement.agent_sources(1) == (1,)
    assert placement.tool_server_sources(1) == (1,)


def test_more_agents_one_tool_server() -> None:
    placement = place(TWO_BY_TWO, Topology(agents=3, resources=1), ORIGIN)
    assert placement.elastic
    assert placement.agent == ORIGIN  # both saved agents still exist: nobody moves agent
    assert placement.agent_sources(2) == ()  # the new agent continues nothing (new work fills it)
    # Every session now lives on the one tool server, read from both saved servers' directories.
    assert {placement.on_tool_server(r) for r in ORIGIN} == {0}
    assert placement.tool_server_sources(0) == (0, 1)


def test_one_agent_three_tool_servers() -> None:
    placement = place(TWO_BY_TWO, Topology(agents=1, resources=3), ORIGIN)
    assert set(placement.agent.values()) == {0}
    assert placement.agent_sources(0) == (0, 1)
    assert placement.tool_server_sources(0) == (0, 1)  # agent 0's server is 0 % 3
    assert placement.tool_server_sources(1) == placement.tool_server_sources(2) == ()


def test_moved_rollouts_go_to_the_least_loaded_agent_in_order() -> None:
    origin = {"a": 3, "b": 3, "c": 0, "d": 2, "e": 3}
    placement = place(Topology(agents=4, resources=1), Topology(agents=2, resources=1), origin)
    # c stays on 0; agent 1 is empty, so the moved ones (a, b, d, e in order) fill 1, 0, 1, 0.
    assert placement.agent == {"a": 1, "b": 0, "c": 0, "d": 1, "e": 0}
    assert placement.agent_sources(0) == (0, 3) and placement.agent_sources(1) == (2, 3)


def test_placement_is_deterministic() -> None:
    origin = {f"r{i}": i % 5 for i in range(50)}
    saved, live = Topology(agents=5, resources=2), Topology(agents=3, resources=4)
    assert place(saved, live, origin) == place(saved, live, dict(reversed(origin.items())))
    loads = [list(place(saved, live, origin).agent.values()).count(i) for i in range(3)]
    assert max(loads) - min(loads) <= 10  # the kept ones (10 each on 0..2) plus 20 spread over 3


def test_refusals() -> None:
    with pytest.raises(PlacementError, match="at least one agent"):
        Topology(agents=0, resources=1)
    with pytest.raises(PlacementError, match="outside the snapshot"):
        place(TWO_BY_TWO, TWO_BY_TWO, {"r": 2})
    with pytest.raises(PlacementError, match="not numbered 0 to 1"):
        counts_of([("agent", 0), ("agent", 2)])


def test_tq_may_not_change() -> None:
    saved = {"agent": 2, "resources": 2, "policy": 1, "tq": 1}
    assert saved_topology(saved, {**saved, "agent": 3, "resources": 1, "policy": 4}) == TWO_BY_TWO
    with pytest.raises(PlacementError, match="1 tq replicas, the live cluster 2"):
        saved_topology(saved, {**saved, "tq": 2})
    with pytest.raises(PlacementError, match="roles"):
        saved_topology(saved, {"agent": 2, "resources": 2, "policy": 1})
    with pytest.raises(PlacementError, match="no agent replicas"):
        saved_topology({"resources": 2}, {"resources": 2})


def test_a_rollouts_calls_hash_to_one_policy_replica() -> None:
    ids = [f"g{i}:s{j}" for i in range(50) for j in range(4)]
    assert {policy_of(r, 1) for r in ids} == {0}
    spread = [policy_of(r, 3) for r in ids]
    assert spread == [policy_of(r, 3) for r in ids]  # the same in every process (not Python's hash)
    assert all(spread.count(i) > 40 for i in range(3))  # 200 ids over 3 replicas, none starved


def test_each_saved_policy_replica_is_taken_over_by_exactly_one_live_one() -> None:
    origin = {f"r{i}": i % 2 for i in range(40)}
    for saved_n, live_n in ((1, 2), (2, 1), (3, 2), (2, 3)):
        placement = place(Topology(2, 2, saved_n), Topology(2, 2, live_n), origin)
        taken = [s for p in range(live_n) for s in placement.policy_sources(p)]
        assert sorted(taken) == list(range(saved_n))
        for rollout in origin:  # a restored rollout's calls go to whoever took over its saved replica
            saved_replica = policy_of(rollout, saved_n)
            assert saved_replica in placement.policy_sources(placement.on_policy(rollout))


def test_tq_shards_group_rollouts_by_their_hash() -> None:
    from parkway.protocol import layout
    from parkway.protocol.placement import by_tq_shard, tq_address, tq_of

    ids = [f"t{i:04d}_g{j}" for i in range(30) for j in range(3)]
    grouped = by_tq_shard(ids, 3)
    assert sorted(r for rs in grouped.values() for r in rs) == sorted(ids)
    assert all(tq_of(r, 3) == shard for shard, rs in grouped.items() for r in rs)
    assert set(grouped) == {0, 1, 2} and by_tq_shard(ids, 1) == {0: tuple(ids)}
    assert tq_address(ids[0], 1) == "tq/0"
    # Shard 0 writes where one TQ always did; the others in a folder of their own beneath it.
    assert layout.participant_parts("tq", 0) == ("tq",) and layout.participant_parts("tq", 2) == ("tq", "2")
    assert layout.writer_of("tq/staging.msgpack") == "tq/0"
    assert layout.writer_of("tq/2/staging.msgpack") == "tq/2"


def test_a_pinned_rollout_stays_with_the_replica_that_holds_its_prefix() -> None:
    origin = {"r0": 0, "r1": 1}
    pinned = {r: (policy_of(r, 3) + 1) % 3 for r in origin}  # an earlier restore sent them elsewhere
    same = place(Topology(2, 2, 3), Topology(2, 2, 3), origin, policies=pinned)
    assert {r: same.on_policy(r) for r in origin} == pinned  # not where their ids hash to
    fewer = place(Topology(2, 2, 3), Topology(2, 2, 2), origin, policies=pinned)
    for rollout, replica in pinned.items():
        assert fewer.saved_policy(rollout) == replica
        assert replica in fewer.policy_sources(fewer.on_policy(rollout))
    with pytest.raises(PlacementError, match="outside the snapshot"):
        place(Topology(2, 2, 1), Topology(2, 2, 1), origin, policies={"r0": 1})
