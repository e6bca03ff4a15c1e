"""The controller: the only coordinator of a run.

It owns the recovery ledger (``protocol/ledger.py``), the admission gate in front of dispatch, the
ACK outbox and the trainer hook. It forms prompt groups of G siblings from the tasks, dispatches
``Run`` to agent replicas (never more than ``rollout.max_in_flight`` at once; a reserved attempt that
waits for the gate is not running), seals ``Completed`` receipts, handles ``Failed`` by the group's
granularity, acknowledges receipts in batches, and hands settled groups to the trainer.

This module is the actor and its run loop; each of those jobs is one object of its own (``dispatch``,
``receipts``, ``outbox``, ``training``, ``cluster``, ``snapshots``), and the snapshots reach this one
only through ``host.SnapshotHost``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import anyio
import structlog
from parkway.actors.roles.controller.adopt import (
    Continuation,
    SavedWork,
    adopt_fallback,
    adopt_snapshot,
    begin_session,
)
from parkway.actors.roles.controller.cluster import (
    AgentLiveness,
    participant_addresses,
    restart_only_participants,
)
from parkway.actors.roles.controller.dispatch import Dispatcher
from parkway.actors.roles.controller.errors import SetupError, SimulatedCrash
from parkway.actors.roles.controller.forget import Forgetting
from parkway.actors.roles.controller.gate import AdmissionGate
from parkway.actors.roles.controller.metrics import SnapshotMetrics
from parkway.actors.roles.controller.outbox import AckOutbox
from parkway.actors.roles.controller.receipts import Receipts
from parkway.actors.roles.controller.retire import Retirement
from parkway.actors.roles.controller.save import Published
from parkway.actors.roles.controller.sizes import controller_sizes
from parkway.actors.roles.controller.snapshots import (
    SnapshotCoordinator,
    settle_cut_off_abort,
    stop_between_saves,
    take_requested,
)
from parkway.actors.roles.controller.state import RunState
from parkway.actors.roles.controller.summary import (
    RunSummary,
    participant_counts,
    served_before,
    summarize,
)
from parkway.actors.roles.controller.training import TRAINER, TrainingHook, inline_trainer
from parkway.actors.run.config import RunConfig
from parkway.actors.run.tasks import Task
from parkway.actors.runtime import collection
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.settings import cluster_wait_s
from parkway.actors.sdk.trainer import Trainer
from parkway.protocol.anchor import ControllerAnchor, LedgerFile
from parkway.protocol.history import RunAborted, RunFinished, RunStarted
from parkway.protocol.ids import Role, rollout_id
from parkway.protocol.ledger import Ledger
from parkway.protocol.messages import Completed, Failed, Message, Snapshot, StatusReport
from parkway.protocol.snapshot import SnapshotFailure

# Importable from here, where callers have always found them.
__all__ = ["Controller", "RunSummary", "SetupError", "SimulatedCrash"]

log = structlog.get_logger("parkway.controller")


class Controller(Actor):
    role = Role.CONTROLLER
    prefetch = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._snapshot_lock = asyncio.Lock()  # one save at a time: periodic or asked for
        self.metrics.snapshot_metrics()
        self.state = RunState()
        self.gate = AdmissionGate()
        self._wake = asyncio.Event()  # something changed: the run loop looks again
        self.outbox = AckOutbox(self.client, self.counts, self.history)
        self.forgetting = Forgetting(self.client, self.counts, self._participants)  # sealed, acked: forgotten
        self.outbox.on_acked = self.forgetting.acked
        self.forgetting.on_forget.append(self.outbox.forget)
        self.retirement = Retirement(self.client, self.state, self.counts)
        self.receipts = Receipts(
            client=self.client,
            state=self.state,
            counts=self.counts,
            history=self.history,
            outbox=self.outbox,
            retirement=self.retirement,
            wake=self._wake.set,
            forgetting=self.forgetting,
        )
        self.handlers.update(
            {Completed: self.receipts.completed, Failed: self.receipts.failed, Snapshot: self.on_snapshot}
        )
        self.liveness = AgentLiveness(
            self.client, self.state, self.counts, self.history, self.retirement, self._wake.set
        )
        self._acks: asyncio.Task[None] | None = None  # the outbox's, once started
        self._forgets: asyncio.Task[None] | None = None  # the Forget flusher's, once started
        self._dispatcher: Dispatcher | None = None  # the running workload's
        self.snapshots: SnapshotCoordinator | None = None
        self.stage = "starting"  # what the workload is doing, for progress lines
        self.holds: dict[str, int] = {}  # rollout -> turn its first attempt parks at for good (the demo)
        self.restart_only: set[str] = set()  # participants that cannot save a rollout mid-way
        self.run_started_at: float | None = None  # monotonic, at the first dispatch
        self._config: RunConfig | None = None
        self._tasks: list[Task] = []
        self._expected = 0
        self.session_start = "new"  # new, continued (a snapshot restored) or afresh (new ids)

    def timeline(self) -> int:  # receipts of an older epoch (wired or with a cut) are the dead timeline's
        return self.state.epoch if self.state.epoch > 1 else 0  # (a fresh run, epoch 1, knows no older one)

    async def start(self) -> None:
        await super().start()
        # Acks go out whether or not a workload runs: an agent's receipt is answered even then.
        self._acks = asyncio.get_running_loop().create_task(self.outbox.run())
        self._forgets = asyncio.get_running_loop().create_task(self.forgetting.run())

    async def stop(self) -> None:
        await super().stop()
        await self.receipts.stop()
        for task in (self._acks, self._forgets):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _participants(self) -> list[str]:
        """Where a Forget goes: every participant of the running workload (none before one)."""
        return participant_addresses(self._config) if self._config is not None else []

    def structure_sizes(self) -> dict[str, int]:
        metrics = self.snapshots.metrics if self.snapshots is not None else None
        sizes = controller_sizes(self.state, self.outbox, self.forgetting, self._dispatcher, metrics)
        return {**super().structure_sizes(), **sizes}

    # -- what the snapshots may do (host.SnapshotHost) ----------------------------------------------
    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    @ledger.setter
    def ledger(self, ledger: Ledger) -> None:
        self.state.ledger = ledger

    @property
    def seals(self) -> int:
        return self.receipts.seals

    @property
    def gate_open(self) -> bool:
        return self.gate.is_open

    def close_gate(self) -> None:
        self.gate.close()

    def open_gate(self) -> None:
        self.gate.open()
        self._wake.set()
        collection.window_ended()  # a full collection that is due runs now, after the window

    def in_window(self) -> bool:
        return not self.gate.is_open

    def paused_s(self) -> float:
        return self.gate.paused_s()

    async def flush_acks(self) -> None:
        await self.outbox.flush()

    async def retire_pending(self) -> None:
        await self.retirement.retire_pending()

    def observe(self, address: str, report: StatusReport) -> bool:
        return self.liveness.observe(address, report)

    async def finish_seals(self) -> int:
        return await self.receipts.finish_restored()

    async def wait_for_receipts(self, timeout_s: float) -> None:
        self._wake.clear()
        with anyio.move_on_after(timeout_s):
            await self._wake.wait()

    def receipts_with_cut(self, replica: int, receipts: tuple[Completed, ...]) -> None:
        self.receipts.with_cut(replica, (r for r in receipts if r.epoch >= self.timeline()))

    def export_ledger(self) -> LedgerFile:
        return LedgerFile(ledger=self.state.ledger.export(), controller=self.state.anchor(self.counts))

    def adopt(self, ledger: Ledger, anchor: ControllerAnchor, saved: SavedWork) -> Continuation:
        assert self._config is not None
        return adopt_snapshot(
            self.state,
            ledger,
            anchor,
            config=self._config,
            task_count=len(self._tasks),
            counts=self.counts,
            restart_only=self.restart_only,
            saved=saved,
        )

    def adopt_fallback(self, anchor: ControllerAnchor, trainer_state: dict[str, Any]) -> None:
        """The trainer follows at the run's start (``TrainingHook.sync``: to the marker's step)."""
        assert self._config is not None
        adopt_fallback(
            self.state, anchor, config=self._config, task_count=len(self._tasks), counts=self.counts
        )
        self.state.policy_version = int(trainer_state["policy_version"])
        self.state.training = None  # a marker is written between steps: nothing was in flight

    # -- the workload --------------------------------------------------------------------------------
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
                self.history.record(RunAborted(error=f"{type(exc).__name__}: {exc}"))
                raise
            log.info(
                "run_finished",
                rollouts_sealed=summary.rollouts_sealed,
                rollouts_failed=summary.rollouts_failed,
                wall_s=summary.wall_s,
            )
            self.history.record(
                RunFinished(
                    sealed=summary.rollouts_sealed,
                    failed=summary.rollouts_failed,
                    expected=summary.rollouts_expected,
                    transcripts_sha256=summary.transcripts_sha256,
                )
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
        self._config, self._tasks = config, tasks
        # The trainer actor: in this process (given a Trainer object, or ``trainer.host: inline``),
        # or a ``parkway actor trainer`` service that must answer like every participant.
        hosted = await inline_trainer(self.broker, self.client.keyring, config, trainer, snapshot_root)
        try:
            return await self._run_hosting_trainer(
                config, tasks, hosted is not None, snapshot_root, stop_after_snapshots
            )
        finally:
            if hosted is not None:
                await hosted.stop()

    async def _run_hosting_trainer(
        self,
        config: RunConfig,
        tasks: list[Task],
        inline: bool,
        snapshot_root: Path | None,
        stop_after_snapshots: int | None,
    ) -> RunSummary:
        self.retirement.config = config
        self.receipts.tq_shards = config.topology.tq_shards
        self.receipts.agents = config.topology.agents
        self.forgetting.bound_by(config.rollout.max_in_flight)
        dispatcher = Dispatcher(
            client=self.client,
            state=self.state,
            gate=self.gate,
            counts=self.counts,
            history=self.history,
            outbox=self.outbox,
            retirement=self.retirement,
            config=config,
            tasks=tasks,
            holds=self.holds,
        )
        self._dispatcher = dispatcher
        self.forgetting.on_forget.append(dispatcher.forget)
        expected = len(tasks) * config.rollout.group_size
        self._expected = expected
        self.stage = "waiting for the cluster"
        await self.wait_for_cluster(config, cluster_wait_s(), trainer=not inline)
        await self.check_restart_only(config)
        self.snapshots = (
            SnapshotCoordinator(self, config, snapshot_root) if snapshot_root is not None else None
        )
        training = TrainingHook(
            self.client,
            self.state,
            self.counts,
            self._snapshot_lock,
            config,
            len(tasks),
            self.snapshots,
            self._wake.set,
        )
        self.stage = "restoring"
        restored = self.snapshots is not None and await self.snapshots.restore_if_any()
        self.stage = "running"
        # What every participant has done so far: the summary counts this session's work only.
        baseline = await participant_counts(self.client, config)
        session = "continued"
        if not restored:
            self.state.ledger = Ledger(max_attempts=config.rollout.max_attempts)
            self.state.next_task = 0
            session = begin_session(self.state, served_before(baseline))
        self.session_start = session
        log.info(
            "run_started",
            restored=restored,
            session=session,
            session_tag=self.state.session,
            epoch=self.state.epoch,
            rollouts_expected=expected,
            groups_left=len(self.state.ledger.groups) + len(tasks) - self.state.next_task,
            snapshots=self.snapshots is not None,
        )
        await training.sync()  # the trainer goes to the restored step (0 on a fresh start)
        self.history.record(run_started(self.state, len(tasks), config.rollout.group_size, restored))
        started = time.monotonic()  # the clock runs from the first dispatch, not from cluster start-up
        self.run_started_at = started
        loop = asyncio.get_running_loop()
        background: list[asyncio.Task[None]] = []
        crash: asyncio.Future[None] = loop.create_future()
        background.append(loop.create_task(self._watch_agents(config, dispatcher, crash)))
        if self.snapshots is not None:  # the last task started: the run's end stops it between saves
            background.append(loop.create_task(self._snapshot_loop(config, stop_after_snapshots, crash)))
        try:
            while dispatcher.has_work() or training.busy:  # a last step may still checkpoint
                if crash.done():
                    crash.result()
                dispatcher.admit_groups()
                await dispatcher.dispatch_ready()
                training.train_ready()
                if not dispatcher.has_work() and not training.busy:
                    break
                self._wake.clear()
                waiter = loop.create_task(self._wake.wait())
                awaited: set[asyncio.Future[Any]] = {waiter, crash}
                await asyncio.wait(awaited, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            await self.outbox.flush()
            # What ended is forgotten before the summary (one try each: a participant that is down
            # does not hold the end of the run up; it bounds what it holds by itself).
            await self.forgetting.flush(tries=1)
            if self.snapshots is not None:
                await stop_between_saves(background[-1], self._snapshot_lock)
                if crash.done():  # the last save crashed it (a test's crash point) as it ended
                    crash.result()
                await self.snapshots.settle_abort()
                await self.snapshots.mark_completed()
        finally:
            self.forgetting.on_forget.remove(dispatcher.forget)
            await training.stop()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await settle_cut_off_abort(self.snapshots)
        wall = time.monotonic() - started
        self.stage = "summing up"
        return await summarize(
            self.client,
            config,
            expected=expected,
            wall=wall,
            state=self.state,
            counts=self.counts,
            metrics=self.snapshots.metrics if self.snapshots is not None else SnapshotMetrics(),
            baseline=baseline,
            session=session,
        )

    def status_extras(self) -> dict[str, Any]:
        """``parkway status`` and the heartbeat: how the snapshots stand (newest, last failure)."""
        return {"snapshots": self.snapshots.health()} if self.snapshots is not None else {}

    def progress(self) -> dict[str, Any]:
        """Where the workload stands, cheaply: for a progress line, never for decisions."""
        return workload_progress(self)

    async def wait_for_cluster(
        self, config: RunConfig, timeout: float = 120.0, *, trainer: bool = False
    ) -> None:
        """Every participant (and a trainer service) answers Status before the first dispatch (a
        missing one is named)."""
        await self.liveness.wait_for_cluster(config, timeout, extra=(TRAINER,) if trainer else ())

    async def check_restart_only(self, config: RunConfig) -> None:
        """Name the participants that cannot save a rollout mid-way (``cluster.restart_only_participants``)."""
        self.restart_only = await restart_only_participants(self.client, config)

    async def _watch_agents(
        self, config: RunConfig, dispatcher: Dispatcher, crash: asyncio.Future[None], every_s: float = 1.0
    ) -> None:
        """Every second: agent replicas that came back as new processes, and stalled rollouts."""
        try:
            while True:
                await asyncio.sleep(every_s)
                await self.liveness.poll(config.topology.agents)
                await dispatcher.check_stalls(self.receipts.fail)
        except Exception as exc:
            if not crash.done():
                crash.set_exception(exc)

    # -- snapshots -----------------------------------------------------------------------------------
    async def _snapshot_loop(
        self, config: RunConfig, stop_after: int | None, crash: asyncio.Future[None]
    ) -> None:
        assert self.snapshots is not None
        try:
            while True:
                # The interval, or after failures a back-off: the rollouts go on meanwhile.
                await asyncio.sleep(self.snapshots.next_wait_s())
                await self.take_snapshot(stop_after)
        except Exception as exc:  # surfaced in the run loop: a run never ends silently
            if not crash.done():
                crash.set_exception(exc)

    async def take_snapshot(self, stop_after: int | None = None) -> Published | None:
        """One snapshot now: what it published, or None (skipped, failed, or ``stop_after`` reached).
        A transient failure is retried after a back-off (it ends the run only as ``snapshots.*``
        configures); an invariant violation ends the run at once, naming what broke."""
        assert self.snapshots is not None and self._config is not None
        if stop_after is not None and self.snapshots.metrics.published >= stop_after:
            return None
        if stop_after is not None and self.snapshots.metrics.published + 1 == stop_after:
            self.snapshots.on_published = crash_now
        try:
            async with self._snapshot_lock:
                outcome = await self.snapshots.save()
        except SnapshotFailure as failure:
            self.snapshots.check_failure(failure)
            return None
        return outcome if isinstance(outcome, Published) else None

    async def on_snapshot(self, request: Snapshot) -> Message:
        """``parkway snapshot``: one snapshot now, answered with what was published."""
        running = self.snapshots if self._config is not None else None
        return await take_requested(running, self._snapshot_lock, request)


def crash_now(published: Published) -> None:
    """``stop_after_snapshots``' hook: the process stops dead right after that snapshot is published."""
    raise SimulatedCrash(f"stopped right after publishing {published.name}")


def run_started(state: RunState, groups: int, group_size: int, restored: bool) -> RunStarted:
    """The history record of a session's start: every rollout it is to seal."""
    expected = tuple(rollout_id(state.group_id(i), g) for i in range(groups) for g in range(group_size))
    return RunStarted(restored=restored, epoch=state.epoch, expected=expected)


def workload_progress(controller: Controller) -> dict[str, Any]:
    """``Controller.progress``."""
    metrics = controller.snapshots.metrics if controller.snapshots is not None else None
    return {
        "stage": controller.stage,
        "expected": controller._expected,
        "sealed": controller.counts["rollouts_sealed"],
        "failed": controller.counts["rollouts_failed"],
        "running": len(controller.state.ledger.dispatched()),
        "train_steps": controller.counts["train_steps"],
        "snapshots": metrics.published if metrics else 0,
        "last_pause_ms": metrics.pause_ms[-1] if metrics and metrics.pause_ms else None,
        "restored": metrics.rollouts_restored if metrics else 0,
        "elapsed_s": time.monotonic() - controller.run_started_at
        if controller.run_started_at is not None
        else 0.0,
    }
