"""Stopping attempts the run gave up on, and fencing them everywhere before their next attempt runs."""

from __future__ import annotations

import functools
import hashlib
import time
from collections import Counter, defaultdict

import structlog
from parkway.actors.roles.controller.fingerprints import replica_addresses
from parkway.actors.roles.controller.state import RunState
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.backoff import retrying
from parkway.actors.runtime.client import Client
from parkway.brokers.base import BrokerError, RequestTimeout
from parkway.protocol.ids import Role, actor_address
from parkway.protocol.messages import AttemptRef, Error, Retire

log = structlog.get_logger("parkway.controller")


FENCE_DEADLINE_S = 10.0  # what a participant has to answer a fence
FENCE_BROKER_WAIT_S = 8.0  # how long a fence waits for a broker it cannot reach (a restart: ~3-6 s)


def _fence_retried(address: str, exc: BaseException, pause: float) -> None:
    log.warning("fence_retried", participant=address, error=str(exc), pause_s=pause)


def stable_int(*parts: object) -> int:
    """A seed that is the same in every process and run (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Retirement:
    def __init__(self, client: Client, state: RunState, counts: Counter[str]) -> None:
        self._client, self._state, self._counts = client, state, counts
        # The run's configuration: who a fence goes to; None before a run starts (nothing to fence).
        self.config: RunConfig | None = None
        # Attempts that ended without a fence (lost with an agent process, or failed on their agent):
        # fenced everywhere before anything is dispatched again, so no stale copy of one of their
        # calls (requeued by a broker restart, resent by a client) is served once attempt N+1 exists.
        self.unfenced: list[AttemptRef] = []

    async def retire(self, attempts: tuple[tuple[str, int, int], ...]) -> None:
        """Stop ``(rollout, attempt, replica)`` attempts on their agents, then fence them everywhere."""
        by_replica: dict[int, list[AttemptRef]] = defaultdict(list)
        for rollout, attempt, replica in attempts:
            by_replica[replica].append(AttemptRef(rollout_id=rollout, attempt=attempt))
        for replica, refs in by_replica.items():
            command = Retire(
                checkpoint_id=f"retire-{stable_int(*refs) % 10**12}",
                deadline=time.time() + 30,
                attempts=tuple(refs),
            )
            reply = await self._client.request(actor_address(Role.AGENT, replica), command)
            if isinstance(reply, Error):
                log.warning("retire_refused", replica=replica, code=reply.code.value, detail=reply.detail)
                continue
            for ref in refs:
                self._state.ledger.retired(ref.rollout_id, ref.attempt)
                self._counts["attempts_retired"] += 1
        await self.fence(tuple(ref for refs in by_replica.values() for ref in refs))

    async def retire_pending(self) -> None:
        """Stop attempts given up on that may still run on an agent."""
        pending = tuple(
            (s.rollout_id, a.index, a.replica)
            for s, a in self._state.ledger.abandoned()
            if a.replica is not None
        )
        if pending:
            await self.retire(pending)

    async def fence_unfenced(self) -> None:
        """Fence the attempts that ended without one, once, before anything is dispatched again."""
        if self.unfenced:
            refs, self.unfenced = tuple(self.unfenced), []
            await self.fence(refs)

    async def fence(self, refs: tuple[AttemptRef, ...]) -> None:
        """Attempt N is refused everywhere before attempt N+1 is dispatched: the policy aborts its calls
        and stages none of its tokens, resources end its session, TQ drops rows of it still on the way.
        (Its agent stopped it, or ended it.) A broker that is down (restarting) is waited for, a few
        seconds: the participant behind it is alive and may yet be handed a requeued call of the attempt.
        A participant that does not answer is named and skipped: it was down, and what it had of the
        attempt is gone or comes back fenced by a restore."""
        if not refs or self.config is None:
            return
        command = Retire(
            checkpoint_id=f"fence-{stable_int(*refs) % 10**12}",
            deadline=time.time() + FENCE_DEADLINE_S,
            attempts=refs,
        )
        roles = (Role.POLICY, Role.RESOURCES, Role.TQ)
        for address in [a for role in roles for a in replica_addresses(self.config, role)]:
            try:
                reply = await retrying(
                    functools.partial(self._client.request, address, command),
                    retry_on=BrokerError,
                    for_s=FENCE_BROKER_WAIT_S,
                    first_s=0.1,
                    max_s=1.0,
                    on_retry=functools.partial(_fence_retried, address),
                    final=lambda exc: isinstance(exc, RequestTimeout),  # sent, and nobody answered
                )
            except BrokerError as exc:
                log.warning("fence_not_sent", participant=address, error=str(exc))
                continue
            if isinstance(reply, Error):
                log.warning("fence_refused", participant=address, code=reply.code.value, detail=reply.detail)
