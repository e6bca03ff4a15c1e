"""The completed-result ACK outbox: receipts are acknowledged in batches, one Ack per agent replica.

An agent keeps a finished rollout's receipt until it is acknowledged and sends it again until then;
acknowledging a receipt twice is harmless, so a batch that is lost costs a resend, never a result.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

import structlog
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.history import History
from parkway.actors.runtime.settings import cluster_wait_s
from parkway.brokers.base import BrokerError
from parkway.protocol.history import AcksSent
from parkway.protocol.ids import Role, actor_address
from parkway.protocol.messages import Ack, AttemptRef

log = structlog.get_logger("parkway.controller")

ACK_FLUSH_S = 0.01


class AckOutbox:
    def __init__(self, client: Client, counts: Counter[str], history: History) -> None:
        self._client, self._counts, self._history = client, counts, history
        self._pending: dict[int, list[AttemptRef]] = defaultdict(list)
        self._replica_of: dict[tuple[str, int], int] = {}  # each dispatched attempt's agent replica
        self._unknown: dict[int, list[AttemptRef]] = defaultdict(list)  # never dispatched: by sender
        # Told the receipts each Ack covered once it went out (``forget.Forgetting.acked``).
        self.on_acked: Callable[[Iterable[tuple[str, int]]], None] | None = None
        # One flush at a time: the run's last flush must not return while the timer's is still sending
        # (its receipts would reach ``on_acked`` after the run's last Forget, and never be forgotten).
        self._flushing = asyncio.Lock()

    def forget(self, keys: Iterable[tuple[str, int]]) -> None:
        """Attempts of rollouts that ended: a late receipt of one is acknowledged to the replica it
        names (like one never dispatched), so the routes held are those of the rollouts in play."""
        for key in keys:
            self._replica_of.pop(key, None)

    def sizes(self) -> dict[str, int]:
        """Entries of each structure (``structure_sizes``)."""
        return {
            "ack_routes": len(self._replica_of),
            "acks_pending": sum(len(v) for v in self._pending.values())
            + sum(len(v) for v in self._unknown.values()),
        }

    def routed(self, key: tuple[str, int]) -> bool:
        return key in self._replica_of

    def route(self, key: tuple[str, int], replica: int) -> None:
        """The agent replica attempt ``key`` was dispatched to: where its receipt's Ack goes."""
        self._replica_of[key] = replica

    def acknowledge(self, key: tuple[str, int], sender: int | None = None) -> None:
        """Acknowledge ``key`` to the replica it was dispatched to; one this controller never dispatched
        (another incarnation's, a forged Run's) to ``sender``, the replica its receipt names, so that
        agent stops resending it."""
        ref = AttemptRef(rollout_id=key[0], attempt=key[1])
        replica = self._replica_of.get(key)
        if replica is not None:
            self._pending[replica].append(ref)
        elif sender is not None:
            self._unknown[sender].append(ref)

    async def flush(self) -> None:
        """One Ack per agent replica for every receipt pending: batched, and a repeat is harmless.
        Returns once every Ack taken by a flush before it, or by this one, went out."""
        async with self._flushing:
            pending, self._pending = self._pending, defaultdict(list)
            for replica, refs in pending.items():
                await self._client.send(  # a repeated Ack is harmless
                    actor_address(Role.AGENT, replica),
                    Ack(receipts=tuple(refs)),
                    correlation_id=f"ack-{time.monotonic_ns()}",
                    retry_for_s=cluster_wait_s(),
                )
                self._counts["acks_sent"] += len(refs)
                self._counts["ack_batches"] += 1
                keys = tuple((a.rollout_id, a.attempt) for a in refs)
                self._history.record(AcksSent(replica=replica, refs=keys))
                if self.on_acked is not None:
                    self.on_acked(keys)
            await self._flush_unknown()

    async def _flush_unknown(self) -> None:
        """Acks of attempts never dispatched, to the replica each receipt named: best effort, one replica
        at a time, so a receipt naming a replica that does not exist holds up no other Ack."""
        unknown, self._unknown = self._unknown, defaultdict(list)
        for replica, refs in unknown.items():
            try:
                await self._client.send(
                    actor_address(Role.AGENT, replica),
                    Ack(receipts=tuple(refs)),
                    correlation_id=f"ack-unknown-{time.monotonic_ns()}",
                )
            except BrokerError as exc:  # that agent's resends are bounded: it gives the receipt up
                log.warning("ack_not_sent", replica=replica, error=str(exc))
                continue
            self._counts["acks_unknown_sent"] += len(refs)

    async def run(self) -> None:
        """Flush every ``ACK_FLUSH_S`` while there is something to send."""
        while True:
            await asyncio.sleep(ACK_FLUSH_S)
            if self._pending or self._unknown:
                try:
                    await self.flush()
                except BrokerError as exc:  # the agents send their receipts again; they are acked again
                    log.warning("ack_not_sent", error=str(exc))
