"""Agent replicas (``agent/N``): run the multi-turn loop of each rollout they are given.

A ``Run`` starts one attempt as a task (the delivery is acked at once: a rollout can take hours, far
longer than a broker should hold a message). The attempt (``attempt.py``) runs an ``AgentProgram``
(a plugin, ``sdk/plugins.py``) through a ``RolloutContext``; its end is a receipt for the controller, ``Completed`` or ``Failed``,
kept and re-sent until the controller acknowledges it (``Ack``, idempotent), the pause doubling up to a
cap, and given up after a bound (``ReceiptResend``: counted, logged). ``Retire`` stops
attempts the controller gave up on and releases their tool sessions. ``Forget`` (the rollout is sealed
and its receipt acknowledged) drops what is left of its attempts; a late ``Run`` of one is refused.
What each structure holds and its bound: docs/memory.md.

Checkpoints. A rollout is parked when it waits at a boundary (before a model call, after a tool round)
or waits for a model reply issued right after one. Prepare holds every rollout at its next boundary
and takes the cut once each is parked, or mid-round where its environment keeps round copies (its
tool calls in flight are not waited for: ``attempt.py``); it first waits for every ``Run`` the Prepare
names, which may be queued on the data lane behind it. The cut is each rollout's transcript up to its
last boundary (``protocol/transcript.py``), kept in memory and written at Persist; Restore loads them,
and the controller's ``Run`` for attempt N+1 continues each from there by replaying the saved calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
from parkway.actors.roles.attempt import DONE, Attempt, CutEntry, received
from parkway.actors.runtime.forgetting import AttemptKey
from parkway.actors.runtime.packs import read_records, struct_parts
from parkway.actors.runtime.participant import Cut, ParkReport, Participant
from parkway.actors.runtime.settings import ReceiptResend
from parkway.actors.sdk.environments import Environment
from parkway.actors.sdk.plugins import find_agent, find_environment
from parkway.actors.sdk.rollout import AgentProgram
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import (
    ContinuationRestored,
    Receipt,
    ReceiptAcked,
    SnapshotInstalled,
)
from parkway.protocol.ids import Role, capture_key
from parkway.protocol.layout import AGENT_ROLLOUTS
from parkway.protocol.messages import (
    Ack,
    AttemptRef,
    Commit,
    Completed,
    EpisodeRef,
    Failed,
    FileDigest,
    Message,
    Ok,
    Prepare,
    Restore,
    Retire,
    Run,
)
from parkway.protocol.transcript import SavedRollout

log = structlog.get_logger("parkway.agent")

# Receipts a Prepared carries at most (a controller long gone leaves many unacknowledged): any other
# is waited for on the wire, as before.
RECEIPTS_WITH_CUT = 256


def receipts_with_cut(
    unacked: Mapping[AttemptKey, tuple[Completed | Failed, float]],
) -> tuple[Completed, ...]:
    """The completed attempts' receipts not yet acknowledged (the newest, at most
    ``RECEIPTS_WITH_CUT``): every attempt an agent ran is in its cut or has its receipt in ``unacked``
    (an attempt leaves ``live`` and its receipt enters ``unacked`` in one step), so the controller need
    not wait for the copies still on the wire before it copies its ledger. (A ``Failed`` is waited for:
    it redoes a group.)"""
    completed = [receipt for receipt, _ in unacked.values() if isinstance(receipt, Completed)]
    return tuple(completed[-RECEIPTS_WITH_CUT:])


class Agent(Participant):
    role = Role.AGENT
    takes_over_replicas = True  # rollouts are saved one by one: any agent can continue one
    prefetch = 256

    def __init__(
        self,
        *args: Any,
        policy_address: str = "policy/0",
        controller_address: str = "controller/0",
        resend: ReceiptResend | None = None,
        programs: Mapping[str, type[AgentProgram]] | None = None,
        environments: Mapping[str, type[Environment]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # The run's plugins by name (its configuration); None: look the name up among installed ones.
        self.programs = dict(programs) if programs is not None else None
        self.environments = dict(environments) if environments is not None else None
        self.policy_address = policy_address
        self.controller_address = controller_address
        self.resend = resend if resend is not None else ReceiptResend.from_env()
        self.running: dict[AttemptKey, asyncio.Task[None]] = {}
        self.live: dict[AttemptKey, Attempt] = {}
        # rollout id -> its newest attempt here, so a redelivered Run of an older one never starts;
        # until Forget, and bounded by the fence size beyond the attempts running (oldest first).
        self.latest_attempt: OrderedDict[str, int] = OrderedDict()
        # Each receipt not acknowledged yet, and when (monotonic) it is sent again.
        self.unacked: dict[AttemptKey, tuple[Completed | Failed, float]] = {}
        self.resends: dict[AttemptKey, int] = {}  # how often each unacknowledged receipt was sent again
        self.continuations: dict[str, SavedRollout] = {}  # restored, waiting for their Run
        self.epoch = 0  # the newest controller incarnation seen (Run or Restore); see Participant
        self.released = asyncio.Event()  # set while no checkpoint is open here
        self.released.set()
        # Set once the open checkpoint's cut is taken (and while none is open): from then on only the
        # rollouts the cut holds whose environment keeps no round copies wait for the release.
        self.cut_taken = asyncio.Event()
        self.cut_taken.set()
        self._park_changed = asyncio.Event()
        self._unready: set[AttemptKey] = set()  # live attempts a cut cannot be taken of right now
        self._cut: dict[AttemptKey, CutEntry] | None = None  # taken where they parked, at Prepare
        self._cut_at_ns = 0  # when (the rollouts' ``parked by`` spans are made at Commit, after the window)
        self._held_by_cut: set[AttemptKey] = set()  # what that cut holds as running: receipts wait
        self._resender: asyncio.Task[None] | None = None
        self.handlers.update({Run: self.on_run, Ack: self.on_ack})
        self.metrics.gauge(
            "parkway_rollouts_in_flight", "Rollout attempts running on this agent", lambda: len(self.running)
        )
        self._given_up_metric = self.metrics.counter(
            "parkway_receipts_given_up", "Receipts dropped unacknowledged after the last resend"
        )

    async def start(self) -> None:
        await super().start()
        self._resender = asyncio.get_running_loop().create_task(self._resend_unacked())
        if self.environments is not None:
            waited = sorted(n for n, cls in self.environments.items() if not cls.keeps_round_copy())
            if waited:  # named at set-up: a snapshot waits for their tool rounds (docs/environments.md)
                with structlog.contextvars.bound_contextvars(**self.log_context()):
                    log.info("snapshots_wait_for_tool_calls", environments=waited)

    async def stop(self) -> None:
        if self._resender is not None:
            self._resender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resender
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        await super().stop()

    def status_extras(self) -> dict[str, Any]:
        extras = super().status_extras()
        extras["in_flight"] = len(self.running)
        return extras

    # -- plugins -------------------------------------------------------------------------------
    def program(self, name: str) -> type[AgentProgram] | None:
        return self.programs.get(name) if self.programs is not None else find_agent(name)

    def environment(self, name: str) -> type[Environment] | None:
        return self.environments.get(name) if self.environments is not None else find_environment(name)

    # -- handlers ------------------------------------------------------------------------------
    async def on_run(self, run: Run) -> None:
        key = (run.rollout_id, run.attempt)
        if key in self.forgotten:  # a late duplicate of a rollout sealed and forgotten: never again
            self.counts["runs_forgotten"] += 1
            self.history.record(received(run, "stale"))
            return
        if run.epoch < self.epoch or key in self.retired:
            self.counts["runs_stale"] += 1  # from an older controller incarnation, or a replaced attempt
            self.history.record(received(run, "stale"))
            return
        self.epoch = run.epoch
        if (
            key in self.running
            or key in self.unacked
            or self.latest_attempt.get(run.rollout_id, -1) > run.attempt
        ):
            self.counts["runs_duplicate"] += 1  # redelivered: the attempt exists or was replaced
            self.history.record(received(run, "duplicate"))
            return
        self._remember_latest(run.rollout_id, run.attempt)
        self.history.record(received(run, "accepted", run.task.continue_from))
        continuing = run.task.continue_from is not None
        replay = self.continuations.pop(run.rollout_id, None) if continuing else None
        attempt = Attempt(self, run, replay)
        self.live[key] = attempt
        self.state_changed(attempt)
        task = asyncio.get_running_loop().create_task(self._run_attempt(attempt))
        self.running[key] = task

        def finished(_: asyncio.Task[None]) -> None:
            self.running.pop(key, None)
            self.live.pop(key, None)
            self._unready.discard(key)
            self._park_changed.set()

        task.add_done_callback(finished)

    def _remember_latest(self, rollout_id: str, attempt: int) -> None:
        self.latest_attempt[rollout_id] = attempt
        self.latest_attempt.move_to_end(rollout_id)
        # Rollouts the controller never forgets (it is down, its Forget was lost) are bounded: the
        # oldest records go first; a rollout still running is never among them (it is the newest).
        bound = self.forgotten.capacity + len(self.running) + 1
        while len(self.latest_attempt) > bound:
            self.latest_attempt.popitem(last=False)

    def forget_attempts(self, keys: list[AttemptKey]) -> None:
        """Sealed and acknowledged (or given up on): its records go; the fence refuses a late Run."""
        for rollout_id, attempt in keys:
            key = (rollout_id, attempt)
            self.unacked.pop(key, None)
            self.resends.pop(key, None)
            if self.latest_attempt.get(rollout_id, attempt + 1) <= attempt:
                del self.latest_attempt[rollout_id]
            saved = self.continuations.get(rollout_id)
            if saved is not None and saved.run.attempt <= attempt:
                del self.continuations[rollout_id]

    def structure_sizes(self) -> dict[str, int]:
        return {
            **super().structure_sizes(),
            "attempts_running": len(self.running),
            "latest_attempt": len(self.latest_attempt),
            "unacked": len(self.unacked),
            "resends": len(self.resends),
            "continuations": len(self.continuations),
        }

    async def on_ack(self, ack: Ack) -> None:
        for ref in ack.receipts:
            self.resends.pop((ref.rollout_id, ref.attempt), None)
            if self.unacked.pop((ref.rollout_id, ref.attempt), None) is not None:
                self.counts["receipts_acked"] += 1
                self.history.record(ReceiptAcked(rollout_id=ref.rollout_id, attempt=ref.attempt))

    async def on_retire(self, command: Retire) -> Message:
        stopped = 0
        for ref in command.attempts:
            task = self.running.get((ref.rollout_id, ref.attempt))
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                stopped += 1
        await super().on_retire(command)  # records the fence
        return Ok(detail=f"stopped {stopped} of {len(command.attempts)}")

    # -- checkpoint hooks ------------------------------------------------------------------------
    def state_changed(self, attempt: Attempt) -> None:
        """Kept up to date at every move, so a Prepare waiting for the rollouts reads one set, not
        every rollout on every move (which was quadratic in the rollouts in flight)."""
        key = (attempt.run.rollout_id, attempt.run.attempt)
        if self.live.get(key) is not attempt:
            return
        if attempt.cut_ready:
            self._unready.discard(key)
        else:
            self._unready.add(key)
        self._park_changed.set()

    async def close_admission(self) -> None:
        self.released.clear()
        self.cut_taken.clear()

    def held(self, attempt: Attempt) -> bool:
        """Until the cut is taken every rollout is held at its boundaries (so that it reaches one); after
        it, a rollout the cut holds whose tool server keeps no round copies stays held until the
        checkpoint ends (its session is cut at that boundary after this agent's cut), and every other
        runs on: the cut is a copy."""
        if self.released.is_set():
            return False
        if not self.cut_taken.is_set():
            return True
        key = (attempt.run.rollout_id, attempt.run.attempt)
        return key in self._held_by_cut and not attempt.keeps_round_copy

    async def hold(self, attempt: Attempt) -> None:
        if not self.cut_taken.is_set():
            await self.cut_taken.wait()  # (the release sets it too)
        if self.held(attempt):
            await self.released.wait()

    def parked_now(self, command: Prepare) -> ParkReport | None:
        """The cut at once when every Run the Prepare names has arrived and every rollout can be cut:
        the usual case, answered without a turn of this busy loop."""
        self._last_cut.check(command.base)  # a scope made against a cut this process did not answer
        if self._unready or self._unseen(command):
            return None
        return self._report(self._take_cut(command.checkpoint_id), waited_s=0.0)

    async def wait_until_parked(self, command: Prepare) -> ParkReport:
        """Event driven: until every Run the Prepare names has arrived and every rollout can be cut
        (parked, or mid-round where its environment keeps round copies); then the cut, in memory."""
        started, waited = time.monotonic(), False
        missing = self._unseen(command)
        while missing or self._unready:
            waited = True
            self._park_changed.clear()  # (no await since the check: no change is missed)
            await self._park_changed.wait()
            missing = {key for key in missing if not self._has_seen(key)}
        cut = self._take_cut(command.checkpoint_id)
        return self._report(cut, waited_s=time.monotonic() - started if waited else 0.0)

    def _report(self, cut: Cut, *, waited_s: float) -> ParkReport:
        return ParkReport(
            parked=len(cut.episodes),
            boundaries_passed=self.counts["boundaries"],
            waited_s=waited_s,
            episodes=cut.episodes,
            receipts=receipts_with_cut(self.unacked),
        )

    def _unseen(self, command: Prepare) -> set[AttemptKey]:
        """The attempts the Prepare names for this agent whose Runs have not arrived."""
        keys = ((e.rollout_id, e.attempt) for e in command.episodes if e.replica == self.replica)
        return {key for key in keys if not self._has_seen(key)}

    def _has_seen(self, key: AttemptKey) -> bool:
        """Whether this agent received that attempt's Run (or knows it ended)."""
        rollout_id, attempt = key
        return (
            self.latest_attempt.get(rollout_id, -1) >= attempt or key in self.forgotten or key in self.retired
        )

    def _take_cut(self, checkpoint_id: str) -> Cut:
        """Each rollout's transcript up to its last boundary: immutable values, so the cut is a list of
        references now and the encoding waits for Persist (a rollout's saved transcript is the same
        object from one cut to the next until it passes a boundary, and so is its episode ref)."""
        saved = {key: live.cut_entry for key, live in self.live.items()}
        self._cut, self._cut_at_ns = saved, time.time_ns()
        self._held_by_cut = set(saved)
        self.cut_taken.set()  # the rollouts whose environment allows it go on at once
        self.counts["cuts_taken"] += 1
        return self._cut_of(saved)

    def _cut_of(self, saved: dict[AttemptKey, CutEntry]) -> Cut:
        def write(directory: Path) -> tuple[FileDigest, ...]:
            ordered = [saved[key].saved for key in sorted(saved)]
            # Each step its own piece: a transcript that grew writes its new steps, not its history.
            parts = [struct_parts(rollout, split=("model", "tools")) for rollout in ordered]
            return self.records.packed(directory / AGENT_ROLLOUTS, parts)

        return Cut(write=write, episodes=tuple(entry.ref for entry in saved.values()))

    def take_cut(self, command: Commit) -> Cut:
        """The cut taken at Prepare, less what the Commit leaves out of it (attempts the controller gave
        up on since: it names exactly the ones it keeps)."""
        if self._cut is None:
            raise ProtocolError(
                ErrorCode.INVALID_PHASE, f"commit of {command.checkpoint_id}: no cut was taken"
            )
        kept = {(e.rollout_id, e.attempt) for e in command.episodes}
        saved = {key: cut for key, cut in self._cut.items() if key in kept}
        self._cut = None
        for entry in saved.values():  # linked to this snapshot's trace (docs/tracing.md)
            entry.trace.parked(command.checkpoint_id, at_ns=self._cut_at_ns)
        return self._cut_of(saved)

    async def release(self) -> None:
        self._cut = None
        self._held_by_cut.clear()
        self.cut_taken.set()
        self.released.set()

    def saved_episodes(self) -> tuple[EpisodeRef, ...]:
        return tuple(EpisodeRef(rollout_id=r, attempt=a, replica=self.replica) for r, a in sorted(self.live))

    async def install_snapshot(self, directory: Path, command: Restore) -> tuple[AttemptRef, ...]:
        # Read first: a snapshot that cannot be read changes nothing here. The rollouts may come from
        # other agents' directories (a restore onto another number of agents: ``sources``).
        saved = [
            item
            for source in self.source_dirs(directory, command)
            for item in read_records(source / AGENT_ROLLOUTS, SavedRollout)
        ]
        # A restored agent runs nothing from before: work it picked up from the dead cluster's queues
        # is stopped, and anything older than this controller incarnation is refused from now on.
        self.epoch = max(self.epoch, command.epoch)
        zombies = list(self.running.values())
        for task in zombies:
            task.cancel()
        await asyncio.gather(*zombies, return_exceptions=True)
        self.unacked.clear()
        self.resends.clear()
        # The dead timeline's records go: the restored ledger gives attempt numbers out again.
        self.latest_attempt.clear()
        self.continuations.clear()
        self.counts["runs_stopped_at_restore"] += len(zombies)
        continuing = {e.rollout_id: e.attempt for e in command.episodes if e.replica == self.replica}
        restored = []
        for item in saved:
            attempt = continuing.get(item.run.rollout_id)
            if attempt is None:
                continue
            self.continuations[item.run.rollout_id] = item
            self._remember_latest(item.run.rollout_id, attempt)  # attempt N+1 may start; N is fenced
            restored.append(AttemptRef(rollout_id=item.run.rollout_id, attempt=attempt))
            self.history.record(
                ContinuationRestored(
                    rollout_id=item.run.rollout_id,
                    attempt=attempt,
                    saved_attempt=item.run.attempt,
                    kept_model=len(item.model),
                    kept_tools=len(item.tools),
                )
            )
        self.history.record(
            SnapshotInstalled(epoch=command.epoch, stopped=len(zombies), continuing=len(restored))
        )
        return tuple(restored)

    # -- one attempt ---------------------------------------------------------------------------
    async def _run_attempt(self, attempt: Attempt) -> None:
        """An attempt to its end; its receipt is kept and sent until the controller acknowledges it."""
        run = attempt.run
        with structlog.contextvars.bound_contextvars(rollout_id=run.rollout_id, attempt=run.attempt):
            receipt = await attempt.run_to_receipt()
            key = (run.rollout_id, run.attempt)
            if key in self._held_by_cut and not self.released.is_set():
                # The cut holds it as running, at its last boundary: its receipt would seal it after
                # the ledger was captured. It goes when the checkpoint ends (resumed or aborted).
                attempt.state = DONE
                self.counts["receipts_held_for_cut"] += 1
                await self.released.wait()
            # Ended: no cut may hold it from here on, its receipt seals it (a cut taken while the receipt
            # is on its way would save it as running, and the ledger would have it sealed).
            self.live.pop(key, None)
            self._unready.discard(key)
            self._park_changed.set()
            self.unacked[key] = (receipt, time.monotonic() + self.resend.pause(0))
            self.resends[key] = 0
            self.history.record(
                Receipt(
                    rollout_id=run.rollout_id,
                    attempt=run.attempt,
                    of="completed" if isinstance(receipt, Completed) else "failed",
                    code=receipt.code if isinstance(receipt, Failed) else None,
                    turns=receipt.turns,
                )
            )
            await self._send_receipt(receipt)

    async def _send_receipt(self, receipt: Completed | Failed) -> None:
        ck = capture_key(receipt.rollout_id, receipt.attempt)
        try:
            await self.client.send(self.controller_address, receipt, correlation_id=ck)
        except Exception as exc:  # kept in unacked: the resender tries again
            log.warning("receipt_not_sent", error=str(exc))

    async def _resend_unacked(self) -> None:
        """Each receipt again when its pause is over, the pause doubling (capped); after the last resend
        with no Ack the receipt is given up: a controller that never answers must not be sent it forever."""
        while True:
            await asyncio.sleep(self.resend.first_s)
            now = time.monotonic()
            for key, (receipt, due) in list(self.unacked.items()):
                if now < due or self.unacked.get(key, (None, 0.0))[0] is not receipt:
                    continue  # not due, or acknowledged while an earlier one was being sent
                resends = self.resends.get(key, 0)
                if resends >= self.resend.give_up_after:
                    self._give_up(key, resends)
                    continue
                self.resends[key] = resends + 1
                self.unacked[key] = (receipt, now + self.resend.pause(resends + 1))
                self.counts["receipts_resent"] += 1
                await self._send_receipt(receipt)

    def _give_up(self, key: AttemptKey, resends: int) -> None:
        self.unacked.pop(key, None)
        self.resends.pop(key, None)
        self.counts["receipts_given_up"] += 1
        self._given_up_metric.inc()
        log.warning("receipt_given_up", rollout_id=key[0], attempt=key[1], resends=resends)
