"""The controller: the only coordinator of a run.

It owns the recovery ledger (``protocol/ledger.py``), the admission gate in front of dispatch, the
ACK outbox and the trainer hook. It forms prompt groups of G siblings from the tasks, dispatches
``Run`` to agent replicas (never more than ``rollout.max_in_flight`` at once; a reserved attempt that
waits for the gate is not running), seals ``Completed`` receipts, handles ``Failed`` by the group's
granularity, acknowledges receipts in batches, and hands settled groups to the trainer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import structlog
from parkway.actors.roles.controller.snapshots import SnapshotCoordinator, SnapshotMetrics
from parkway.actors.run.config import RunConfig, parse_fault
from parkway.actors.run.tasks import Task
from parkway.actors.runtime.actor import Actor
from parkway.actors.sdk.trainer import ExampleTrainer, GroupResult, Trainer, TrainStep
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.ids import actor_address, capture_key, new_checkpoint_id
from parkway.protocol.ledger import AttemptState, Granularity, Ledger, SealOutcome
from parkway.protocol.messages import (
    Ack,
    AttemptRef,
    CanonicalRow,
    CanonicalRows,
    Capabilities,
    Completed,
    Discover,
    EpisodeRef,
    Error,
    Failed,
    FetchRows,
    LoadWeights,
    Message,
    ReleaseRows,
    Retire,
    Run,
    SealRows,
    Snapshot,
    SnapshotTaken,
    Status,
    StatusReport,
    WeightsLoaded,
)
from parkway.protocol.snapshot import SnapshotFailure

log = structlog.get_logger("parkway.controller")

ACK_FLUSH_S = 0.01
WEIGHTS_TIMEOUT_S = 600.0  # loading a large model's weights from disk takes minutes, not seconds


class SetupError(Exception):
    """The cluster does not fit the configuration; the message names what does not."""


class SimulatedCrash(Exception):
    """A test's stand-in for a cluster dying at an exact moment (real crash tests use SIGKILL)."""


class RunSummary(msgspec.Struct, kw_only=True):
    rollouts_expected: int
    rollouts_sealed: int
    rollouts_failed: int
    attempts_dispatched: int
    attempts_failed: int
    rollouts_redone: int
    attempts_abandoned: int
    attempts_retired: int
    turns_generated: int
    turns_regenerated: int
    model_calls: int
    tokens_generated: int
    tool_calls: int
    tool_mutations_applied: int
    tool_duplicates_absorbed: int
    tool_mutations_duplicated: int  # from the resources' own records: must be 0
    sessions_leaked: int  # tool sessions opened and never retired (must be 0 at the end of a run)
    receipts_duplicate: int
    receipts_stale: int
    acks_sent: int
    ack_batches: int
    train_steps: int
    policy_version: int
    mean_reward: float
    wall_s: float
    rollouts_per_s: float
    model_calls_per_s: float
    transcripts_sha256: str
    snapshots_published: int
    snapshots_failed: int
    snapshots_skipped: int
    pause_ms: dict[str, float]  # admission-closed window per snapshot: p50, p95, max
    snapshot_steps_ms: dict[str, float]  # median duration of each save step
    snapshot_bytes: dict[str, float]  # bytes each snapshot wrote: p50, p95, max
    restores: int
    rollouts_restored: int
    rollouts_by_agent: dict[str, int]  # attempts each agent replica finished (sealed or not)
    tool_calls_by_resources: dict[str, int]


def dead_attempts(ledger: Ledger) -> list[AttemptRef]:
    """Attempts of a restored ledger that must stay refused: the failed, abandoned and retired ones. A
    restore replaces every participant's fences with these (and the running ones it restarts): the
    fences of the cluster that died may name attempt numbers the restored ledger gives out again."""
    dead = (AttemptState.FAILED, AttemptState.ABANDONED, AttemptState.RETIRED)
    return [
        AttemptRef(rollout_id=s.rollout_id, attempt=a.index) for s, a in ledger.attempts() if a.state in dead
    ]


def stable_int(*parts: object) -> int:
    """A seed that is the same in every process and run (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Controller(Actor):
    role = "controller"
    prefetch = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handlers.update(
            {Completed: self.on_completed, Failed: self.on_failed, Snapshot: self.on_snapshot}
        )
        self._snapshot_lock = asyncio.Lock()  # one save at a time: periodic or asked for
        self.metrics.snapshot_metrics()
        self.ledger = Ledger()
        self._gate_open = True
        self._gate_closed_at: float | None = None
        self._paused_total = 0.0  # seconds the admission gate was closed, for the stall watchdog
        self._dispatched_at: dict[tuple[str, int], tuple[float, float]] = {}  # -> (monotonic, paused then)
        self.policy_version = 0
        self.epoch = 1  # this controller's incarnation: +1 per restore, stamped on every Run
        self._wake = asyncio.Event()
        self._outbox: dict[int, list[AttemptRef]] = defaultdict(list)
        self._replica_of: dict[tuple[str, int], int] = {}
        self._config: RunConfig | None = None
        self._faults: dict[tuple[str, int], int] = {}
        self._tasks: list[Task] = []
        # The ledger holds the groups in play; the tasks after the cursor have not been admitted yet.
        self._next_task = 0
        self._first_in_play = 0  # restored from an anchor: the groups before it were all trained
        # What the trainer received, as sums (a snapshot carries them: they must not grow with the run).
        self._sealed = 0  # logical rollouts whose final attempt the trainer received
        self._reward_sum = 0.0
        self._transcripts = 0  # sum of each trained rollout's token digest, mod 2**256
        self._trainer: Trainer | None = None
        self.snapshots: SnapshotCoordinator | None = None
        self.stage = "starting"  # what the workload is doing, for progress lines
        self._expected = 0
        self._run_started: float | None = None
        self.fenced_at_restore: list[AttemptRef] = []
        self.restart_only: set[str] = set()  # participants that cannot save a rollout mid-way
        self._incarnations: dict[str, tuple[int, float]] = {}  # address -> (pid, started_at) last seen
        self._trained_groups: list[str] = []  # group ids the trainer consumed, those still in play
        self.holds: dict[str, int] = {}  # rollout -> turn its first attempt parks at for good (the demo)
        self.seals = 0  # seals this incarnation made: the history marks how many a snapshot captured
        # Attempts lost with an agent process: fenced everywhere before their next attempts are dispatched.
        self._unfenced: list[AttemptRef] = []

    # -- the admission gate and the stall clock ----------------------------------------------------
    @property
    def gate_open(self) -> bool:
        return self._gate_open

    @gate_open.setter
    def gate_open(self, value: bool) -> None:
        now = time.monotonic()
        if not value and self._gate_open:
            self._gate_closed_at = now
            log.info("gate_closed")
        elif value and not self._gate_open and self._gate_closed_at is not None:
            self._paused_total += now - self._gate_closed_at
            log.info("gate_opened", paused_ms=round((now - self._gate_closed_at) * 1000, 3))
            self._gate_closed_at = None
        self._gate_open = value

    def paused_s(self) -> float:
        """Seconds spent with the gate closed (rollouts parked), including a closure in progress."""
        current = time.monotonic() - self._gate_closed_at if self._gate_closed_at is not None else 0.0
        return self._paused_total + current

    def stalled(self, timeout_s: float) -> list[tuple[str, int]]:
        """Attempts running longer than ``timeout_s``, not counting the time they were parked."""
        now, paused = time.monotonic(), self.paused_s()
        return [
            key
            for key in sorted(self.ledger.dispatched())
            if key in self._dispatched_at
            and now - self._dispatched_at[key][0] - (paused - self._dispatched_at[key][1]) > timeout_s
        ]

    # -- receipts ------------------------------------------------------------------------------
    async def on_completed(self, receipt: Completed) -> None:
        key = (receipt.rollout_id, receipt.attempt)
        if not self.ledger.knows(receipt.rollout_id):
            self.counts["receipts_stale"] += 1  # its group was finalized already: acknowledge, change nothing
        elif receipt.attempt >= len(self.ledger.sibling(receipt.rollout_id).attempts):
            # An attempt this controller never reserved (another run's agent, a forged receipt): ignored.
            self.counts["receipts_stale"] += 1
            log.warning("receipt_unknown_attempt", rollout_id=receipt.rollout_id, attempt=receipt.attempt)
        else:
            sibling = self.ledger.sibling(receipt.rollout_id)
            target = sibling.attempts[receipt.attempt] if receipt.attempt < len(sibling.attempts) else None
            if target is not None and target is sibling.current and target.state.value == "dispatched":
                # Canonical rows first: a group the ledger settles must be readable by the trainer.
                await self._seal_rows(receipt)
            outcome = self.ledger.seal(
                receipt.rollout_id, receipt.attempt, reward=receipt.reward, turns=receipt.turns
            )
            self.history.record(
                "receipt", r=receipt.rollout_id, a=receipt.attempt, of="completed", outcome=outcome.value
            )
            if outcome is SealOutcome.SEALED:
                self.counts["rollouts_sealed"] += 1
                self.seals += 1
                self.history.record(
                    "seal",
                    r=receipt.rollout_id,
                    a=receipt.attempt,
                    ck=receipt.capture_key,
                    reward=receipt.reward,
                    seq=self.seals,
                )
                log.info(
                    "sealed",
                    rollout_id=receipt.rollout_id,
                    attempt=receipt.attempt,
                    reward=receipt.reward,
                    turns=receipt.turns,
                )
            elif outcome is SealOutcome.DUPLICATE:
                self.counts["receipts_duplicate"] += 1
            else:
                self.counts["receipts_stale"] += 1
        self._acknowledge(key)

    async def on_failed(self, receipt: Failed) -> None:
        await self._fail(receipt)
        self._acknowledge((receipt.rollout_id, receipt.attempt))

    async def _fail(self, receipt: Failed) -> None:
        """A failed attempt, reported by its agent or found stalled: redone by its group's granularity."""
        if not self.ledger.knows(receipt.rollout_id):
            self.counts["receipts_stale"] += 1
            self.history.record(
                "receipt", r=receipt.rollout_id, a=receipt.attempt, of="failed", outcome="stale"
            )
            return
        plan = self.ledger.fail(receipt.rollout_id, receipt.attempt, code=receipt.code, turns=receipt.turns)
        self.history.record(
            "receipt",
            r=receipt.rollout_id,
            a=receipt.attempt,
            of="failed",
            outcome="stale" if plan.stale else "failed",
            code=receipt.code,
            redo=list(plan.redo),
            given_up=list(plan.given_up),
        )
        if plan.stale:
            self.counts["receipts_stale"] += 1
            return
        self.counts["attempts_failed"] += 1
        self.counts["rollouts_redone"] += len(plan.redo)
        self.counts["rollouts_failed"] += len(plan.given_up)
        log.warning(
            "attempt_failed",
            rollout_id=receipt.rollout_id,
            attempt=receipt.attempt,
            code=receipt.code,
            redo=len(plan.redo),
            given_up=len(plan.given_up),
        )
        self.counts["attempts_abandoned"] += len(plan.retire)
        await self._retire(plan.retire)
        self._wake.set()

    async def _seal_rows(self, receipt: Completed) -> None:
        request = SealRows(
            rollout_id=receipt.rollout_id,
            attempt=receipt.attempt,
            capture_key=receipt.capture_key,
            reward=receipt.reward,
            staging_keys=receipt.staging_keys,
        )
        for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0):  # staging rows may still be on their way to TQ
            await asyncio.sleep(delay)
            reply = await self.client.request(
                "tq/0", request, correlation_id=f"seal:{receipt.capture_key}", deadline=time.time() + 30
            )
            if not isinstance(reply, Error):
                return
            if not reply.retryable:
                raise ProtocolError(reply.code, reply.detail)
        raise RuntimeError(f"TQ has no staging rows for {receipt.capture_key} after retries")

    async def _retire(self, attempts: tuple[tuple[str, int, int], ...]) -> None:
        by_replica: dict[int, list[AttemptRef]] = defaultdict(list)
        for rollout, attempt, replica in attempts:
            by_replica[replica].append(AttemptRef(rollout_id=rollout, attempt=attempt))
        for replica, refs in by_replica.items():
            command = Retire(
                checkpoint_id=f"retire-{stable_int(*refs) % 10**12}",
                deadline=time.time() + 30,
                attempts=tuple(refs),
            )
            reply = await self.client.request(actor_address("agent", replica), command)
            if isinstance(reply, Error):
                log.warning("retire_refused", replica=replica, code=reply.code.value, detail=reply.detail)
                continue
            for ref in refs:
                self.ledger.retired(ref.rollout_id, ref.attempt)
                self.counts["attempts_retired"] += 1
        await self._fence(tuple(ref for refs in by_replica.values() for ref in refs))

    async def _fence(self, refs: tuple[AttemptRef, ...]) -> None:
        """Attempt N is refused everywhere before attempt N+1 is dispatched: the policy aborts its calls
        and stages none of its tokens, resources end its session, TQ drops rows of it still on the way.
        (Its agent stopped it, or died with it.) A participant that cannot be reached is named and
        skipped: it was down, and what it had of the attempt is gone or comes back fenced by a restore."""
        if not refs or self._config is None:
            return
        command = Retire(
            checkpoint_id=f"fence-{stable_int(*refs) % 10**12}", deadline=time.time() + 10, attempts=refs
        )
        resources = [actor_address("resources", i) for i in range(self._config.topology.resources)]
        for address in ("policy/0", *resources, "tq/0"):
            try:
                reply = await self.client.request(address, command)
            except BrokerError as exc:
                log.warning("fence_not_sent", participant=address, error=str(exc))
                continue
            if isinstance(reply, Error):
                log.warning("fence_refused", participant=address, code=reply.code.value, detail=reply.detail)

    def _acknowledge(self, key: tuple[str, int]) -> None:
        replica = self._replica_of.get(key)
        if replica is not None:
            self._outbox[replica].append(AttemptRef(rollout_id=key[0], attempt=key[1]))
        self._wake.set()

    async def _flush_outbox(self) -> None:
        """One Ack per agent replica for every receipt pending: batched, and a repeat is harmless."""
        pending, self._outbox = self._outbox, defaultdict(list)
        for replica, refs in pending.items():
            await self.client.send(
                actor_address("agent", replica),
                Ack(receipts=tuple(refs)),
                correlation_id=f"ack-{time.monotonic_ns()}",
            )
            self.counts["acks_sent"] += len(refs)
            self.counts["ack_batches"] += 1
            self.history.record("ack", replica=replica, refs=[[a.rollout_id, a.attempt] for a in refs])

    async def _ack_loop(self) -> None:
        while True:
            await asyncio.sleep(ACK_FLUSH_S)
            if self._outbox:
                try:
                    await self._flush_outbox()
                except BrokerError as exc:  # the agents send their receipts again; they are acked again
                    log.warning("ack_not_sent", error=str(exc))

    # -- the workload --------------------------------------------------------------------------
    async def run_workload(
        self,
        config: RunConfig,
        tasks: list[Task],
        trainer: Trainer | None = None,
        *,
        snapshot_root: Path | None = None,
        stop_after_snapshots: int | None = None,
    ) -> RunSummary:
        """Run every task's group to completion and return the summary.

        With a ``snapshot_root`` the run takes a snapshot every ``snapshot_interval_s`` and, when the
        run's directory holds one, starts by restoring the newest that verifies. ``stop_after_snapshots``
        is for tests: the run stops dead (``SimulatedCrash``) right after that many publications, before
        resuming, like a cluster killed at that moment.
        """
        with structlog.contextvars.bound_contextvars(**self.log_context()):
            try:
                summary = await self._run_workload(
                    config, tasks, trainer, snapshot_root, stop_after_snapshots
                )
            except asyncio.CancelledError:
                log.info("run_aborted", error="cancelled")
                raise
            except Exception as exc:
                log.error("run_aborted", error=f"{type(exc).__name__}: {exc}")
                self.history.record("run_aborted", error=f"{type(exc).__name__}: {exc}")
                raise
            log.info(
                "run_finished",
                rollouts_sealed=summary.rollouts_sealed,
                rollouts_failed=summary.rollouts_failed,
                wall_s=summary.wall_s,
            )
            self.history.record(
                "run_finished",
                sealed=summary.rollouts_sealed,
                failed=summary.rollouts_failed,
                expected=summary.rollouts_expected,
                transcripts_sha256=summary.transcripts_sha256,
            )
            return summary

    async def _run_workload(
        self,
        config: RunConfig,
        tasks: list[Task],
        trainer: Trainer | None,
        snapshot_root: Path | None,
        stop_after_snapshots: int | None,
    ) -> RunSummary:
        self._trainer = trainer = trainer or ExampleTrainer()
        self._config, self._tasks = config, tasks
        self._faults = {(r, a): t for r, a, t in map(parse_fault, config.faults.fail_attempts)}
        expected = len(tasks) * config.rollout.group_size
        self._expected = expected
        self.stage = "waiting for the cluster"
        await self.wait_for_cluster(config)
        await self.check_restart_only(config)
        self.snapshots = (
            SnapshotCoordinator(self, config, snapshot_root) if snapshot_root is not None else None
        )
        self.stage = "restoring"
        restored = self.snapshots is not None and await self.snapshots.restore_if_any()
        self.stage = "running"
        if not restored:
            self.ledger = Ledger(max_attempts=config.rollout.max_attempts)
            self._next_task = 0
        log.info(
            "run_started",
            restored=restored,
            epoch=self.epoch,
            rollouts_expected=expected,
            groups_left=len(self.ledger.groups) + len(tasks) - self._next_task,
            snapshots=self.snapshots is not None,
        )
        self.history.record(
            "run_started",
            restored=restored,
            epoch=self.epoch,
            expected=[f"t{i:04d}_g{g}" for i in range(len(tasks)) for g in range(config.rollout.group_size)],
        )
        started = time.monotonic()  # the clock runs from the first dispatch, not from cluster start-up
        self._run_started = started
        loop = asyncio.get_running_loop()
        background = [loop.create_task(self._ack_loop())]
        crash: asyncio.Future[None] = loop.create_future()
        background.append(loop.create_task(self._watch_agents(config, crash)))
        if self.snapshots is not None:
            background.append(loop.create_task(self._snapshot_loop(config, stop_after_snapshots, crash)))
        try:
            while self.ledger.groups or self._next_task < len(tasks):
                if crash.done():
                    crash.result()
                self._admit_groups()
                await self._dispatch_ready()
                await self._train_ready(trainer)
                if not self.ledger.groups and self._next_task >= len(tasks):
                    break
                self._wake.clear()
                waiter = loop.create_task(self._wake.wait())
                await asyncio.wait({waiter, crash}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            await self._flush_outbox()
            if self.snapshots is not None:
                self.snapshots.mark_completed()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        wall = time.monotonic() - started
        self.stage = "summing up"
        return await self._summary(config, expected, wall, trainer)

    def progress(self) -> dict[str, Any]:
        """Where the workload stands, cheaply: for a progress line, never for decisions."""
        metrics = self.snapshots.metrics if self.snapshots is not None else None
        return {
            "stage": self.stage,
            "expected": self._expected,
            "sealed": self.counts["rollouts_sealed"],
            "failed": self.counts["rollouts_failed"],
            "running": len(self.ledger.dispatched()),
            "train_steps": self.counts["train_steps"],
            "snapshots": metrics.published if metrics else 0,
            "last_pause_ms": metrics.pause_ms[-1] if metrics and metrics.pause_ms else None,
            "restored": metrics.rollouts_restored if metrics else 0,
            "elapsed_s": time.monotonic() - self._run_started if self._run_started is not None else 0.0,
        }

    async def _snapshot_loop(
        self, config: RunConfig, stop_after: int | None, crash: asyncio.Future[None]
    ) -> None:
        assert self.snapshots is not None
        try:
            while True:
                await asyncio.sleep(config.snapshot_interval_s)
                await self.take_snapshot(stop_after)
        except Exception as exc:  # surfaced in the run loop: a run never ends silently
            if not crash.done():
                crash.set_exception(exc)

    async def take_snapshot(self, stop_after: int | None = None) -> Path | None:
        """One snapshot now. Transient failures count towards ``max_consecutive_failures``; an
        invariant violation ends the run at once, naming what broke."""
        assert self.snapshots is not None and self._config is not None
        if stop_after is not None and self.snapshots.metrics.published >= stop_after:
            return None
        if stop_after is not None and self.snapshots.metrics.published + 1 == stop_after:
            self.snapshots.on_published = self._crash_now
        try:
            async with self._snapshot_lock:
                return await self.snapshots.save()
        except SnapshotFailure as failure:
            self._snapshot_failed(failure)
            return None

    def _snapshot_failed(self, failure: SnapshotFailure) -> None:
        """A snapshot attempt failed (and was aborted): a transient failure is retried at the next
        interval, up to ``max_consecutive_failures`` in a row; an invariant violation ends the run."""
        assert self.snapshots is not None and self._config is not None
        if not failure.transient:
            raise RuntimeError(
                f"snapshot invariant violated at {failure.step}: {failure.detail}"
            ) from failure
        if self.snapshots.metrics.consecutive_failures >= self._config.max_consecutive_failures:
            raise RuntimeError(
                f"{self.snapshots.metrics.consecutive_failures} snapshots failed in a row; last at "
                f"{failure.step}: {failure.detail}"
            ) from failure

    async def on_snapshot(self, request: Snapshot) -> Message:
        """``parkway snapshot``: one snapshot now, answered with what was published."""
        if self.snapshots is None or self._config is None:
            raise ProtocolError(
                ErrorCode.UNAVAILABLE, "no workload with snapshots is running on this controller"
            )
        try:
            async with self._snapshot_lock:
                # Asked for by name: taken even if nothing moved, under the request's own id, so a
                # `parkway logs --checkpoint-id ID --follow` started first sees every line of it.
                path = await self.snapshots.save(force=True, checkpoint_id=request.checkpoint_id)
        except SnapshotFailure as failure:
            raise ProtocolError(
                ErrorCode.UNAVAILABLE, f"snapshot failed at {failure.step}: {failure.detail}"
            ) from None
        if path is None:
            return SnapshotTaken(snapshot="", skipped=True)
        manifest = json.loads((path / "manifest.json").read_text())
        return SnapshotTaken(snapshot=path.name, checkpoint_id=manifest["checkpoint_id"])

    @staticmethod
    def _crash_now(path: Path) -> None:
        raise SimulatedCrash(f"stopped right after publishing {path.name}")

    async def _watch_agents(
        self, config: RunConfig, crash: asyncio.Future[None], every_s: float = 1.0
    ) -> None:
        """An agent replica that comes back as a new process lost the rollouts it was running: they get a
        new attempt from their prompt on that replica (its tool sessions move to the new attempt)."""
        try:
            while True:
                await asyncio.sleep(every_s)
                for replica in range(config.topology.agents):
                    address = actor_address("agent", replica)
                    try:
                        reply = await self.client.request(
                            address,
                            Status(checkpoint_id=f"alive-{time.monotonic_ns()}", deadline=time.time() + 2),
                        )
                    except BrokerError:
                        continue  # down, or busy: asked again next round
                    if isinstance(reply, StatusReport):
                        self.observe(address, reply)
                await self._check_stalls(config)
        except Exception as exc:
            if not crash.done():
                crash.set_exception(exc)

    def adopt_fallback(self, anchor: dict[str, object], trainer_state: dict[str, object]) -> None:
        """A trainer checkpoint without its snapshot: groups the trainer consumed stay done, every other
        group starts over from its prompt (no turn of theirs can be trusted)."""
        assert self._config is not None and self._trainer is not None
        self.adopt(Ledger(max_attempts=self._config.rollout.max_attempts), anchor, saved_episodes=set())
        self._trainer.load_state(trainer_state)
        self.policy_version = int(trainer_state["policy_version"])  # type: ignore[call-overload]
        granularity = Granularity(self._config.recovery.default_granularity)
        trained = set(self._trained_groups)
        for index in range(self._first_in_play, self._next_task):  # the groups in play then; later
            group_id = f"t{index:04d}"  # ones are admitted from the cursor as usual
            if group_id not in trained:
                self.ledger.add_group(group_id, index, self._config.rollout.group_size, granularity)
        self.counts["fallback_restores"] += 1

    def _redo_groups_after_restore(self, ledger: Ledger) -> list[EpisodeRef]:
        """``prompt_group`` level: a group with any rollout unfinished at the snapshot starts over whole."""
        self.fenced_at_restore = dead_attempts(ledger)
        self.fenced_at_restore += [
            AttemptRef(rollout_id=r, attempt=a) for r, a in sorted(ledger.dispatched())
        ]
        groups = sorted({ledger.group_of(r).group_id for r, _ in ledger.dispatched()})
        for group_id in groups:
            ledger.redo_group_after_restore(group_id)
            self.counts["rollouts_redone"] += len(ledger.groups[group_id].siblings)
        self.counts["restores"] += 1
        return []

    async def _check_stalls(self, config: RunConfig) -> None:
        """The stall watchdog: parked time does not count (NeMo's counted it and aborted healthy runs)."""
        for rollout, attempt in self.stalled(config.rollout.stall_timeout_s):
            replica = self.ledger.sibling(rollout).current.replica
            log.warning(
                "rollout_stalled",
                rollout_id=rollout,
                attempt=attempt,
                timeout_s=config.rollout.stall_timeout_s,
            )
            self.counts["attempts_stalled"] += 1
            self.history.record("stalled", r=rollout, a=attempt)
            if replica is not None:
                await self._retire(((rollout, attempt, replica),))  # stop it where it hangs
            await self._fail(Failed(rollout_id=rollout, attempt=attempt, code="stalled"))

    def observe(self, address: str, report: StatusReport) -> bool:
        """Note an agent's incarnation; True (and its rollouts restarted) when it is a new process."""
        incarnation = (report.pid, report.started_at)
        if self._incarnations.setdefault(address, incarnation) == incarnation or report.role != "agent":
            return False
        self._incarnations[address] = incarnation
        self._replica_restarted(report.replica)
        return True

    def _replica_restarted(self, replica: int) -> None:
        lost = [
            s.rollout_id
            for g in self.ledger.groups.values()
            for s in g.siblings
            if s.current.state is AttemptState.DISPATCHED and s.current.replica == replica
        ]
        for rollout in lost:
            self._unfenced.append(
                AttemptRef(rollout_id=rollout, attempt=self.ledger.sibling(rollout).current.index)
            )
            self.ledger.restart_after_restore(rollout, continue_saved=False)
        self.counts["attempts_lost_with_replica"] += len(lost)
        self.history.record("replica_restarted", replica=replica, lost=lost)
        log.warning("agent_replica_restarted", replica=replica, rollouts_restarted=len(lost))
        self._wake.set()

    async def retire_pending(self) -> None:
        """Stop attempts given up on that may still run on an agent."""
        pending = tuple(
            (s.rollout_id, a.index, a.replica)
            for s, a in self.ledger.attempts()
            if a.state is AttemptState.ABANDONED and a.replica is not None
        )
        if pending:
            await self._retire(pending)  # type: ignore[arg-type]

    def anchor(self) -> dict[str, object]:
        """What the controller saves beside its ledger: the trainer anchor, the task cursor and the
        run's counters; nothing in it grows with the run. ``first_in_play``: every group before it was
        trained; ``trained_groups`` names the trained ones from there to the cursor."""
        first = min((g.task_index for g in self.ledger.groups.values()), default=self._next_task)
        self._trained_groups = [g for g in self._trained_groups if int(g[1:]) >= first]
        return {
            "policy_version": self.policy_version,
            "epoch": self.epoch,
            "train_steps": self.counts["train_steps"],
            "next_task": self._next_task,
            "first_in_play": first,
            "sealed": self._sealed,
            "reward_sum": self._reward_sum,
            "transcripts": f"{self._transcripts:064x}",
            "trained_groups": list(self._trained_groups),
            "counts": {k: v for k, v in self.counts.items() if not k.startswith(("error:", "refused:"))},
        }

    def adopt(
        self, ledger: Ledger, anchor: dict[str, object], *, saved_episodes: set[tuple[str, int]]
    ) -> list[EpisodeRef]:
        """Take over a restored ledger: every attempt that was running gets attempt N+1 on the same
        replica, continuing its saved transcript at ``turn`` level, from its prompt otherwise."""
        assert self._config is not None
        self.ledger = ledger
        self.policy_version = int(anchor["policy_version"])  # type: ignore[arg-type]
        self.epoch = int(anchor["epoch"]) + 1  # type: ignore[arg-type]
        if "sealed_rows" in anchor:  # a snapshot from before the sums: every trained rollout listed
            rewards = dict(anchor["sealed_rows"]).values()  # type: ignore[call-overload]
            self._sealed, self._reward_sum, self._transcripts = len(rewards), float(sum(rewards)), 0
        else:
            self._sealed = int(anchor["sealed"])  # type: ignore[call-overload]
            self._reward_sum = float(anchor["reward_sum"])  # type: ignore[arg-type]
            self._transcripts = int(str(anchor["transcripts"]), 16)
        # Before the cursor every task was admitted at the start: all of them are in that ledger.
        self._next_task = int(anchor.get("next_task", len(self._tasks)))  # type: ignore[call-overload]
        self._first_in_play = int(anchor.get("first_in_play", 0))  # type: ignore[call-overload]
        self._trained_groups = list(anchor.get("trained_groups", []))  # type: ignore[call-overload]
        for key, value in dict(anchor["counts"]).items():  # type: ignore[arg-type]
            self.counts[key] = value
        if isinstance(self._trainer, ExampleTrainer):
            self._trainer.policy_version = self.policy_version
        if self._config.recovery.target_level == "prompt_group":
            return self._redo_groups_after_restore(ledger)
        keep_turns = self._config.recovery.target_level in ("turn", "prefix")
        continued = []
        self.fenced_at_restore = dead_attempts(ledger)
        for rollout, attempt in sorted(ledger.dispatched()):
            self.fenced_at_restore.append(AttemptRef(rollout_id=rollout, attempt=attempt))
            replica = ledger.sibling(rollout).current.replica or 0
            depends_on = {
                actor_address("agent", replica),
                actor_address("resources", replica % self._config.topology.resources),
            }
            keeps_turns = keep_turns and not depends_on & self.restart_only  # restart-only: from the prompt
            fresh = ledger.restart_after_restore(
                rollout, continue_saved=keeps_turns and (rollout, attempt) in saved_episodes
            )
            self.counts["attempts_restarted"] += 1
            if fresh.continue_from is not None:
                assert fresh.replica is not None
                continued.append(EpisodeRef(rollout_id=rollout, attempt=fresh.index, replica=fresh.replica))
        self.counts["restores"] += 1
        self.counts["rollouts_restored"] += len(continued)
        return continued

    async def wait_for_cluster(self, config: RunConfig, timeout: float = 120.0) -> None:
        """Every participant answers Status before the first dispatch (a missing one is named)."""
        addresses = self.participant_addresses(config)
        deadline = time.monotonic() + timeout
        missing = list(addresses)
        while missing:
            still = []
            for address in missing:
                try:
                    reply = await self.client.request(
                        address,
                        Status(checkpoint_id=f"hello-{time.monotonic_ns()}", deadline=time.time() + 2),
                    )
                    if isinstance(reply, StatusReport):
                        self._incarnations[address] = (reply.pid, reply.started_at)
                    else:
                        still.append(address)
                except (BrokerError, ProtocolError):
                    still.append(address)
            missing = still
            if missing and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from {', '.join(missing)} within {timeout:.0f}s")
            if missing:
                await asyncio.sleep(0.5)

    async def check_restart_only(self, config: RunConfig) -> None:
        """Restart-only participants cannot save a rollout mid-way. At ``turn``/``prefix`` that fails
        setup unless ``recovery.allow_restart_only``; then it is a warning, and their rollouts restart
        from the prompt after a crash (``sibling`` behaviour). Either way, every one is named."""
        restart_only = []
        for address in self.participant_addresses(config):
            reply = await self.client.request(
                address, Discover(checkpoint_id=f"setup-{time.monotonic_ns()}", deadline=time.time() + 10)
            )
            if isinstance(reply, Capabilities) and reply.restart_only:
                restart_only.append(address)
        self.restart_only = set(restart_only)
        recovery = config.recovery
        if recovery.target_level not in ("turn", "prefix"):
            return
        if restart_only and not recovery.allow_restart_only:
            raise SetupError(
                f"restart-only participants cannot keep turns at recovery.target_level {recovery.target_level}: "
                f"{', '.join(restart_only)}; set recovery.allow_restart_only: true to restart their rollouts "
                "from the prompt instead"
            )
        if restart_only:
            log.warning(
                "restart_only_participants",
                participants=restart_only,
                effect="their rollouts restart from the prompt after a crash",
            )
        elif recovery.allow_restart_only:
            log.warning(
                "restart_only_allowed_but_none",
                detail="recovery.allow_restart_only is true but no participant is restart-only",
            )

    @staticmethod
    def participant_addresses(config: RunConfig) -> list[str]:
        return [
            "tq/0",
            "policy/0",
            *(actor_address("resources", i) for i in range(config.topology.resources)),
            *(actor_address("agent", i) for i in range(config.topology.agents)),
        ]

    def _admit_groups(self) -> None:
        """Bring groups into the ledger from the task cursor, as many as the free dispatch slots take.
        The ledger (and every snapshot of it) holds the groups in play, not the whole dataset: with
        every task admitted at the start, each snapshot encoded and walked all of them (10,000 prompts:
        7 MB and about 130 ms per snapshot, and the dispatch loop walked them on every wake-up)."""
        assert self._config is not None
        if not self.gate_open:  # nothing changes in the ledger while a snapshot is cut
            return
        config = self._config
        size = config.rollout.group_size
        want = config.rollout.max_in_flight - self.ledger.in_flight()
        waiting = len(self.ledger.reserved())
        granularity = Granularity(config.recovery.default_granularity)
        while self._next_task < len(self._tasks) and waiting < want:
            index = self._next_task
            self.ledger.add_group(f"t{index:04d}", index, size, granularity)
            self._next_task += 1
            waiting += size

    async def _dispatch_ready(self) -> None:
        assert self._config is not None
        config = self._config
        if self._unfenced:
            refs, self._unfenced = tuple(self._unfenced), []
            await self._fence(refs)
        in_flight = self.ledger.in_flight()
        for sibling in self.ledger.reserved():
            if not self.gate_open or in_flight >= config.rollout.max_in_flight:
                return
            group = self.ledger.group_of(sibling.rollout_id)
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
                seed=stable_int(config.seed, sibling.rollout_id),
                policy_version=self.policy_version,
                epoch=self.epoch,
                task=self._task_options(config, sibling.rollout_id, attempt, replica, current.continue_from),
            )
            self.ledger.dispatch(sibling.rollout_id, attempt, replica)
            self.history.record(
                "dispatch",
                r=sibling.rollout_id,
                a=attempt,
                epoch=self.epoch,
                replica=replica,
                continue_from=current.continue_from,
            )
            log.info(
                "rollout_dispatched",
                rollout_id=sibling.rollout_id,
                attempt=attempt,
                group_id=group.group_id,
                replica=replica,
                continue_from=current.continue_from,
            )
            self._dispatched_at[(sibling.rollout_id, attempt)] = (time.monotonic(), self.paused_s())
            self._replica_of[(sibling.rollout_id, attempt)] = replica
            self.counts["attempts_dispatched"] += 1
            in_flight += 1
            await self.client.send(
                actor_address("agent", replica), run, correlation_id=capture_key(sibling.rollout_id, attempt)
            )

    def _task_options(
        self, config: RunConfig, rollout: str, attempt: int, replica: int, continue_from: int | None = None
    ) -> dict[str, object]:
        options: dict[str, object] = {
            "agent": config.agent,
            "resources": replica % config.topology.resources,
            "max_tokens": config.rollout.max_tokens,
        }
        fail_at = self._faults.get((rollout, attempt))
        rate = config.faults.failure_rate
        if (
            fail_at is None
            and rate > 0
            and stable_int(config.seed, rollout, attempt, "fail") % 10**6 < rate * 10**6
        ):
            fail_at = stable_int(config.seed, rollout, attempt, "turn") % config.rollout.max_turns
        if fail_at is not None:
            options["fail_at_turn"] = fail_at
        if continue_from is not None:
            options["continue_from"] = continue_from
        if config.policy.engine == "vllm" and config.policy.model:
            options["tokenizer"] = config.policy.model  # agents render prompts with the model's own template
        if rollout in self.holds:
            options["hold_at_turn"] = self.holds[rollout]
        return options

    async def _train_ready(self, trainer: Trainer) -> None:
        assert self._config is not None
        batch_size = self._config.trainer.batch_groups
        while True:
            ready = self.ledger.ready_groups()
            admitted = self._next_task >= len(self._tasks)
            everything_settled = admitted and len(ready) == len(self.ledger.groups)
            if not ready or (len(ready) < batch_size and not everything_settled):
                return
            batch = ready[:batch_size]
            # A snapshot never sees a group between finalize and remove: no lock, and one cut while a
            # group was finalizing would restore it finalizing, where nothing ever takes it again.
            async with self._snapshot_lock:
                await self._train_batch(trainer, batch)
            every = self._config.trainer.checkpoint_every
            if every and self.counts["train_steps"] % every == 0:
                await self._checkpoint_trainer(trainer)

    async def _train_batch(self, trainer: Trainer, batch: list[Any]) -> None:
        results = []
        for group in batch:
            self.ledger.finalize(group.group_id)
            sealed = [s.rollout_id for s in group.siblings if not s.given_up]
            reply = await self.client.call(
                "tq/0", FetchRows(rollout_ids=tuple(sealed)), correlation_id=f"fetch:{group.group_id}"
            )
            assert isinstance(reply, CanonicalRows)
            if reply.missing:
                raise RuntimeError(f"TQ lacks canonical rows of sealed rollouts: {', '.join(reply.missing)}")
            failed = tuple(s.rollout_id for s in group.siblings if s.given_up)
            results.append(GroupResult(group.group_id, group.task_index, reply.rows, failed))
            for row in reply.rows:
                self._sealed += 1
                self._reward_sum += row.reward
                self._transcripts = (self._transcripts + transcript_digest(row)) % 2**256
        step = trainer.train(results)
        if step.weights_dir is not None:
            await self._load_weights(step, locked=True)
        self.policy_version = step.policy_version
        self.counts["train_steps"] += 1
        log.info(
            "trained",
            step=step.step,
            groups=step.groups,
            samples=step.samples,
            mean_reward=round(step.mean_reward, 4),
            policy_version=step.policy_version,
        )
        for group in batch:
            self.ledger.remove(group.group_id)
            self._trained_groups.append(group.group_id)
        # TQ keeps rows until the trainer consumed them: after this, a snapshot no longer carries
        # them, so what a snapshot writes stays the rows of unfinished work, however long the run.
        consumed = tuple(s.rollout_id for group in batch for s in group.siblings)
        await self.client.call(
            "tq/0", ReleaseRows(rollout_ids=consumed), correlation_id=f"release:{batch[0].group_id}"
        )

    async def _load_weights(self, step: TrainStep, *, locked: bool = False) -> None:
        """The policy loads the step's weights before any rollout is dispatched with its version. Not
        during a snapshot: the policy's record of its weights must be the ones its rollouts used."""
        assert step.weights_dir is not None
        command = LoadWeights(
            checkpoint_id=new_checkpoint_id("weights"),
            deadline=time.time() + WEIGHTS_TIMEOUT_S,
            directory=step.weights_dir,
            policy_version=step.policy_version,
        )
        if locked:  # the caller holds the snapshot lock
            reply = await self.client.call("policy/0", command)
        else:
            async with self._snapshot_lock:
                reply = await self.client.call("policy/0", command)
        assert isinstance(reply, WeightsLoaded)
        self.counts["weight_updates"] += 1

    async def _checkpoint_trainer(self, trainer: Trainer) -> None:
        """A trainer checkpoint: the fallback marker first, then the trainer's state, then a snapshot
        anchored at this step. A crash anywhere in between leaves a marker that a restore can use."""
        if self.snapshots is None:
            return
        step = self.counts["train_steps"]
        self.snapshots.write_trainer_checkpoint(step, anchor=self.anchor(), state=trainer.state())
        try:
            async with self._snapshot_lock:
                await self.snapshots.save(force=True)
        except SnapshotFailure as failure:
            # Like a periodic one: the next interval takes a snapshot at this step (meanwhile the
            # fallback marker just written is what a restore would use).
            self._snapshot_failed(failure)

    async def _summary(self, config: RunConfig, expected: int, wall: float, trainer: Trainer) -> RunSummary:
        counts: dict[str, int] = defaultdict(int)
        by_agent: dict[str, int] = {}
        by_resources: dict[str, int] = {}
        for address in self.participant_addresses(config):
            reply = await self.client.request(
                address, Status(checkpoint_id=f"sum-{time.monotonic_ns()}", deadline=time.time() + 10)
            )
            if not isinstance(reply, StatusReport):
                continue
            for key, value in reply.counts.items():
                counts[f"{reply.role}.{key}"] += value
            if reply.role == "agent":
                by_agent[address] = reply.counts.get("rollouts_completed", 0) + reply.counts.get(
                    "rollouts_failed", 0
                )
            elif reply.role == "resources":
                by_resources[address] = reply.counts.get("tool_calls", 0)
        digest = await self._transcripts_digest()
        metrics = self.snapshots.metrics if self.snapshots is not None else SnapshotMetrics()
        sealed = self._sealed
        return RunSummary(
            rollouts_expected=expected,
            rollouts_sealed=sealed,
            rollouts_failed=self.counts["rollouts_failed"],
            attempts_dispatched=self.counts["attempts_dispatched"],
            attempts_failed=self.counts["attempts_failed"],
            rollouts_redone=self.counts["rollouts_redone"],
            attempts_abandoned=self.counts["attempts_abandoned"],
            attempts_retired=self.counts["attempts_retired"],
            turns_generated=counts["tq.staging_rows"],
            turns_regenerated=counts["tq.turns_regenerated"],
            model_calls=counts["policy.model_calls"],
            tokens_generated=counts["policy.tokens_generated"],
            tool_calls=counts["resources.tool_calls"],
            tool_mutations_applied=counts["resources.tool_mutations_applied"],
            tool_duplicates_absorbed=counts["resources.tool_duplicates"],
            tool_mutations_duplicated=counts["resources.tool_mutations_duplicated"],
            sessions_leaked=counts["resources.sessions_opened"] - counts["resources.sessions_retired"],
            receipts_duplicate=self.counts["receipts_duplicate"],
            receipts_stale=self.counts["receipts_stale"],
            acks_sent=self.counts["acks_sent"],
            ack_batches=self.counts["ack_batches"],
            train_steps=self.counts["train_steps"],
            policy_version=self.policy_version,
            mean_reward=self._reward_sum / sealed if sealed else 0.0,
            wall_s=round(wall, 3),
            rollouts_per_s=round(sealed / wall, 3) if wall else 0.0,
            model_calls_per_s=round(counts["policy.model_calls"] / wall, 3) if wall else 0.0,
            transcripts_sha256=digest,
            snapshots_published=metrics.published,
            snapshots_failed=metrics.failed,
            snapshots_skipped=metrics.skipped,
            pause_ms=metrics.pause_summary(),
            snapshot_steps_ms=metrics.phases_summary(),
            snapshot_bytes=metrics.bytes_summary(),
            restores=self.counts["restores"],
            rollouts_restored=self.counts["rollouts_restored"],
            rollouts_by_agent=by_agent,
            tool_calls_by_resources=by_resources,
        )

    async def _transcripts_digest(self) -> str:
        """One digest of every trained rollout's token ids (same seeds, same digest): each rollout's
        digest is added when the trainer receives it (TQ then drops its rows), in any order."""
        return hashlib.sha256(f"{self._sealed}:{self._transcripts:064x}".encode()).hexdigest()


def transcript_digest(row: CanonicalRow) -> int:
    """A rollout's id and tokens, turn by turn, as a 256-bit number."""
    h = hashlib.sha256(row.rollout_id.encode())
    for turn in row.turns:
        h.update(f"/{turn.turn}:{','.join(map(str, turn.token_ids))};".encode())
    return int.from_bytes(h.digest(), "big")
