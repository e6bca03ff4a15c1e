"""Asking the participants of a snapshot or a restore: by stage, every member of a stage at once.

A stage is a role, or roles joined by "+" (``resources+tq``). ``ask`` sends one command to each member
of a stage concurrently and waits for every reply; the first refusal (in address order) then fails the
step as a ``SnapshotFailure`` that says whether a later attempt may succeed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import anyio
import structlog
from parkway.actors.roles.controller.fingerprints import replica_addresses
from parkway.actors.roles.controller.host import SnapshotHost
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.backoff import retrying
from parkway.actors.runtime.client import SentCall
from parkway.brokers.base import BrokerError, Lane, RequestTimeout
from parkway.protocol.errors import ErrorCode
from parkway.protocol.ids import PARTICIPANT_ROLES, Role, new_checkpoint_id, parse_address
from parkway.protocol.messages import Abort, Error, Message, Resume, Status, StatusReport
from parkway.protocol.phases import DEFAULT_LEASE_GRACE_S
from parkway.protocol.snapshot import SnapshotFailure, Stage

log = structlog.get_logger("parkway.snapshots")

RESUME_PAUSE_S = 0.2  # the first pause before a Resume is sent again; it grows with each try
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 4.0  # the pause before a request the broker refused is sent again
ABORT_WITHIN_S = 5.0  # how long an abort round waits for a participant (it runs with the gate open)
T = TypeVar("T")


async def settle_all(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T | Exception]:
    """Run every call at once and wait for all of them: each one's result, or the exception it raised
    (a failing call does not cancel the others; a cancellation of the caller cancels them all)."""
    if len(calls) == 1:  # (one call needs no task: a task is one more turn of the loop to start it)
        try:
            return [await calls[0]()]
        except Exception as exc:
            return [exc]
    results: dict[int, T | Exception] = {}

    async def settle(index: int, call: Callable[[], Awaitable[T]]) -> None:
        try:
            results[index] = await call()
        except Exception as exc:
            results[index] = exc

    async with anyio.create_task_group() as group:
        for index, call in enumerate(calls):
            group.start_soon(settle, index, call)
    return [results[index] for index in range(len(calls))]


@dataclass(frozen=True)
class Sent:
    """Commands of one step the broker has, each to its participant: ``Participants.collect`` waits."""

    step: str
    addresses: list[str]
    messages: list[Message]
    calls: list[SentCall]


class Participants:
    def __init__(self, host: SnapshotHost, config: RunConfig) -> None:
        self._host, self._config = host, config
        self.began = 0.0  # when the snapshot (or restore) in progress began: a process started since is new

    def replicas(self, role: Role) -> list[str]:
        """The addresses of one role's replicas."""
        return replica_addresses(self._config, role)

    def addresses(self, stage: Stage) -> list[str]:
        """A stage's participants: the replicas of each of its roles, asked at once."""
        return [address for role in stage for address in self.replicas(role)]

    def everyone(self) -> list[str]:
        return self.addresses(PARTICIPANT_ROLES)

    async def request(
        self, address: str, message: Message, *, lane: Lane | None = None, retry_for_s: float = 0.0
    ) -> Message:
        """``message`` to ``address``, on ``lane`` (None: its type's, the control lane for a command).
        With ``retry_for_s``, a broker that cannot take it (restarting) is waited out that long, the
        same message sent again (a command is answered once per id: a resend gets the same reply)."""

        def waiting(failure: BrokerError, pause: float) -> None:
            log.info("request_retried", participant=address, error=str(failure), retry_in_s=pause)

        try:
            return await retrying(
                lambda: self._host.client.request(address, message, lane=lane),
                retry_on=BrokerError,
                for_s=retry_for_s,
                first_s=RETRY_FIRST_S,
                max_s=RETRY_MAX_S,
                on_retry=waiting,
                final=lambda failure: isinstance(failure, RequestTimeout),
            )
        except BrokerError as exc:
            raise SnapshotFailure("request", f"{address}: {exc}", transient=True) from exc

    async def status(self, address: str, purpose: str, *, retry_for_s: float = 0.0) -> Message:
        """A Status of ``address``, asked for ``purpose`` (the prefix of its one-off id)."""
        return await self.request(
            address,
            Status(checkpoint_id=new_checkpoint_id(purpose), deadline=time.time() + 5 + retry_for_s),
            retry_for_s=retry_for_s,
        )

    async def ask(
        self,
        stage: Stage,
        make: Callable[[str], Message],
        step: str,
        *,
        lanes: Mapping[Role, Lane] | None = None,
        retry_for_s: float = 0.0,
    ) -> dict[str, Message]:
        """``make(address)`` to every member of ``stage`` at once; every reply, or a SnapshotFailure.
        ``lanes``: a role whose command goes on another lane than its type's own (the data lane, to be
        ordered behind the data already sent there). ``retry_for_s``: see ``request``."""
        addresses = self.addresses(stage)
        sent = [make(a) for a in addresses]
        lane_of = lanes or {}
        replies = await settle_all(
            [
                partial(
                    self.request, a, m, lane=lane_of.get(Role(parse_address(a)[0])), retry_for_s=retry_for_s
                )
                for a, m in zip(addresses, sent, strict=True)
            ]
        )
        return await self.checked(step, addresses, sent, replies)

    async def send(
        self, stage: Stage, make: Callable[[str], Message], step: str, *, lane: Lane | None = None
    ) -> Sent:
        """``make(address)`` to every member of ``stage`` at once, returning once the broker has them
        all: ``collect`` waits for the replies. (The window ends before they are back.)"""
        addresses = self.addresses(stage)
        messages = [make(a) for a in addresses]

        async def send_one(address: str, message: Message) -> SentCall:
            try:
                return await self._host.client.send_request(address, message, lane=lane)
            except BrokerError as exc:
                raise SnapshotFailure(step, f"{address}: {exc}", transient=True) from exc

        calls = await settle_all([partial(send_one, a, m) for a, m in zip(addresses, messages, strict=True)])
        for call in calls:
            if isinstance(call, Exception):
                raise call
        return Sent(step, addresses, messages, [c for c in calls if isinstance(c, SentCall)])

    async def collect(self, sent: Sent) -> dict[str, Message]:
        """The replies to what ``send`` sent: every one, or a SnapshotFailure as ``ask`` raises it."""

        async def reply_of(call: SentCall) -> Message:
            try:
                return await call.reply()
            except BrokerError as exc:
                raise SnapshotFailure(sent.step, f"{call.address}: {exc}", transient=True) from exc

        replies = await settle_all([partial(reply_of, call) for call in sent.calls])
        return await self.checked(sent.step, sent.addresses, sent.messages, replies)

    async def checked(
        self, step: str, addresses: list[str], sent: list[Message], replies: Sequence[Message | Exception]
    ) -> dict[str, Message]:
        """Every reply, or the first refusal (in address order) as a SnapshotFailure that says whether
        a later attempt may succeed."""
        answered: dict[str, Message] = {}
        for address, message, reply in zip(addresses, sent, replies, strict=True):
            if isinstance(reply, Exception):
                raise SnapshotFailure(step, f"{address}: {reply}", transient=True)
            if isinstance(reply, Error):
                detail, transient = f"{address}: {reply.code.value}: {reply.detail}", reply.retryable
                if reply.code is ErrorCode.STALE_CHECKPOINT:
                    # It ended this id on its own: its lease lapsed while this controller was slow (or
                    # stopped). A timeout, which the next snapshot retries.
                    detail, transient = f"{detail} (its lease lapsed)", True
                elif reply.code is ErrorCode.INVALID_PHASE and await self.restarted(address):
                    # Not a broken protocol: a new process that never saw this checkpoint (the one that
                    # did may even have journaled its reply). A later snapshot fixes it.
                    detail, transient = f"{detail} (it restarted during the snapshot)", True
                elif reply.code is ErrorCode.CHECKPOINT_CONFLICT:
                    # Held by an id whose end it never heard (a controller that died mid-snapshot, an
                    # Abort or Resume lost): only this run's controller starts ids, one after the last
                    # ended, so not an invariant broken. That id is aborted there (or ended there since,
                    # its lease lapsing), and the next snapshot goes in.
                    detail, transient = f"{detail} ({await self.release_held(address, message)})", True
                raise SnapshotFailure(step, detail, transient=transient)
            answered[address] = reply
        return answered

    async def release_held(self, address: str, refused: Message) -> str:
        """Abort the id ``address`` is held by, when it is not the one ``refused`` carried; what came of
        it, in words. Only this run's one controller starts ids, and it starts one only after the last
        ended (settled, aborted or resumed), so the id held is one whose end was lost."""
        own = getattr(refused, "checkpoint_id", None)
        try:
            report = await self.status(address, "held")
        except SnapshotFailure:
            return "not reached to end the id it is held by: its lease there ends it"
        if not isinstance(report, StatusReport):
            return "no status: its lease there ends the id it is held by"
        held = report.checkpoint_id
        if held in (None, own):
            # Its lease lapsed (or a late Resume or Abort arrived) between the refusal and this look.
            log.info("held_id_ended", participant=address, held=held)
            return "held by an id that has ended there since"
        abort = Abort(checkpoint_id=held, deadline=time.time() + ABORT_WITHIN_S, reason="its end was lost")
        try:
            reply = await self._host.client.request(address, abort)
        except BrokerError as exc:
            return f"not reached to abort {held}: {exc}"
        if isinstance(reply, Error):
            return f"abort of {held} refused: {reply.code.value}"
        log.warning("held_id_aborted", participant=address, held=held)
        return "held by an id that had ended: aborted there"

    async def restarted(self, address: str) -> bool:
        """Whether ``address`` is a process that started after this snapshot (or restore) began."""
        try:
            reply = await self.status(address, "alive")
        except SnapshotFailure:
            return False
        if not isinstance(reply, StatusReport):
            return False
        if reply.role == Role.AGENT:
            self._host.observe(address, reply)  # a new process: its lost rollouts start again
        return reply.started_at >= self.began

    async def resume_all(self, checkpoint_id: str, stages: tuple[Stage, ...], *, deadline: float) -> None:
        """Resume every participant under the same id, stage by stage (a stage's members at once). One
        that does not answer is ``published_release_pending`` and is asked again (same id, idempotent),
        backing off, until it answers or its lease for the id lapses there (``deadline`` and the grace
        after it: it has then ended the id itself). A broker restart is waited out: a Resume given up
        too early left the participant held, and the next snapshot refused there (``checkpoint_conflict``).
        A refusal that no resend changes (a participant restarted since: ``invalid_phase``) ends it."""
        held_until = deadline + DEFAULT_LEASE_GRACE_S
        for stage in stages:
            calls = [partial(self._resume_one, a, checkpoint_id, held_until) for a in self.addresses(stage)]
            for outcome in await settle_all(calls):
                if isinstance(outcome, Exception):
                    raise outcome

    async def _resume_one(self, address: str, checkpoint_id: str, held_until: float) -> None:
        attempt = 0
        while True:
            try:
                reply = await self._host.client.request(
                    address, Resume(checkpoint_id=checkpoint_id, deadline=time.time() + 5)
                )
                if not isinstance(reply, Error):
                    return
                if not reply.retryable:
                    log.warning(
                        "resume_refused", participant=address, code=reply.code.value, detail=reply.detail
                    )
                    return
            except BrokerError:
                pass
            attempt += 1
            self._host.counts["release_pending"] += 1
            if time.time() >= held_until:
                log.warning("resume_given_up", participant=address, attempts=attempt)
                return
            log.warning("published_release_pending", participant=address, attempt=attempt)
            await anyio.sleep(min(RESUME_PAUSE_S * attempt, RETRY_MAX_S, max(0.0, held_until - time.time())))

    async def abort_everywhere(
        self, checkpoint_id: str, reason: str, *, within_s: float = ABORT_WITHIN_S
    ) -> None:
        """Abort ``checkpoint_id`` on every participant at once (fencing it there), each answer logged
        (``abort_acknowledged``, or ``abort_unanswered``). Bounded: one that is not reached within
        ``within_s`` or refuses is not waited for further; its lease lapses (the prepare deadline
        has passed), and the id stays fenced where it ended."""
        abort = Abort(checkpoint_id=checkpoint_id, deadline=time.time() + within_s, reason=reason)
        addresses = self.everyone()
        replies = await settle_all([partial(self._host.client.request, a, abort) for a in addresses])
        for address, reply in zip(addresses, replies, strict=True):
            if isinstance(reply, Exception | Error):
                log.warning("abort_unanswered", participant=address, error=str(reply))
            else:
                log.info("abort_acknowledged", participant=address)
