"""Receipts from the agents: ``Completed`` seals an attempt (its canonical rows first), ``Failed`` redoes
it by its group's granularity. Every receipt is acknowledged, stale and duplicate ones included, and
so is one of an attempt this controller never dispatched (counted ``receipts_unknown``): its Ack goes
to the replica the receipt names, so the agent stops resending it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable

import structlog
from parkway.actors.roles.controller.forget import Forgetting, dispatched_refs
from parkway.actors.roles.controller.outbox import AckOutbox
from parkway.actors.roles.controller.retire import Retirement
from parkway.actors.roles.controller.state import RunState
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.history import History
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import Receipt, RolloutSealed
from parkway.protocol.ledger import AttemptState, SealOutcome
from parkway.protocol.messages import AttemptRef, Completed, Error, Failed, SealRows
from parkway.protocol.placement import tq_address

FAILED_PREFIX = "failed:"  # ``failed:<code>``: attempts failed with that code (the run's, kept in the anchor)

log = structlog.get_logger("parkway.controller")


class Receipts:
    def __init__(
        self,
        *,
        client: Client,
        state: RunState,
        counts: Counter[str],
        history: History,
        outbox: AckOutbox,
        retirement: Retirement,
        wake: Callable[[], None],
        forgetting: Forgetting | None = None,
    ) -> None:
        self._client, self._state, self._counts, self._history = client, state, counts, history
        self._outbox, self._retirement, self._wake = outbox, retirement, wake
        self._forgetting = forgetting
        self.seals = 0  # seals this incarnation made: the history marks how many a snapshot captured
        self.tq_shards = 1  # the run's (``topology.tq_shards``): a seal goes to its rollout's shard
        self.agents = 1  # the run's agent replicas (``topology.agents``): where an Ack can go
        # Receipts that came with an agent's cut (``with_cut``): taken as arrived, their seals not yet
        # started; and those whose seals are under way (their copy on the wire waits for the seal).
        self._with_cut: dict[tuple[str, int], asyncio.Task[None]] = {}

    def _acknowledge(self, receipt: Completed | Failed) -> None:
        key = (receipt.rollout_id, receipt.attempt)
        if not self._outbox.routed(key):
            # Not routed: dispatched by an earlier incarnation or another run, or a late resend of a
            # rollout already forgotten (its Ack crossed the resend). All are acknowledged to the
            # replica named and counted; none is a fault of this run, so no warning.
            self._counts["receipts_unknown"] += 1
            log.debug(
                "receipt_of_unknown_attempt",
                rollout_id=receipt.rollout_id,
                attempt=receipt.attempt,
                replica=receipt.replica,
            )
        self._outbox.acknowledge(key, receipt.replica)
        self._wake()

    def with_cut(self, replica: int, receipts: Iterable[Completed]) -> None:
        """Receipts agent ``replica``'s Prepared carried (sent, not yet acknowledged): each of an attempt
        still dispatched to that agent is taken as arrived, now: ``sealing`` in the ledger, so a
        snapshot's drain does not wait for its copy on the wire. Its seal starts now (the cut comes back
        after the window); a copy that comes while the seal is under way waits for it, and is then a
        duplicate. Any other (already arrived, given up on, of
        another replica) changes nothing: its copy on the wire is handled as ever."""
        ledger = self._state.ledger
        for receipt in receipts:
            if not ledger.knows(receipt.rollout_id):
                continue
            sibling = ledger.sibling(receipt.rollout_id)
            target = sibling.attempts[receipt.attempt] if receipt.attempt < len(sibling.attempts) else None
            if (
                target is None
                or target is not sibling.current
                or target.replica != replica
                or target.state is not AttemptState.DISPATCHED
            ):
                continue
            self._receive(receipt)
            self._counts["receipts_with_cut"] += 1
            task = asyncio.get_running_loop().create_task(self._seal_with_cut(receipt))
            self._with_cut[(receipt.rollout_id, receipt.attempt)] = task

    def _receive(self, receipt: Completed) -> None:
        """The attempt ``sealing`` in the ledger, with what its seal needs (its agent is done with it)."""
        self._state.ledger.receive(
            receipt.rollout_id,
            receipt.attempt,
            reward=receipt.reward,
            turns=receipt.turns,
            staging_keys=receipt.staging_keys,
        )

    async def stop(self) -> None:
        """Cancel the seals begun for receipts that came with a cut (each attempt stays ``sealing``: a
        restore seals it again)."""
        tasks = list(self._with_cut.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _seal_with_cut(self, receipt: Completed) -> None:
        try:
            await self.completed(receipt)
        except Exception as exc:  # its copy on the wire seals it (the attempt is sealing meanwhile)
            log.warning(
                "seal_with_cut_failed", rollout_id=receipt.rollout_id, attempt=receipt.attempt, error=str(exc)
            )
        finally:
            self._with_cut.pop((receipt.rollout_id, receipt.attempt), None)

    async def completed(self, receipt: Completed) -> None:
        key = (receipt.rollout_id, receipt.attempt)
        # A copy of a receipt taken with a cut whose seal is under way waits for it, and is then a
        # duplicate (or, had that seal failed, seals it).
        sealing = self._with_cut.get(key)
        if sealing is not None and asyncio.current_task() is not sealing:
            await asyncio.shield(sealing)
        ledger = self._state.ledger
        if not ledger.knows(receipt.rollout_id):
            self._counts["receipts_stale"] += (
                1  # its group was finalized already: acknowledge, change nothing
            )
        elif receipt.attempt >= len(ledger.sibling(receipt.rollout_id).attempts):
            # An attempt this controller never reserved (another run's agent, a forged receipt): ignored.
            self._counts["receipts_stale"] += 1
            log.warning("receipt_unknown_attempt", rollout_id=receipt.rollout_id, attempt=receipt.attempt)
        else:
            await self.seal(receipt)
        self._acknowledge(receipt)

    async def seal(self, receipt: Completed, *, acknowledged: bool = True) -> bool:
        """Seal one attempt: SEALING in the ledger as the receipt arrives (its agent is done with it: a
        snapshot from now on saves the receipt in the ledger, neither waiting for the seal nor
        restarting it), then its canonical row in TQ, then SEALED. False when TQ refused it (fenced
        there): the attempt failed. A receipt of an attempt no longer running only counts. Not
        ``acknowledged``: no Ack will go out for it (its agent is gone), so nothing waits for one."""
        ledger = self._state.ledger
        sibling = ledger.sibling(receipt.rollout_id)
        target = sibling.attempts[receipt.attempt]
        if target is sibling.current and target.state in (AttemptState.DISPATCHED, AttemptState.SEALING):
            if target.state is AttemptState.DISPATCHED:
                self._receive(receipt)
                self._wake()  # a snapshot's drain waits for receipts to arrive, not for their seals
            # Canonical rows first: a group the ledger settles must be readable by the trainer.
            if not await self._seal_rows(receipt):
                await self._seal_refused(receipt)
                return False
        outcome = ledger.seal(receipt.rollout_id, receipt.attempt, reward=receipt.reward, turns=receipt.turns)
        self._history.record(
            Receipt(
                rollout_id=receipt.rollout_id,
                attempt=receipt.attempt,
                of="completed",
                outcome=outcome.value,
            )
        )
        if outcome is SealOutcome.SEALED:
            if self._forgetting is not None:  # its Ack is queued below: forgotten once it is sent
                key = (receipt.rollout_id, receipt.attempt)
                self._forgetting.ended(dispatched_refs(sibling), ack_of=key if acknowledged else None)
            self._counts["rollouts_sealed"] += 1
            self._counts["turns_kept"] += receipt.turns
            self.seals += 1
            self._history.record(
                RolloutSealed(
                    rollout_id=receipt.rollout_id,
                    attempt=receipt.attempt,
                    capture_key=receipt.capture_key,
                    reward=receipt.reward,
                    seq=self.seals,
                )
            )
            log.info(
                "sealed",
                rollout_id=receipt.rollout_id,
                attempt=receipt.attempt,
                reward=receipt.reward,
                turns=receipt.turns,
            )
        elif outcome is SealOutcome.DUPLICATE:
            self._counts["receipts_duplicate"] += 1
        else:
            self._counts["receipts_stale"] += 1
        return True

    async def finish_restored(self) -> int:
        """After a restore: every attempt the ledger saved SEALING (its receipt had arrived, its seal
        had not come back) is sealed as its receipt would have been, TQ first (a seal is idempotent per
        capture key: TQ's cut may hold the canonical row already), and acknowledged to its agent. One
        whose seal fails is failed (redone by its granularity), never left SEALING."""
        pending = self._state.ledger.sealing()
        receipts = [
            Completed(
                rollout_id=sibling.rollout_id,
                attempt=attempt.index,
                capture_key=attempt.capture_key,
                reward=attempt.reward or 0.0,
                turns=attempt.turns,
                staging_keys=attempt.staging_keys,
                # Acknowledged to its agent, which may hold the receipt still; onto fewer agents,
                # to none (the replica that ran it is gone).
                replica=attempt.replica if (attempt.replica or 0) < self.agents else None,
                epoch=self._state.epoch,
            )
            for sibling, attempt in pending
        ]
        for receipt in receipts:
            if receipt.replica is not None:
                self._outbox.route((receipt.rollout_id, receipt.attempt), receipt.replica)
        results = await asyncio.gather(*(self._finish(r) for r in receipts), return_exceptions=True)
        for receipt, result in zip(receipts, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "restored_seal_failed",
                    rollout_id=receipt.rollout_id,
                    attempt=receipt.attempt,
                    error=str(result),
                )
                await self.fail(
                    Failed(rollout_id=receipt.rollout_id, attempt=receipt.attempt, code="seal_failed")
                )
        self._counts["seals_finished_at_restore"] += len(receipts)
        return len(receipts)

    async def _finish(self, receipt: Completed) -> None:
        acknowledged = receipt.replica is not None
        if await self.seal(receipt, acknowledged=acknowledged) and acknowledged:
            self._acknowledge(receipt)

    async def failed(self, receipt: Failed) -> None:
        await self.fail(receipt, acknowledged=True)
        self._acknowledge(receipt)

    async def fail(self, receipt: Failed, *, acknowledged: bool = False) -> None:
        """A failed attempt, reported by its agent (``acknowledged``: its receipt is acked next) or
        found stalled: redone by its group's granularity."""
        ledger = self._state.ledger
        if not ledger.knows(receipt.rollout_id):
            self._counts["receipts_stale"] += 1
            self._history.record(
                Receipt(rollout_id=receipt.rollout_id, attempt=receipt.attempt, of="failed", outcome="stale")
            )
            return
        plan = ledger.fail(receipt.rollout_id, receipt.attempt, code=receipt.code, turns=receipt.turns)
        self._history.record(
            Receipt(
                rollout_id=receipt.rollout_id,
                attempt=receipt.attempt,
                of="failed",
                outcome="stale" if plan.stale else "failed",
                code=receipt.code,
                redo=tuple(plan.redo),
                given_up=tuple(plan.given_up),
            )
        )
        if plan.stale:
            self._counts["receipts_stale"] += 1
            return
        self._counts["attempts_failed"] += 1
        self._counts[f"{FAILED_PREFIX}{receipt.code}"] += 1  # by code, for the summary
        self._counts["rollouts_redone"] += len(plan.redo)
        self._counts["rollouts_failed"] += len(plan.given_up)
        log.warning(
            "attempt_failed",
            rollout_id=receipt.rollout_id,
            attempt=receipt.attempt,
            code=receipt.code,
            redo=len(plan.redo),
            given_up=len(plan.given_up),
        )
        if acknowledged and receipt.rollout_id in plan.redo:
            # Its agent ended it, but copies of its calls may still be on the wire (requeued by a broker
            # restart, resent by a client): fenced before attempt N+1 is dispatched. (A stalled attempt
            # was retired, and so fenced, by the watchdog.)
            self._retirement.unfenced.append(
                AttemptRef(rollout_id=receipt.rollout_id, attempt=receipt.attempt)
            )
        self._counts["attempts_abandoned"] += len(plan.retire)
        await self._retirement.retire(plan.retire)
        if self._forgetting is not None:  # rollouts given up for good end here, like sealed ones
            ack_of = (receipt.rollout_id, receipt.attempt) if acknowledged else None
            for rollout in plan.given_up:
                self._forgetting.ended(dispatched_refs(ledger.sibling(rollout)), ack_of=ack_of)
        self._wake()

    async def _seal_refused(self, receipt: Completed) -> None:
        """TQ refused the seal: the attempt is fenced there (this controller gave up on it while its
        rows were being sealed: the watchdog, after a seal that never came back). Failed, if it was
        not already: its next attempt seals."""
        self._counts["receipts_stale"] += 1
        self._history.record(
            Receipt(rollout_id=receipt.rollout_id, attempt=receipt.attempt, of="completed", outcome="fenced")
        )
        log.warning("seal_refused_fenced", rollout_id=receipt.rollout_id, attempt=receipt.attempt)
        await self.fail(
            Failed(
                rollout_id=receipt.rollout_id,
                attempt=receipt.attempt,
                code="seal_refused",
                turns=receipt.turns,
                replica=receipt.replica,
            )
        )

    async def _seal_rows(self, receipt: Completed) -> bool:
        """The attempt's canonical row in TQ; False when TQ has it fenced (nothing sealed)."""
        request = SealRows(
            rollout_id=receipt.rollout_id,
            attempt=receipt.attempt,
            capture_key=receipt.capture_key,
            reward=receipt.reward,
            staging_keys=receipt.staging_keys,
        )
        for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0):  # staging rows may still be on their way to TQ
            await asyncio.sleep(delay)
            reply = await self._client.request(
                tq_address(receipt.rollout_id, self.tq_shards),  # the shard of its rows
                request,
                correlation_id=f"seal:{receipt.capture_key}",
                deadline=time.time() + 30,
            )
            if not isinstance(reply, Error):
                return True
            if reply.code is ErrorCode.STALE_ATTEMPT:
                return False
            if not reply.retryable:
                raise ProtocolError(reply.code, reply.detail)
        raise RuntimeError(f"TQ has no staging rows for {receipt.capture_key} after retries")
