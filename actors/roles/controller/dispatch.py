"""Admission and dispatch: groups come into the ledger from the task cursor, reserved attempts go out
as ``Run`` to agent replicas while the gate is open, and the stall watchdog retires attempts that run
too long (the time they were parked does not count)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import structlog
from parkway.actors.roles.controller.gate import AdmissionGate
from parkway.actors.roles.controller.outbox import AckOutbox
from parkway.actors.roles.controller.retire import Retirement, stable_int
from parkway.actors.roles.controller.state import RunState
from parkway.actors.run.config import RunConfig, parse_fault
from parkway.actors.run.tasks import Task
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.history import History
from parkway.actors.runtime.settings import cluster_wait_s
from parkway.protocol.history import Dispatched, RolloutStalled
from parkway.protocol.ids import Role, actor_address, capture_key, rollout_id, task_group_id
from parkway.protocol.ledger import Granularity, GroupState
from parkway.protocol.messages import Failed, Run, TaskOptions
from parkway.protocol.placement import policy_of

log = structlog.get_logger("parkway.controller")


class Dispatcher:
    def __init__(
        self,
        *,
        client: Client,
        state: RunState,
        gate: AdmissionGate,
        counts: Counter[str],
        history: History,
        outbox: AckOutbox,
        retirement: Retirement,
        config: RunConfig,
        tasks: list[Task],
        holds: dict[str, int],
    ) -> None:
        self._client, self._state, self._gate = client, state, gate
        self._counts, self._history = counts, history
        self._outbox, self._retirement = outbox, retirement
        self._config, self._tasks, self._holds = config, tasks, holds
        self._faults = {(r, a): t for r, a, t in map(parse_fault, config.faults.fail_attempts)}
        self._dispatched_at: dict[tuple[str, int], tuple[float, float]] = {}  # -> (monotonic, paused then)
        self._waiting_for_trainer = False
        # The run loop and (on-policy) the watchdog's tick both dispatch: one at a time, or a sibling
        # reserved when both looked would go out twice.
        self._dispatching = asyncio.Lock()

    def forget(self, keys: Iterable[tuple[str, int]]) -> None:
        """Attempts of rollouts that ended (``forget.Forgetting``): their clocks go."""
        for key in keys:
            self._dispatched_at.pop(key, None)

    def sizes(self) -> dict[str, int]:
        return {"dispatch_clocks": len(self._dispatched_at)}

    def has_work(self) -> bool:
        """Groups in play, or tasks not admitted yet."""
        return bool(self._state.ledger.groups) or self._state.next_task < len(self._tasks)

    def admit_groups(self) -> None:
        """Bring groups into the ledger from the task cursor, as many as the free dispatch slots take.
        The ledger (and every snapshot of it) holds the groups in play, not the whole dataset: with
        every task admitted at the start, each snapshot encoded and walked all of them (10,000 prompts:
        7 MB and about 130 ms per snapshot, and the dispatch loop walked them on every wake-up)."""
        if not self._gate.is_open:  # nothing changes in the ledger while a snapshot is cut
            return
        config, state = self._config, self._state
        if config.trainer.on_policy:
            self._admit_batch()
            return
        if self._trainer_behind():
            return
        size = config.rollout.group_size
        want = config.rollout.max_in_flight - state.ledger.in_flight()
        waiting = len(state.ledger.reserved())
        granularity = Granularity(config.recovery.default_granularity)
        while state.next_task < len(self._tasks) and waiting < want:
            index = state.next_task
            state.ledger.add_group(state.group_id(index), index, size, granularity)
            state.next_task += 1
            waiting += size

    def _trainer_behind(self) -> bool:
        """Backpressure: as many groups sealed and not yet trained as ``trainer.max_untrained_groups``
        hold admission back (training a batch wakes the loop again). Said once per wait."""
        bound = self._config.trainer.untrained_bound()
        untrained = sum(1 for g in self._state.ledger.groups.values() if g.state is not GroupState.GENERATING)
        behind = untrained >= bound
        if behind and not self._waiting_for_trainer:
            self._counts["admission_waits_for_trainer"] += 1
            log.info("admission_waits_for_trainer", untrained_groups=untrained, bound=bound)
        self._waiting_for_trainer = behind
        return behind

    def _admit_batch(self) -> None:
        """On-policy: the next whole batch of ``trainer.batch_groups`` groups, once the ledger is empty.
        The trainer removes a batch's groups only after the policy loaded the weights it trained, so
        batch k runs on the weights of step k whatever the timing (and the dispatch order within it
        stays the ledger's)."""
        state = self._state
        if state.ledger.groups:
            return
        config = self._config
        granularity = Granularity(config.recovery.default_granularity)
        end = min(state.next_task + config.trainer.batch_groups, len(self._tasks))
        for index in range(state.next_task, end):
            state.ledger.add_group(state.group_id(index), index, config.rollout.group_size, granularity)
        if end > state.next_task:
            log.info("batch_admitted", first_task=state.next_task, groups=end - state.next_task)
        state.next_task = end

    async def dispatch_ready(self) -> None:
        async with self._dispatching:
            await self._dispatch_reserved()

    async def _dispatch_reserved(self) -> None:
        config, ledger = self._config, self._state.ledger
        await self._retirement.fence_unfenced()
        in_flight = ledger.in_flight()
        for sibling in ledger.reserved():
            if not self._gate.is_open or in_flight >= config.rollout.max_in_flight:
                return
            await self._retirement.fence_unfenced()  # an attempt that failed while this loop sent
            group = ledger.group_of(sibling.rollout_id)
            task = self._tasks[group.task_index]
            current = sibling.current
            attempt = current.index
            replica = current.replica  # pinned after a restore: a continuation runs where it was saved
            if replica is None:
                replica = (group.task_index * config.rollout.group_size + sibling.generation_index) % (
                    config.topology.agents
                )
            run = Run(
                rollout_id=sibling.rollout_id,
                attempt=attempt,
                group_id=group.group_id,
                env=task.env,
                prompt=task.prompt,
                max_turns=task.max_turns or config.rollout.max_turns,
                # Seeded by the task and sibling, not the session's ids: a session started afresh
                # generates what the first one did.
                seed=stable_int(
                    config.seed, rollout_id(task_group_id(group.task_index), sibling.generation_index)
                ),
                policy_version=self._state.policy_version,
                epoch=self._state.epoch,
                task=self.task_options(config, sibling.rollout_id, attempt, replica, current.continue_from),
            )
            ledger.dispatch(sibling.rollout_id, attempt, replica)
            self._history.record(
                Dispatched(
                    rollout_id=sibling.rollout_id,
                    attempt=attempt,
                    epoch=self._state.epoch,
                    replica=replica,
                    continue_from=current.continue_from,
                )
            )
            log.info(
                "rollout_dispatched",
                rollout_id=sibling.rollout_id,
                attempt=attempt,
                group_id=group.group_id,
                replica=replica,
                continue_from=current.continue_from,
            )
            self._dispatched_at[(sibling.rollout_id, attempt)] = (time.monotonic(), self._gate.parked_s())
            self._outbox.route((sibling.rollout_id, attempt), replica)
            self._counts["attempts_dispatched"] += 1
            in_flight += 1
            await self._client.send(  # an agent runs a Run once (by its key): a resend is harmless
                actor_address(Role.AGENT, replica),
                run,
                correlation_id=capture_key(sibling.rollout_id, attempt),
                retry_for_s=cluster_wait_s(),
            )

    def task_options(
        self, config: RunConfig, rollout: str, attempt: int, replica: int, continue_from: int | None = None
    ) -> TaskOptions:
        fail_at = self._faults.get((rollout, attempt))
        rate = config.faults.failure_rate
        if (
            fail_at is None
            and rate > 0
            and stable_int(config.seed, rollout, attempt, "fail") % 10**6 < rate * 10**6
        ):
            fail_at = stable_int(config.seed, rollout, attempt, "turn") % config.rollout.max_turns
        vllm_model = config.policy.model if config.policy.engine == "vllm" else None
        # A restored rollout's calls go to the replica that took over its saved prefix (pinned in the
        # ledger); any other's to the replica its id hashes to (None, the agent's own, when there is one).
        policy = self._state.ledger.sibling(rollout).attempts[attempt].policy
        if policy is None and config.topology.policies > 1:
            policy = policy_of(rollout, config.topology.policies)
        return TaskOptions(
            agent=config.agent,
            resources=replica % config.topology.resources,
            policy=policy,
            max_tokens=config.rollout.max_tokens,
            fail_at_turn=fail_at,
            continue_from=continue_from,
            tokenizer=vllm_model or None,  # agents render prompts with the model's own template
            hold_at_turn=self._holds.get(rollout),
        )

    # -- the stall watchdog ---------------------------------------------------------------------------
    def stalled(self, timeout_s: float) -> list[tuple[str, int]]:
        """Attempts running longer than ``timeout_s``, not counting the time they were parked."""
        now, paused = time.monotonic(), self._gate.parked_s()
        ledger = self._state.ledger
        # A seal that never comes back stalls its attempt as well (failed, it is redone).
        live = ledger.dispatched() | {(s.rollout_id, a.index) for s, a in ledger.sealing()}
        # An attempt that is no longer running (failed, replaced, restored over) needs no clock: the
        # clocks held are those of the attempts running, each tick (work proportional to them).
        for key in self._dispatched_at.keys() - live:
            del self._dispatched_at[key]
        return [
            key
            for key in sorted(live)
            if key in self._dispatched_at
            and now - self._dispatched_at[key][0] - (paused - self._dispatched_at[key][1]) > timeout_s
        ]

    async def check_stalls(self, fail: Callable[[Failed], Awaitable[None]]) -> None:
        """The stall watchdog: parked time does not count (NeMo's counted it and aborted healthy runs).
        A stalled attempt is stopped where it hangs, then failed (``fail``) like a reported failure."""
        timeout_s = self._config.rollout.stall_timeout_s
        for rollout, attempt in self.stalled(timeout_s):
            replica = self._state.ledger.sibling(rollout).current.replica
            log.warning("rollout_stalled", rollout_id=rollout, attempt=attempt, timeout_s=timeout_s)
            self._counts["attempts_stalled"] += 1
            self._history.record(RolloutStalled(rollout_id=rollout, attempt=attempt))
            if replica is not None:
                await self._retirement.retire(((rollout, attempt, replica),))
            await fail(Failed(rollout_id=rollout, attempt=attempt, code="stalled"))
        if self._config.trainer.on_policy:
            # The run loop sleeps until a receipt, and after the batch it trained nothing is out to
            # send one: the watchdog's tick sends the next batch (at most a tick after the weights
            # loaded; the weights each batch runs on do not depend on when).
            self.admit_groups()
            await self.dispatch_ready()
