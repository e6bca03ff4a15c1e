"""Whole workloads on the in-memory broker: the controller, agents, resources, policy and TQ together."""

from __future__ import annotations

from pathlib import Path

import pytest
from parkway.actors.launch.workload import run_workload
from parkway.actors.roles.controller.controller import RunSummary
from parkway.actors.run.config import from_dict
from parkway.actors.run.tasks import load_tasks
from parkway.brokers.memory import MemoryBroker, MemoryHub

from tests.support.signed import SECRET


async def run(tmp_path: Path, **overrides: object) -> RunSummary:
    data = {"run": "wl", "seed": 11, "policy": {"host": "inline"}, "tasks": {"limit": 6}, **overrides}
    config = from_dict(data)
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        return await run_workload(
            broker, SECRET, config, load_tasks(config.tasks), embedded=True, state_root=tmp_path
        )


async def test_every_rollout_is_sealed_and_trained(tmp_path: Path) -> None:
    summary = await run(tmp_path)
    assert summary.rollouts_expected == summary.rollouts_sealed == 18
    assert summary.attempts_dispatched == 18 and summary.rollouts_failed == 0
    assert summary.model_calls == summary.turns_generated == 18 * 5  # every turn captured in TQ
    assert summary.tool_mutations_applied > 0 and summary.mean_reward == 1.0  # every session verified
    assert summary.sessions_leaked == 0
    assert summary.train_steps == 3 and summary.policy_version == 3  # 6 groups in batches of 2
    assert summary.acks_sent == 18 and summary.ack_batches < 18  # receipts acknowledged in batches
    # Two agent replicas and two resources replicas share the work.
    assert summary.rollouts_by_agent == {"agent/0": 9, "agent/1": 9}
    assert set(summary.tool_calls_by_resources) == {"resources/0", "resources/1"}
    assert all(n > 0 for n in summary.tool_calls_by_resources.values())
    assert sum(summary.tool_calls_by_resources.values()) == summary.tool_calls


async def test_same_seeds_same_transcripts(tmp_path: Path) -> None:
    first = await run(tmp_path / "a")
    second = await run(tmp_path / "b")
    other_seed = await run(tmp_path / "c", seed=12)
    assert first.transcripts_sha256 == second.transcripts_sha256
    assert first.transcripts_sha256 != other_seed.transcripts_sha256


async def test_a_live_failure_under_sibling_redoes_only_that_sibling(tmp_path: Path) -> None:
    summary = await run(
        tmp_path, faults={"fail_attempts": ["t0002_g1@0:2"]}, recovery={"default_granularity": "sibling"}
    )
    assert summary.rollouts_sealed == 18 and summary.rollouts_failed == 0
    assert (summary.attempts_failed, summary.rollouts_redone, summary.attempts_dispatched) == (1, 1, 19)
    assert summary.attempts_abandoned == 0
    assert summary.turns_regenerated == 2  # turns 0 and 1 of t0002_g1 were generated again


async def test_a_live_failure_under_prompt_group_redoes_the_whole_group(tmp_path: Path) -> None:
    summary = await run(
        tmp_path, faults={"fail_attempts": ["t0002_g1@0:2"]}, recovery={"default_granularity": "prompt_group"}
    )
    assert summary.rollouts_sealed == 18 and summary.rollouts_failed == 0
    assert (summary.attempts_failed, summary.rollouts_redone, summary.attempts_dispatched) == (1, 3, 21)
    assert summary.sessions_leaked == 0  # the retired siblings' sessions were released too


async def test_a_sibling_that_keeps_failing_is_a_typed_failure_not_a_sample(tmp_path: Path) -> None:
    summary = await run(
        tmp_path, faults={"fail_attempts": ["t0001_g0@0:0", "t0001_g0@1:1"]}, rollout={"max_attempts": 2}
    )
    assert summary.rollouts_failed == 1 and summary.rollouts_sealed == 17
    assert summary.train_steps == 3  # its group still trained, with the failure reported, not faked


async def test_garbage_from_the_model_fails_the_attempt_not_the_agent(tmp_path: Path) -> None:
    # Replies cut at 20 tokens never close a tool call: every attempt is garbage, nothing crashes.
    summary = await run(tmp_path, rollout={"max_tokens": 20, "max_attempts": 1}, tasks={"limit": 2})
    assert summary.rollouts_failed == 6 and summary.rollouts_sealed == 0
    assert summary.attempts_failed == 6
    assert summary.sessions_leaked == 0  # sessions of failed attempts are released, not leaked


@pytest.mark.parametrize("agent", ["tool", "counter"])
async def test_both_shipped_agents_run(tmp_path: Path, agent: str) -> None:
    summary = await run(tmp_path, agent=agent, tasks={"builtin": "counter", "limit": 2})
    assert summary.rollouts_sealed == 6 and summary.mean_reward == 1.0


def test_the_policy_and_resources_hold_every_rollouts_call_and_still_take_control_commands() -> None:
    # A model call waiting at a closed admission gate holds its delivery; with a prefetch at or below
    # the rollouts in flight, the checkpoint's own Commit and Resume queued behind those calls (seen at
    # 1024 rollouts in flight: the commit timed out and the snapshot was aborted).
    from parkway.actors.launch.workload import CONTROL_HEADROOM, role_options

    config = from_dict({"rollout": {"max_in_flight": 4096}, "policy": {"host": "inline"}})
    for role in ("policy", "resources"):
        assert role_options(role, config)["prefetch"] == 4096 + CONTROL_HEADROOM


def test_the_deterministic_engine_takes_its_time_and_cpu_per_token_from_the_configuration() -> None:
    from parkway.actors.launch.workload import role_options

    config = from_dict(
        {
            "policy": {
                "host": "inline",
                "per_token_delay_s": 0.05,
                "cpu_per_token_s": 0.0001,
                "filler_words": 90,
                "engine_record": "/tmp/e.jsonl",
            },
            "recovery": {"target_level": "prefix"},
        }
    )
    options = role_options("policy", config)
    assert options["engine"].kwargs == {
        "per_token_delay_s": 0.05,
        "cpu_per_token_s": 0.0001,
        "filler_words": 90,
        "record": "/tmp/e.jsonl",
    }
    assert options["keep_prefixes"] is True and options["progress_interval_s"] == 0.5
    assert role_options("policy", from_dict({}))["keep_prefixes"] is False


async def test_the_ledger_holds_the_groups_in_play_not_the_whole_dataset(tmp_path: Path, monkeypatch) -> None:
    # With every task admitted at the start, each snapshot encoded (and each dispatch walked) all of
    # them: its cost grew with the dataset, not with the rollouts in flight.
    from parkway.actors.roles.controller.dispatch import Dispatcher

    sizes: list[int] = []
    dispatch = Dispatcher.dispatch_ready

    async def observed(self: Dispatcher) -> None:
        sizes.append(len(self._state.ledger.groups))
        await dispatch(self)

    monkeypatch.setattr(Dispatcher, "dispatch_ready", observed)
    # A trainer slower than generation is held to a batch waiting by the backpressure bound.
    summary = await run(
        tmp_path,
        tasks={"limit": 12},
        rollout={"group_size": 1, "max_in_flight": 2},
        trainer={"batch_groups": 2, "max_untrained_groups": 2},
    )
    assert summary.rollouts_sealed == summary.rollouts_expected == 12 and summary.train_steps == 6
    assert max(sizes) <= 2 + 2  # the two in flight, and at most a batch waiting for the trainer


def test_the_controller_takes_a_receipt_of_every_rollout_in_flight_at_once() -> None:
    # A wave of rollouts finishing together: each receipt's handler holds its delivery while the seal
    # goes to TQ. Below every rollout's receipt (the controller's own 256), the receipts beyond it would
    # arrive only as other seals came back, and a snapshot's drain would wait for them.
    from parkway.actors.launch.workload import CONTROL_HEADROOM, workload_controller
    from parkway.actors.roles.controller.controller import Controller

    broker = MemoryBroker(MemoryHub(), "prefetch")
    for in_flight in (16, 1024, 4096):
        config = from_dict({"run": "prefetch", "rollout": {"max_in_flight": in_flight}})
        controller = workload_controller(broker, SECRET, config)
        assert controller.prefetch == max(in_flight + CONTROL_HEADROOM, Controller.prefetch)
