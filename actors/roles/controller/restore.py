"""The restore at start: the restore sequence of ``protocol/snapshot.py``, step by step.

``RESTORE_STEPS`` maps every ``RestoreStep`` to its implementation (checked at import);
``RestoreSequence.restore_if_any`` walks ``RESTORE_SEQUENCE`` in order with one ``RestoreAttempt``. A
step may end the walk early: nothing to restore (a fresh start), or a trainer checkpoint without its
snapshot (its fallback marker is taken instead). A failure while participants hold the restore's id
(``restore_failure_aborts``) aborts that id everywhere, once, by this controller alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from parkway.actors.roles.controller.adopt import Continuation, SavedWork
from parkway.actors.roles.controller.fingerprints import fingerprint, live_topology, topology_of
from parkway.actors.roles.controller.host import SnapshotHost
from parkway.actors.roles.controller.metrics import SnapshotMetrics
from parkway.actors.roles.controller.participants import Participants
from parkway.actors.roles.controller.save import SaveSequence
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime import tracing
from parkway.actors.storage.runs import RunDirectory, newest_trainer_step
from parkway.actors.storage.select import NoValidSnapshot, SnapshotInvalid, select_snapshot
from parkway.actors.storage.trainer import read_trainer_checkpoint
from parkway.protocol.anchor import decode_ledger_file
from parkway.protocol.history import OrphanAborted, RestoreDone, RestoreFailed, RestoreFenced, RestoreStarted
from parkway.protocol.ids import Role, new_checkpoint_id, parse_address
from parkway.protocol.layout import LEDGER
from parkway.protocol.ledger import Ledger
from parkway.protocol.manifest import Manifest
from parkway.protocol.messages import (
    Abort,
    Capabilities,
    Discover,
    EpisodeRef,
    Error,
    Restore,
    Restored,
    Retire,
    StatusReport,
)
from parkway.protocol.placement import PlacementError, Topology, counts_of, saved_topology
from parkway.protocol.snapshot import (
    RESTORE_SEQUENCE,
    RestoreStep,
    SnapshotFailure,
    Stage,
    check_step_table,
    episode_mismatch,
    restore_failure_aborts,
    stage_name,
)

log = structlog.get_logger("parkway.snapshots")


@dataclass
class RestoreAttempt:
    """One restore, as its steps fill it in."""

    scope: contextlib.ExitStack  # the log context of the restore's id, from the moment it has one
    restore_id: str = ""
    path: Path = Path()  # the snapshot restored
    saved_topology: Topology | None = None  # its agents, tool servers, policies (None: an older one)
    manifest: Manifest | None = None
    deadline: float = 0.0
    continuation: Continuation | None = None
    outcome: bool | None = None  # set by a step that ends the walk: True restored, False start afresh
    orphans: dict[str, list[str]] = field(default_factory=dict)
    span: Any = None  # the restore's root span once it has an id, while tracing (docs/tracing.md)

    def fence(self) -> Retire:
        assert self.continuation is not None
        return Retire(
            checkpoint_id=f"{self.restore_id}-fence",
            deadline=self.deadline,
            attempts=self.continuation.fenced,
        )


class RestoreSequence:
    def __init__(
        self,
        host: SnapshotHost,
        config: RunConfig,
        run: RunDirectory,
        participants: Participants,
        metrics: SnapshotMetrics,
        saver: SaveSequence,
        config_fingerprint: str,
    ) -> None:
        self.host, self.config, self.run = host, config, run
        self.participants, self.metrics, self.saver = participants, metrics, saver
        self.config_fingerprint = config_fingerprint

    async def restore_if_any(self) -> bool:
        """Restore the newest valid snapshot of this run, if there is one. True when restored."""
        if self.run.completed_marker.exists():
            log.info("previous_run_completed", run_dir=str(self.run.path), action="starting afresh")
            self.run.start_afresh()
            return False
        with contextlib.ExitStack() as scope:
            attempt = RestoreAttempt(scope=scope)
            current = RESTORE_SEQUENCE[0].name
            try:
                for step in RESTORE_SEQUENCE:
                    current = step.name
                    self.host.faults.reach(f"restore_{step.name.value}")
                    await tracing.step(
                        step.name.value,
                        RESTORE_STEPS[step.name](self, attempt, step.stages),
                        parent=attempt.span,
                    )
                    if attempt.outcome is not None:
                        return attempt.outcome
            except SnapshotFailure as failure:
                if restore_failure_aborts(current):
                    await self._abort(attempt, failure)
                raise
        return True

    async def _abort(self, attempt: RestoreAttempt, failure: SnapshotFailure) -> None:
        # One owner cleans up a failed restore: this controller aborts the restore id everywhere,
        # once; nobody else resumes anything (NeMo resumed twice here).
        log.error("restore_failed", step=failure.step, detail=failure.detail)
        self.host.history.record(RestoreFailed(restore_id=attempt.restore_id, step=failure.step))
        await self.participants.abort_everywhere(attempt.restore_id, f"restore failed: {failure}")

    # -- the steps ------------------------------------------------------------------------------------
    async def end_orphans(self, attempt: RestoreAttempt, stages: tuple[Stage, ...]) -> None:
        """A controller that died mid-snapshot leaves live participants in its checkpoint (prepared,
        committed). This controller never owned that id: it aborts it everywhere before anything else,
        instead of waiting for the leases to lapse or failing the restore on a conflict."""
        for stage in stages:
            for address in self.participants.addresses(stage):
                reply = await self.participants.status(address, "orphans")
                if isinstance(reply, StatusReport) and reply.checkpoint_id and reply.phase != "idle":
                    attempt.orphans.setdefault(reply.checkpoint_id, []).append(address)
        for checkpoint_id, addresses in attempt.orphans.items():
            log.warning("orphaned_checkpoint", orphan=checkpoint_id, participants=addresses, action="abort")
            self.host.history.record(
                OrphanAborted(checkpoint_id=checkpoint_id, participants=tuple(addresses))
            )
            abort = Abort(
                checkpoint_id=checkpoint_id,
                deadline=time.time() + self.config.prepare_timeout_s,
                reason="the controller that started this checkpoint is gone",
            )
            for address in addresses:
                reply = await self.participants.request(address, abort)
                if isinstance(reply, Error):
                    # Nothing retries a start: the run ends here either way. Transient says whether
                    # starting again may help (the participant's refusal is retryable) or not.
                    raise SnapshotFailure(
                        "abort_orphan",
                        f"{address}: {reply.code.value}: {reply.detail}",
                        transient=reply.retryable,
                    )

    async def select(self, attempt: RestoreAttempt, _: tuple[Stage, ...]) -> None:
        trainer_step = newest_trainer_step(self.run.path)
        broken: list[str] = []
        selected = select_snapshot(
            self.run.path,
            config_fingerprint=self.config_fingerprint,
            trainer_step=trainer_step,
            broken=broken,
        )
        if selected is None and trainer_step is not None:
            attempt.outcome = await self._restore_fallback(trainer_step)
            return
        if selected is None and broken:
            # Starting afresh would silently drop every rollout those snapshots hold: say what is
            # wrong and let the user decide (fix the storage, or move them away).
            log.error("no_valid_snapshot", run_dir=str(self.run.path), problems=broken)
            raise NoValidSnapshot(
                f"no snapshot of run {self.host.run!r} verifies, so nothing can be restored and "
                "starting afresh would discard them: "
                + "; ".join(broken)
                + f". Check them with `parkway snapshots verify --run {self.host.run}`; to start "
                f"the run afresh, move them away from {self.run.path}"
            )
        if selected is None:
            attempt.outcome = False
            return
        attempt.path, attempt.manifest = selected
        attempt.restore_id = rid = new_checkpoint_id("rs")
        self.participants.began = time.time()
        attempt.scope.enter_context(structlog.contextvars.bound_contextvars(checkpoint_id=rid))
        saved_cid = attempt.manifest.checkpoint_id
        attempt.span = attempt.scope.enter_context(tracing.snapshot(rid, kind="restore", restores=saved_cid))
        log.info("restore_started", snapshot=attempt.path.name, saved_checkpoint=saved_cid)
        self.host.history.record(
            RestoreStarted(restore_id=rid, snapshot=attempt.path.name, saved_checkpoint_id=saved_cid)
        )

    async def discover(self, attempt: RestoreAttempt, stages: tuple[Stage, ...]) -> None:
        """The live topology must be the snapshot's, but for its numbers of agents, tool servers and
        policy replicas (a snapshot older than the manifest's ``replicas`` only onto its own)."""
        assert attempt.manifest is not None
        capabilities = []
        for stage in stages:
            replies = await self.participants.ask(
                stage,
                lambda _a: Discover(checkpoint_id=new_checkpoint_id("disc"), deadline=time.time() + 10),
                "discover",
            )
            capabilities += [r for r in replies.values() if isinstance(r, Capabilities)]
        live = [(str(c.role), c.replica) for c in capabilities]
        if not attempt.manifest.replicas:
            if fingerprint(topology_of(capabilities)) != attempt.manifest.topology_fingerprint:
                raise SnapshotInvalid(f"the live topology differs from the snapshot's: {live}")
            return
        try:
            attempt.saved_topology = saved = saved_topology(attempt.manifest.replicas, counts_of(live))
        except PlacementError as exc:
            raise SnapshotInvalid(f"{attempt.path.name} cannot be restored onto this cluster: {exc}") from exc
        now = live_topology(self.config)
        if saved != now:
            log.info(
                "restore_onto_another_topology",
                saved_agents=saved.agents,
                saved_resources=saved.resources,
                saved_policies=saved.policies,
                agents=now.agents,
                resources=now.resources,
                policies=now.policies,
            )

    async def restore_ledger(self, attempt: RestoreAttempt, _: tuple[Stage, ...]) -> None:
        assert attempt.manifest is not None
        attempt.deadline = time.time() + self.config.prepare_timeout_s
        record = decode_ledger_file((attempt.path / LEDGER).read_bytes())
        ledger = Ledger.load(record.ledger)
        saved, restarts = attempt.manifest.saved_episodes(), attempt.manifest.restart_episodes()
        mismatch = episode_mismatch(saved - restarts, ledger.dispatched() - restarts)
        if mismatch:
            raise SnapshotInvalid(f"{attempt.path.name}: saved episodes differ from its ledger: {mismatch}")
        # Rollouts a restart-only participant could not save restart from their prompt.
        attempt.continuation = self.host.adopt(
            ledger, record.controller, SavedWork(episodes=saved - restarts, topology=attempt.saved_topology)
        )

    async def restore_participants(self, attempt: RestoreAttempt, stages: tuple[Stage, ...]) -> None:
        """Agents first: they stop whatever the fresh processes picked up from the dead cluster's
        queues; then the attempts the snapshot had running are fenced everywhere."""
        assert attempt.continuation is not None
        rid, deadline, location = attempt.restore_id, attempt.deadline, attempt.path.name
        scope, epoch = attempt.continuation.continued, attempt.continuation.epoch
        keep_prefixes = self.config.recovery.target_level == "prefix"
        continuation = attempt.continuation

        def restore(address: str) -> Restore:
            role, replica = parse_address(address)
            episodes: tuple[EpisodeRef, ...] = scope
            sources: tuple[int, ...] | None = None
            if role in (Role.AGENT, Role.RESOURCES, Role.POLICY):
                episodes, sources = continuation.scope_of(Role(role), replica)
            return Restore(
                checkpoint_id=rid,
                deadline=deadline,
                location=location,
                episodes=episodes,
                epoch=epoch,
                keep_prefixes=keep_prefixes,
                sources=sources,
            )

        restored: set[tuple[str, int]] = set()
        for stage in stages:
            replies = await self.participants.ask(stage, restore, "restore")
            for address, reply in replies.items():
                if isinstance(reply, Restored) and parse_address(address)[0] == Role.AGENT:
                    restored.update((r.rollout_id, r.attempt) for r in reply.rollouts)
            self.host.faults.reach(f"after_restore_{stage_name(stage)}")
        missing = {(e.rollout_id, e.attempt) for e in scope} - restored
        if missing:
            # Every continued rollout's transcript must have been found by the agent that runs it now
            # (a snapshot whose agent records lack one is not restored with a hole in it): the restore
            # is aborted everywhere, like any participant's refusal in this step.
            raise SnapshotFailure(
                "restore",
                f"{location}: no agent restored {sorted(missing)[:8]} ({len(missing)})",
                transient=False,
            )

    async def fence(self, attempt: RestoreAttempt, stages: tuple[Stage, ...]) -> None:
        fence = attempt.fence()
        for stage in stages:
            await self.participants.ask(stage, lambda _a: fence, "fence")

    async def restore_tq(self, attempt: RestoreAttempt, stages: tuple[Stage, ...]) -> None:
        """TQ last, so that nothing generated before the fence survives in it."""
        assert attempt.continuation is not None
        rid, deadline, location = attempt.restore_id, attempt.deadline, attempt.path.name
        epoch = attempt.continuation.epoch
        for stage in stages:
            await self.participants.ask(
                stage,
                lambda _a: Restore(checkpoint_id=rid, deadline=deadline, location=location, epoch=epoch),
                "restore_tq",
            )

    async def fence_tq(self, attempt: RestoreAttempt, stages: tuple[Stage, ...]) -> None:
        """After its restore, which drops the old fences. From here on attempt N of every restored
        rollout is fenced on every participant (TQ's store replaced by the snapshot's), and attempt
        N+1 exists."""
        assert attempt.continuation is not None and attempt.manifest is not None
        await self.fence(attempt, stages)
        continuation = attempt.continuation
        self.host.history.record(
            RestoreFenced(
                restore_id=attempt.restore_id,
                snapshot=attempt.path.name,
                saved_checkpoint_id=attempt.manifest.checkpoint_id,
                epoch=continuation.epoch,
                attempts=tuple((f.rollout_id, f.attempt) for f in continuation.fenced),
                continued=tuple((e.rollout_id, e.attempt, e.replica) for e in continuation.continued),
            )
        )
        self.host.faults.reach("after_restore_tq")

    async def resume(self, attempt: RestoreAttempt, stages: tuple[Stage, ...]) -> None:
        # Once, by this owner only.
        await self.participants.resume_all(attempt.restore_id, stages, deadline=attempt.deadline)

    async def finish_seals(self, attempt: RestoreAttempt, _: tuple[Stage, ...]) -> None:
        finished = await self.host.finish_seals()
        if finished:
            log.info("restore_finished_seals", attempts=finished)

    async def open_gate(self, attempt: RestoreAttempt, _: tuple[Stage, ...]) -> None:
        assert attempt.continuation is not None
        self.host.open_gate()  # (open since the start: nothing was dispatched before the restore)
        self.metrics.restores += 1
        self.host.metrics.restored()
        self.metrics.rollouts_restored += len(attempt.continuation.continued)
        assert attempt.manifest is not None
        self.metrics.streak.published(attempt.path.name, attempt.manifest.created_at)  # the newest snapshot
        await self.saver.remember_progress()
        log.info("restore_done", snapshot=attempt.path.name, continued=len(attempt.continuation.continued))
        self.host.history.record(RestoreDone(restore_id=attempt.restore_id, snapshot=attempt.path.name))

    async def _restore_fallback(self, step: int) -> bool:
        """The newest trainer checkpoint has no snapshot: use its fallback marker."""
        anchor, state = read_trainer_checkpoint(self.run, step)
        log.warning(
            "restore_from_fallback_marker",
            trainer_step=step,
            detail="no snapshot matches the newest trainer checkpoint: unfinished groups restart",
        )
        self.host.adopt_fallback(anchor, state)
        self.metrics.restores += 1
        self.host.metrics.restored()
        await self.saver.remember_progress()
        return True


RestoreStepImplementation = Callable[[RestoreSequence, RestoreAttempt, tuple[Stage, ...]], Awaitable[None]]

RESTORE_STEPS: dict[RestoreStep, RestoreStepImplementation] = {
    RestoreStep.END_ORPHANS: RestoreSequence.end_orphans,
    RestoreStep.SELECT: RestoreSequence.select,
    RestoreStep.DISCOVER: RestoreSequence.discover,
    RestoreStep.RESTORE_LEDGER: RestoreSequence.restore_ledger,
    RestoreStep.RESTORE_PARTICIPANTS: RestoreSequence.restore_participants,
    RestoreStep.FENCE_PARTICIPANTS: RestoreSequence.fence,
    RestoreStep.RESTORE_TQ: RestoreSequence.restore_tq,
    RestoreStep.FENCE_TQ: RestoreSequence.fence_tq,
    RestoreStep.RESUME: RestoreSequence.resume,
    RestoreStep.FINISH_SEALS: RestoreSequence.finish_seals,
    RestoreStep.OPEN_GATE: RestoreSequence.open_gate,
}
check_step_table(RESTORE_SEQUENCE, RESTORE_STEPS)
