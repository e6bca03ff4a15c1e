"""Telling the participants to forget rollouts that ended (docs/memory.md#controller-and-trainer).

A rollout's attempts become forgettable once its result is sealed in the ledger (or given up for good)
AND the Ack of the receipt that ended it was sent: the agent has then dropped the result, and nothing
of the rollout is needed again except what the ledger and TQ keep for the trainer. The refs are
batched (``FORGET_BATCH`` per message, flushed every ``FORGET_FLUSH_S``, at the end of a run, and as
soon as as many refs wait as the run has rollouts in flight: what a participant holds of ended rollouts
is then bounded by the in-flight cap, however fast rollouts end) and one ``Forget`` goes to every participant, each request retried a bounded number
of times. A participant that does not answer never holds the run up: its refs are kept (bounded by
``FORGET_BACKLOG``) and sent to it again with the next flush; past the bound they are dropped and
counted (``forget_dropped``): a participant bounds what it holds by itself too.

The controller's own per-rollout records end at the same point (``on_forget`` listeners: the ACK
outbox's routes, the dispatcher's clocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable

import structlog
from parkway.actors.runtime.client import Client
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import new_checkpoint_id
from parkway.protocol.ledger import AttemptState, Sibling
from parkway.protocol.messages import AttemptRef, Error, Forget

log = structlog.get_logger("parkway.controller")

FORGET_BATCH = 512  # refs per Forget message
FORGET_FLUSH_S = 1.0  # a batch that is not full goes out this often
FORGET_BACKLOG = 16384  # refs kept per participant that did not answer, to send again
FORGET_TRIES = 3  # requests per participant and flush (Forget is idempotent: a retry is harmless)
FORGET_REPLY_S = 5.0  # how long each request waits for its reply

Key = tuple[str, int]


def dispatched_refs(sibling: Sibling) -> tuple[AttemptRef, ...]:
    """Every attempt of a rollout but one still waiting for dispatch (it never ran anywhere)."""
    return tuple(
        AttemptRef(rollout_id=sibling.rollout_id, attempt=a.index)
        for a in sibling.attempts
        if a.state is not AttemptState.RESERVED
    )


class Forgetting:
    def __init__(self, client: Client, counts: Counter[str], addresses: Callable[[], list[str]]) -> None:
        self._client, self._counts, self._addresses = client, counts, addresses
        # The receipt whose Ack ends a rollout -> the refs to forget once that Ack is sent.
        self._after_ack: dict[Key, tuple[AttemptRef, ...]] = {}
        self._batch: list[AttemptRef] = []  # forgettable, not sent yet
        self._backlog: dict[str, list[AttemptRef]] = {}  # participant -> refs it did not take yet
        self.on_forget: list[Callable[[Iterable[Key]], None]] = []  # the controller's own records
        self._full = asyncio.Event()
        self._sending = asyncio.Lock()
        self.flush_at = FORGET_BATCH  # refs that flush at once; a run sets its in-flight cap

    def bound_by(self, in_flight: int) -> None:
        """Flush as soon as ``in_flight`` refs wait (at least 16, at most a full message)."""
        self.flush_at = max(16, min(FORGET_BATCH, in_flight))

    # -- what ended --------------------------------------------------------------------------------
    def ended(self, refs: tuple[AttemptRef, ...], *, ack_of: Key | None) -> None:
        """A rollout ended (``refs``: its dispatched attempts); forgettable once the Ack of receipt
        ``ack_of`` is sent (None: no receipt to acknowledge, a stalled attempt given up)."""
        if not refs:
            return
        if ack_of is None:
            self._forgettable(refs)
            return
        self._after_ack[ack_of] = self._after_ack.get(ack_of, ()) + refs

    def acked(self, keys: Iterable[Key]) -> None:
        """The outbox sent the Ack of these receipts."""
        for key in keys:
            refs = self._after_ack.pop(key, None)
            if refs is not None:
                self._forgettable(refs)

    def _forgettable(self, refs: tuple[AttemptRef, ...]) -> None:
        self._batch.extend(refs)
        keys = [(r.rollout_id, r.attempt) for r in refs]
        for listener in self.on_forget:
            listener(keys)
        if len(self._batch) >= self.flush_at:
            self._full.set()

    def sizes(self) -> dict[str, int]:
        """Entries of each structure (``structure_sizes``): all bounded by what ended in the last second
        or two, and a down participant's backlog by ``FORGET_BACKLOG``."""
        return {
            "forget_after_ack": len(self._after_ack),
            "forget_batch": len(self._batch),
            "forget_backlog": sum(len(v) for v in self._backlog.values()),
        }

    # -- sending -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Flush every ``FORGET_FLUSH_S``, or as soon as ``flush_at`` refs wait."""
        while True:
            self._full.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), FORGET_FLUSH_S)
            await self.flush()

    async def flush(self, *, tries: int = FORGET_TRIES) -> None:
        """Everything forgettable, to every participant, at most ``FORGET_BATCH`` refs a message; each
        participant on its own, so one that is down delays no other."""
        async with self._sending:
            batch, self._batch = self._batch, []
            addresses = self._addresses()
            if not batch and not any(self._backlog.get(a) for a in addresses):
                return
            await asyncio.gather(*(self._send_all(a, batch, tries) for a in addresses))

    async def _send_all(self, address: str, batch: list[AttemptRef], tries: int) -> None:
        refs = self._backlog.pop(address, []) + batch
        for start in range(0, len(refs), FORGET_BATCH):
            chunk = tuple(refs[start : start + FORGET_BATCH])
            if not await self._send(address, chunk, tries):
                self._keep(address, refs[start:])
                return

    async def _send(self, address: str, refs: tuple[AttemptRef, ...], tries: int) -> bool:
        checkpoint_id = new_checkpoint_id("forget")  # one id for every try: a retry is answered alike
        for _ in range(tries):
            command = Forget(
                checkpoint_id=checkpoint_id, deadline=time.time() + FORGET_REPLY_S, attempts=refs
            )
            try:
                reply = await self._client.request(address, command)
            except (BrokerError, ProtocolError) as exc:  # timed out, or the broker is away
                log.debug("forget_retried", participant=address, error=str(exc))
                continue
            if isinstance(reply, Error):
                if reply.retryable:
                    continue
                log.warning("forget_refused", participant=address, code=reply.code.value, detail=reply.detail)
                self._counts["forget_refused"] += 1
                return True  # it will not take them: sending them again changes nothing
            self._counts["forget_sent"] += len(refs)
            self._counts["forget_batches"] += 1
            return True
        self._counts["forget_failed"] += 1
        log.warning("forget_failed", participant=address, refs=len(refs))
        return False

    def _keep(self, address: str, refs: list[AttemptRef]) -> None:
        """Refs a participant did not take, for the next flush; past ``FORGET_BACKLOG`` the oldest go."""
        over = len(refs) - FORGET_BACKLOG
        if over > 0:
            self._counts["forget_dropped"] += over
            refs = refs[over:]
        self._backlog[address] = refs
