"""Coordinated snapshots and restore: the controller's side of SPEC sections 6 to 8.

The order of the steps is data (``protocol/snapshot.py``); each step is one method here. Files:

    <root>/<run>/snapshot_<seq>/manifest.json        schema, checkpoint id, trainer anchor, fingerprints,
                                                     per-file digests, saved episodes
                               /ledger.msgpack       the recovery ledger and the trainer's anchor
                               /tq/                  TQ's staging, canonical and lineage rows
                               /participants/<role>/<replica>/   each participant's records

What is on disk is read (and every problem of a snapshot found) by ``storage.inventory``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from parkway.actors.storage.inventory import (
    MANIFEST_SCHEMA,
    RESTORE_KINDS,
    check_snapshot,
    list_snapshots,
    may_be_this_work,
    missing_staging_keys,
    newest_trainer_step,
    read_manifest,
    sha256_file,
    skip_reason,
)
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ErrorCode
from parkway.protocol.ids import actor_address, new_checkpoint_id
from parkway.protocol.ledger import Ledger
from parkway.protocol.messages import (
    Abort,
    Capabilities,
    Commit,
    Committed,
    Discover,
    EpisodeRef,
    Error,
    Message,
    Prepare,
    Prepared,
    Renew,
    Restore,
    Resume,
    Retire,
    Status,
    StatusReport,
)
from parkway.protocol.snapshot import (
    SAVE_SEQUENCE,
    SaveStep,
    SnapshotFailure,
    episode_mismatch,
)

if TYPE_CHECKING:
    from parkway.actors.roles.controller.controller import Controller
    from parkway.actors.run.config import RunConfig

log = structlog.get_logger("parkway.snapshots")

RESUME_RETRIES = 5


class SnapshotInvalid(Exception):
    """A snapshot on disk that does not verify; the message says exactly what is wrong."""


class NoValidSnapshot(SnapshotInvalid):
    """Snapshots of this work are on disk and none verifies: a start refuses to begin afresh over them
    (that would silently throw their rollouts away); the message names each one and what is wrong."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_fingerprint(config: RunConfig) -> str:
    """What a snapshot depends on: the work and its identities, not tuning (intervals, hosts, timeouts)."""
    r = config.rollout
    return fingerprint(
        {
            "run": config.run,
            "seed": config.seed,
            "agent": config.agent,
            "tasks": msgspec.to_builtins(config.tasks),
            "rollout": [r.group_size, r.max_turns, r.max_tokens],
            "topology": msgspec.to_builtins(config.topology),
            "resources": config.resources.mode,
            "engine": config.policy.engine,
        }
    )


def topology_of(capabilities: list[Capabilities]) -> list[dict[str, Any]]:
    """Who takes part, sorted; restart-only flags are excluded (they may change between runs)."""
    return sorted(
        ({"role": c.role, "replica": c.replica} for c in capabilities),
        key=lambda d: (d["role"], d["replica"]),
    )


def verify_snapshot(directory: Path) -> dict[str, Any]:
    """The manifest of a snapshot whose manifest reads and fits its schema and whose every listed file
    exists with its size and sha256. Raises ``SnapshotInvalid`` with the first problem found
    (``storage.inventory.check_snapshot`` lists them all)."""
    problems = [p for p in check_snapshot(directory, deep=False) if p.kind in RESTORE_KINDS]
    if problems:
        raise SnapshotInvalid(problems[0].message)
    return json.loads((directory / "manifest.json").read_text())


def select_snapshot(
    run_dir: Path,
    *,
    config_fingerprint: str,
    trainer_step: int | None = None,
    broken: list[str] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest snapshot that verifies, belongs to this configuration and (when the trainer has
    checkpoints) is anchored at the newest one; corrupt ones are skipped with a warning naming them
    (the one before stays authoritative). ``broken`` collects what is wrong with each skipped one
    that may hold this configuration's work."""
    for _, path in reversed(list_snapshots(run_dir)):
        try:
            manifest = verify_snapshot(path)
        except SnapshotInvalid as exc:
            log.warning("snapshot_skipped", snapshot=path.name, reason=str(exc))
            if broken is not None and may_be_this_work(read_manifest(path)[0], config_fingerprint):
                broken.append(str(exc))
            continue
        reason = skip_reason(manifest, config_fingerprint=config_fingerprint, trainer_step=trainer_step)
        if reason is not None:
            other_work = manifest["config_fingerprint"] != config_fingerprint
            (log.warning if other_work else log.info)("snapshot_skipped", snapshot=path.name, reason=reason)
            continue
        return path, manifest
    return None


@dataclass
class SnapshotMetrics:
    published: int = 0
    failed: int = 0
    skipped: int = 0
    consecutive_failures: int = 0
    pause_ms: list[float] = field(default_factory=list)
    phases_ms: dict[str, list[float]] = field(default_factory=dict)
    restores: int = 0
    rollouts_restored: int = 0
    # One entry per published snapshot: pause_ms, rollouts (saved), parked, bytes (written),
    # park_wait_ms (the longest an agent waited for its rollouts to reach a boundary), steps_ms.
    records: list[dict[str, Any]] = field(default_factory=list)

    def pause_summary(self) -> dict[str, float]:
        return percentiles(self.pause_ms)

    def phases_summary(self) -> dict[str, float]:
        """The median duration of each save step, in milliseconds."""
        return {step: percentiles(values)["p50"] for step, values in self.phases_ms.items()}

    def bytes_summary(self) -> dict[str, float]:
        """Bytes each published snapshot wrote (every file and the manifest): p50, p95, max."""
        return percentiles([float(r["bytes"]) for r in self.records])


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "max": 0.0}
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 99
    return {"p50": round(q[49], 3), "p95": round(q[94], 3), "max": round(ordered[-1], 3)}


class SnapshotCoordinator:
    """Takes snapshots for one controller and restores the newest one at start."""

    def __init__(self, controller: Controller, config: RunConfig, root: Path) -> None:
        self.controller = controller
        self.config = config
        self.run_dir = root / controller.run
        self.metrics = SnapshotMetrics()
        self.config_fingerprint = config_fingerprint(config)
        self._last_progress: tuple[Any, ...] | None = None
        self.on_published: Callable[[Path], None] | None = None  # a test hook
        self._began = 0.0  # when the snapshot (or restore) in progress began: a process started since is new

    # -- who -----------------------------------------------------------------------------------------
    def addresses(self, stage: str) -> list[str]:
        """A stage's participants: one role's replicas, or several roles asked at once (``resources+tq``)."""
        return [address for role in stage.split("+") for address in self._replicas(role)]

    def _replicas(self, role: str) -> list[str]:
        count = {
            "tq": 1,
            "policy": 1,
            "resources": self.config.topology.resources,
            "agent": self.config.topology.agents,
        }[role]
        return [actor_address(role, i) for i in range(count)]

    async def _ask(self, stage: str, make: Callable[[str], Message], step: str) -> dict[str, Message]:
        addresses = self.addresses(stage)
        replies = await asyncio.gather(
            *(self._request(a, make(a)) for a in addresses), return_exceptions=True
        )
        answered: dict[str, Message] = {}
        for address, reply in zip(addresses, replies, strict=True):
            if isinstance(reply, BaseException):
                raise SnapshotFailure(step, f"{address}: {reply}", transient=True)
            if isinstance(reply, Error):
                detail, transient = f"{address}: {reply.code.value}: {reply.detail}", reply.retryable
                if reply.code is ErrorCode.STALE_CHECKPOINT:
                    # It ended this id on its own: its lease lapsed while this controller was slow (or
                    # stopped). A timeout, which the next snapshot retries.
                    detail, transient = f"{detail} (its lease lapsed)", True
                elif reply.code is ErrorCode.INVALID_PHASE and await self._restarted(address):
                    # Not a broken protocol: a new process that never saw this checkpoint (the one that
                    # did may even have journaled its reply). A later snapshot fixes it.
                    detail, transient = f"{detail} (it restarted during the snapshot)", True
                raise SnapshotFailure(step, detail, transient=transient)
            answered[address] = reply
        return answered

    async def _restarted(self, address: str) -> bool:
        """Whether ``address`` is a process that started after this snapshot (or restore) began."""
        try:
            reply = await self._request(
                address, Status(checkpoint_id=new_checkpoint_id("alive"), deadline=time.time() + 5)
            )
        except SnapshotFailure:
            return False
        if not isinstance(reply, StatusReport):
            return False
        if reply.role == "agent":
            self.controller.observe(address, reply)  # a new process: its lost rollouts start again
        return reply.started_at >= self._began

    async def _request(self, address: str, message: Message) -> Message:
        try:
            return await self.controller.client.request(address, message)
        except BrokerError as exc:
            raise SnapshotFailure("request", f"{address}: {exc}", transient=True) from exc

    async def end_orphaned_checkpoints(self) -> list[str]:
        """A controller that died mid-snapshot leaves live participants in its checkpoint (prepared,
        committed). This controller never owned that id: it aborts it everywhere before anything else,
        instead of waiting for the leases to lapse or failing the restore on a conflict. Returns the
        ids aborted."""
        orphans: dict[str, list[str]] = {}
        for role in ("agent", "policy", "resources", "tq"):
            for address in self.addresses(role):
                reply = await self._request(
                    address, Status(checkpoint_id=new_checkpoint_id("orphans"), deadline=time.time() + 5)
                )
                if isinstance(reply, StatusReport) and reply.checkpoint_id and reply.phase != "idle":
                    orphans.setdefault(reply.checkpoint_id, []).append(address)
        for checkpoint_id, addresses in orphans.items():
            log.warning("orphaned_checkpoint", orphan=checkpoint_id, participants=addresses, action="abort")
            self.controller.history.record("orphan_aborted", cid=checkpoint_id, participants=addresses)
            abort = Abort(
                checkpoint_id=checkpoint_id,
                deadline=time.time() + self.config.prepare_timeout_s,
                reason="the controller that started this checkpoint is gone",
            )
            for address in addresses:
                reply = await self._request(address, abort)
                if isinstance(reply, Error):
                    # Nothing retries a start: the run ends here either way. Transient says whether
                    # starting again may help (the participant's refusal is retryable) or not.
                    raise SnapshotFailure(
                        "abort_orphan",
                        f"{address}: {reply.code.value}: {reply.detail}",
                        transient=reply.retryable,
                    )
        return sorted(orphans)

    # -- save ------------------------------------------------------------------------------------------
    async def _progress(self) -> tuple[Any, ...]:
        """What a snapshot would capture, in counters: the boundaries agents passed (turns move without
        any ledger or TQ change) and the ledger's own movement."""
        boundaries = 0
        for address in self.addresses("agent"):
            reply = await self._request(
                address, Status(checkpoint_id=new_checkpoint_id("progress"), deadline=time.time() + 5)
            )
            if isinstance(reply, StatusReport):
                boundaries += reply.counts.get("boundaries", 0)
                self.controller.observe(address, reply)
        counts = self.controller.counts
        return (
            boundaries,
            counts["attempts_dispatched"],
            counts["rollouts_sealed"],
            counts["attempts_failed"],
            counts["train_steps"],
            len(self.controller.ledger.groups),
        )

    async def save(self, *, force: bool = False, checkpoint_id: str | None = None) -> Path | None:
        """One snapshot attempt: the path published, or None when skipped. Raises SnapshotFailure.
        ``force`` takes it even when nothing moved (a trainer checkpoint needs its own snapshot);
        ``checkpoint_id`` names it (``parkway snapshot --checkpoint-id``), a fresh id otherwise."""
        cid = checkpoint_id or new_checkpoint_id("ck")
        self._began = time.time()
        seq = (list_snapshots(self.run_dir)[-1][0] + 1) if list_snapshots(self.run_dir) else 1
        tmp = self.run_dir / f"tmp_{cid}"
        deadline = time.time() + self.config.prepare_timeout_s
        state: dict[str, Any] = {
            "force": force,
            "cid": cid,
            "seq": seq,
            "tmp": tmp,
            "deadline": deadline,
            "files": [],
            "episodes": set(),
            "restarts": set(),
            "parked": 0,
            "boundaries": 0,
            "park_wait_s": 0.0,
            "bytes": 0,
            "steps_ms": {},
        }
        started = time.perf_counter()
        history = self.controller.history
        paused_before = (
            self.controller.paused_s()
        )  # the gate's own clock measures the admission-closed window
        reached: list[SaveStep] = []
        with structlog.contextvars.bound_contextvars(checkpoint_id=cid):
            try:
                for step in SAVE_SEQUENCE:
                    t0 = time.perf_counter()
                    reached.append(step.name)  # type: ignore[arg-type]
                    self.controller.faults.reach(f"save_{step.name.value}")
                    history.record("snap", cid=cid, step=step.name.value)
                    try:
                        result = await getattr(self, f"_step_{step.name.value}")(step.stages, state)
                    except OSError as exc:
                        # Storage (a disk that is full, an I/O error, a failed fsync or rename): the
                        # snapshot is aborted and the next interval tries again.
                        raise SnapshotFailure(step.name.value, f"storage: {exc}", transient=True) from exc
                    took = time.perf_counter() - t0
                    state["steps_ms"][step.name.value] = round(took * 1000, 3)
                    self.metrics.phases_ms.setdefault(step.name.value, []).append(took * 1000)
                    self.controller.metrics.snapshot_step(step.name.value, took)
                    if result == "skip":
                        history.record("snap_skipped", cid=cid)
                        self.metrics.skipped += 1
                        self.controller.metrics.snapshot("skipped")
                        self.metrics.consecutive_failures = 0
                        log.info("snapshot_skipped", reason="nothing new since the last snapshot")
                        return None
                    self.controller.faults.reach(f"after_{step.name.value}")
            except SnapshotFailure as failure:
                history.record(
                    "snap_failed",
                    cid=cid,
                    step=failure.step,
                    detail=failure.detail,
                    transient=failure.transient,
                )
                if SaveStep.PUBLISH not in reached[:-1]:
                    await self._abort(state, failure)
                    self.controller.faults.reach("after_abort")
                self.controller.gate_open = True
                self.controller._wake.set()
                self.metrics.failed += 1
                self.metrics.consecutive_failures += 1
                self.controller.metrics.snapshot("failed")
                raise
            finally:
                window = self.controller.paused_s() - paused_before
                if window > 0 and self.controller.gate_open:  # a skipped snapshot never closed the gate
                    self.metrics.pause_ms.append(window * 1000)
                    self.controller.metrics.snapshot_pause(window)
        self.metrics.records.append(
            {
                "pause_ms": round(window * 1000, 3),
                "rollouts": len(state["episodes"]),
                "parked": state["parked"],
                "bytes": state["bytes"],
                "park_wait_ms": round(state["park_wait_s"] * 1000, 3),
                "steps_ms": state["steps_ms"],
            }
        )
        self.metrics.published += 1
        self.controller.metrics.snapshot("published")
        self.metrics.consecutive_failures = 0
        path = self.run_dir / f"snapshot_{seq}"
        history.record("snap_done", cid=cid, snapshot=path.name)
        log.info(
            "snapshot_published",
            checkpoint_id=cid,
            snapshot=path.name,
            episodes=len(state["episodes"]),
            ms=round((time.perf_counter() - started) * 1000, 3),
            parked=state["parked"],
        )
        return path

    async def _step_close_gate(self, _: tuple[str, ...], state: dict[str, Any]) -> str | None:
        state["progress"] = await self._progress()
        if self._last_progress == state["progress"] and not state["force"]:
            return "skip"  # no boundary passed, no ledger or TQ change: a snapshot would add nothing
        self.controller.gate_open = False
        return None

    async def _step_retire(self, _: tuple[str, ...], state: dict[str, Any]) -> None:
        await self.controller.retire_pending()

    async def _step_ack_drain(self, _: tuple[str, ...], state: dict[str, Any]) -> None:
        await self.controller._flush_outbox()

    async def _step_prepare(self, stages: tuple[str, ...], state: dict[str, Any]) -> None:
        cid, deadline = state["cid"], state["deadline"]
        for stage in stages:
            replies = await self._ask(
                stage, lambda _a: Prepare(checkpoint_id=cid, deadline=deadline), "prepare"
            )
            for reply in replies.values():
                assert isinstance(reply, Prepared)
                state["parked"] += reply.parked
                state["boundaries"] += reply.boundaries_passed
                state["park_wait_s"] = max(state["park_wait_s"], reply.waited_s)
                state["restarts"].update((r.rollout_id, r.attempt) for r in reply.restarts)
        # Renew the leases once if preparing used more than half of the deadline.
        if state["deadline"] - time.time() < self.config.prepare_timeout_s / 2:
            renewed = time.time() + self.config.prepare_timeout_s
            state["deadline"] = renewed
            for stage in stages:
                await self._ask(stage, lambda _a: Renew(checkpoint_id=cid, deadline=renewed), "renew")

    async def _step_commit(self, stages: tuple[str, ...], state: dict[str, Any]) -> None:
        cid, deadline, location = state["cid"], state["deadline"], state["tmp"].name
        scope = self._scope()
        for stage in stages:
            replies = await self._ask(
                stage,
                lambda a: Commit(
                    checkpoint_id=cid, deadline=deadline, location=location, episodes=scope.get(a, ())
                ),
                "commit",
            )
            for address, reply in replies.items():
                assert isinstance(reply, Committed)
                role, replica = address.split("/")
                self._record_files(state, Path("participants") / role / replica, reply)
                if role == "agent":
                    state["episodes"].update((e.rollout_id, e.attempt) for e in reply.episodes)

    def _scope(self) -> dict[str, tuple[EpisodeRef, ...]]:
        """Each agent's exact episode scope: the attempts the ledger has dispatched to it."""
        scope: dict[str, list[EpisodeRef]] = {}
        for sibling, attempt in self.controller.ledger.attempts():
            if attempt.state.value == "dispatched" and attempt.replica is not None:
                scope.setdefault(actor_address("agent", attempt.replica), []).append(
                    EpisodeRef(rollout_id=sibling.rollout_id, attempt=attempt.index, replica=attempt.replica)
                )
        everything = tuple(e for refs in scope.values() for e in refs)
        result = {address: tuple(refs) for address, refs in scope.items()}
        for address in self.addresses("resources") + self.addresses("policy"):
            result[address] = everything
        return result

    def _record_files(self, state: dict[str, Any], prefix: Path, reply: Committed) -> None:
        for f in reply.files:
            state["files"].append(
                {
                    "path": str(prefix / f.path),
                    "sha256": f.sha256,
                    "records": f.records,
                    "size": f.size,
                    "checkpoint_id": reply.checkpoint_id,
                }
            )

    async def _step_drain_receipts(self, _: tuple[str, ...], state: dict[str, Any]) -> None:
        """A dispatched attempt no agent saved has finished: its receipt is on the wire. Wait for it
        to seal (or fail) before the cut, event driven, until the deadline."""
        restarts = state["restarts"]
        while True:
            waiting = self.controller.ledger.dispatched() - state["episodes"] - restarts
            if not waiting:
                return
            remaining = state["deadline"] - time.time()
            if remaining <= 0:
                mismatch = episode_mismatch(state["episodes"], self.controller.ledger.dispatched() - restarts)
                raise SnapshotFailure(
                    "drain_receipts", f"receipts did not arrive: {mismatch}", transient=True
                )
            self.controller._wake.clear()
            try:
                await asyncio.wait_for(self.controller._wake.wait(), remaining)
            except TimeoutError:
                continue

    async def _step_capture(self, stages: tuple[str, ...], state: dict[str, Any]) -> None:
        """TQ and the ledger at one cut: nothing can seal in between (the gate is closed, every rollout
        parked, receipts drained), and the ledger is encoded right after TQ's commit returns."""
        cid, deadline, tmp = state["cid"], state["deadline"], state["tmp"]
        replies = await self._ask(
            "tq", lambda _a: Commit(checkpoint_id=cid, deadline=deadline, location=tmp.name), "capture"
        )
        reply = replies["tq/0"]
        assert isinstance(reply, Committed)
        self._record_files(state, Path("tq"), reply)
        data = msgspec.msgpack.encode(
            {"ledger": self.controller.ledger.export(), "controller": self.controller.anchor()}
        )
        # No await since the export: the seals made so far are exactly the ones this ledger holds.
        self.controller.history.record("captured", cid=cid, seals=self.controller.seals)
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / "ledger.msgpack"
        with open(path, "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            self.controller.faults.reach("capture_write", path=path)
            handle.write(data[len(data) // 2 :])
            handle.flush()
            os.fsync(handle.fileno())
        state["files"].append(
            {
                "path": "ledger.msgpack",
                "sha256": hashlib.sha256(data).hexdigest(),
                "records": 1,
                "size": len(data),
                "checkpoint_id": cid,
            }
        )

    async def _step_validate(self, _: tuple[str, ...], state: dict[str, Any]) -> None:
        for address in self.addresses("agent"):  # an agent that died and came back lost its rollouts
            reply = await self._request(
                address, Status(checkpoint_id=new_checkpoint_id("alive"), deadline=time.time() + 5)
            )
            if isinstance(reply, StatusReport) and self.controller.observe(address, reply):
                raise SnapshotFailure("validate", f"{address} restarted during the snapshot", transient=True)
        restarts = state["restarts"]  # restart-only participants' rollouts: not kept, not compared
        mismatch = episode_mismatch(
            state["episodes"] - restarts, self.controller.ledger.dispatched() - restarts
        )
        if mismatch:
            raise SnapshotFailure(
                "validate", f"saved episodes differ from the ledger: {mismatch}", transient=False
            )
        tmp: Path = state["tmp"]
        for entry in state["files"]:
            path = tmp / entry["path"]
            if not path.is_file() or sha256_file(path) != entry["sha256"]:
                raise SnapshotFailure(
                    "validate", f"{entry['path']} is missing or does not match its digest", transient=True
                )
        self._check_staging_keys(tmp)

    def _check_staging_keys(self, tmp: Path) -> None:
        """Every turn an agent saved references a staging row that TQ captured."""
        missing = [key for keys in missing_staging_keys(tmp, strict=False).values() for key in keys]
        if missing:
            raise SnapshotFailure(
                "validate", f"staging rows not in TQ's capture: {', '.join(missing[:20])}", transient=False
            )

    async def _step_publish(self, _: tuple[str, ...], state: dict[str, Any]) -> None:
        tmp: Path = state["tmp"]
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "checkpoint_id": state["cid"],
            "seq": state["seq"],
            "run": self.controller.run,
            "created_at": time.time(),
            "trainer": {
                "step": self.controller.counts["train_steps"],
                "policy_version": self.controller.policy_version,
            },
            "config_fingerprint": self.config_fingerprint,
            "topology_fingerprint": fingerprint(self._expected_topology()),
            "episodes": sorted([r, a] for r, a in state["episodes"]),
            "restarts": sorted([r, a] for r, a in state["restarts"]),
            "files": state["files"],
        }
        manifest_path = tmp / "manifest.json"
        faults = self.controller.faults
        with open(manifest_path, "w") as handle:
            text = json.dumps(manifest, indent=1, sort_keys=True)
            handle.write(text[: len(text) // 2])
            handle.flush()
            faults.reach("publish_write", path=manifest_path)
            handle.write(text[len(text) // 2 :])
            handle.flush()
            os.fsync(handle.fileno())
            state["bytes"] = handle.tell() + sum(int(e["size"]) for e in state["files"])
        for directory in sorted(
            {(tmp / e["path"]).parent for e in state["files"]} | {tmp}, key=lambda p: -len(p.parts)
        ):
            faults.reach("publish_fsync", "files", path=directory)
            fsync_dir(directory)
        final = self.run_dir / f"snapshot_{state['seq']}"
        faults.reach("publish_rename", path=tmp)
        os.rename(tmp, final)
        try:
            faults.reach("publish_fsync", "parent", path=self.run_dir)
            fsync_dir(self.run_dir)
        except OSError:
            # The rename may not be durable: undo it, so the snapshot is aborted like any failure
            # before the rename and the previous one stays authoritative.
            os.rename(final, tmp)
            raise
        self.controller.history.record(
            "published",
            cid=state["cid"],
            snapshot=final.name,
            episodes=sorted([r, a] for r, a in state["episodes"]),
        )
        self._last_progress = state["progress"]
        self._prune()
        if self.on_published is not None:
            self.on_published(final)

    def _expected_topology(self) -> list[dict[str, Any]]:
        return sorted(
            (
                {"role": role, "replica": i}
                for role in ("agent", "policy", "resources", "tq")
                for i in range(len(self.addresses(role)))
            ),
            key=lambda d: (d["role"], d["replica"]),
        )

    def _prune(self) -> None:
        snapshots = list_snapshots(self.run_dir)
        for _, path in snapshots[: -self.config.keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)

    async def _step_resume(self, stages: tuple[str, ...], state: dict[str, Any]) -> None:
        await self.resume_all(state["cid"], stages)

    async def resume_all(self, cid: str, stages: tuple[str, ...]) -> None:
        """Resume every participant under the same id, stage by stage (a stage's members at once); one
        that does not answer is ``published_release_pending`` and is asked again (same id,
        idempotent) until it answers."""
        for stage in stages:
            await asyncio.gather(*(self._resume_one(address, cid) for address in self.addresses(stage)))

    async def _resume_one(self, address: str, cid: str) -> None:
        for attempt in range(RESUME_RETRIES):
            try:
                reply = await self.controller.client.request(
                    address, Resume(checkpoint_id=cid, deadline=time.time() + 5)
                )
                if not isinstance(reply, Error):
                    return
            except BrokerError:
                pass
            self.controller.counts["release_pending"] += 1
            log.warning("published_release_pending", participant=address, attempt=attempt + 1)
            await asyncio.sleep(0.2 * (attempt + 1))

    async def _step_open_gate(self, _: tuple[str, ...], state: dict[str, Any]) -> None:
        self.controller.gate_open = True
        self.controller._wake.set()

    async def _abort(self, state: dict[str, Any], failure: SnapshotFailure) -> None:
        """Abort under the same id everywhere (fencing it), delete the temporary directory."""
        log.warning("snapshot_aborted", step=failure.step, detail=failure.detail, transient=failure.transient)
        cid = state["cid"]
        self.controller.history.record("snap_aborted", cid=cid, step=failure.step)
        targets = [a for role in ("agent", "policy", "resources", "tq") for a in self.addresses(role)]
        await asyncio.gather(
            *(
                self.controller.client.request(
                    a, Abort(checkpoint_id=cid, deadline=time.time() + 5, reason=str(failure))
                )
                for a in targets
            ),
            return_exceptions=True,
        )
        shutil.rmtree(state["tmp"], ignore_errors=True)

    # -- restore --------------------------------------------------------------------------------------
    # -- trainer checkpoints -----------------------------------------------------------------------
    @property
    def trainer_dir(self) -> Path:
        return self.run_dir / "trainer"

    def write_trainer_checkpoint(self, step: int, *, anchor: dict[str, Any], state: dict[str, Any]) -> None:
        """The fallback marker (what the trainer consumed so far) and the trainer's state, both durable,
        before the snapshot attempt anchored at this step."""
        self.trainer_dir.mkdir(parents=True, exist_ok=True)
        for name, payload in ((f"fallback_{step}.msgpack", anchor), (f"step_{step}.msgpack", state)):
            path = self.trainer_dir / name
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as handle:
                handle.write(msgspec.msgpack.encode(payload))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        fsync_dir(self.trainer_dir)

    def newest_trainer_checkpoint(self) -> int | None:
        return newest_trainer_step(self.run_dir)

    def mark_completed(self) -> None:
        """A finished run leaves a marker: starting the same run again starts it afresh."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "COMPLETED").write_text(f"{time.time()}\n")

    async def restore_if_any(self) -> bool:
        """Restore the newest valid snapshot of this run, if there is one. True when restored."""
        completed = self.run_dir / "COMPLETED"
        if completed.exists():
            log.info("previous_run_completed", run_dir=str(self.run_dir), action="starting afresh")
            for _, path in list_snapshots(self.run_dir):
                shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(self.trainer_dir, ignore_errors=True)
            completed.unlink()
            return False
        await self.end_orphaned_checkpoints()
        trainer_step = self.newest_trainer_checkpoint()
        broken: list[str] = []
        selected = select_snapshot(
            self.run_dir, config_fingerprint=self.config_fingerprint, trainer_step=trainer_step, broken=broken
        )
        if selected is None and trainer_step is not None:
            return await self._restore_fallback(trainer_step)
        if selected is None and broken:
            # Starting afresh would silently drop every rollout those snapshots hold: say what is
            # wrong and let the user decide (fix the storage, or move them away).
            log.error("no_valid_snapshot", run_dir=str(self.run_dir), problems=broken)
            raise NoValidSnapshot(
                f"no snapshot of run {self.controller.run!r} verifies, so nothing can be restored and "
                "starting afresh would discard them: "
                + "; ".join(broken)
                + f". Check them with `parkway snapshots verify --run {self.controller.run}`; to start "
                f"the run afresh, move them away from {self.run_dir}"
            )
        if selected is None:
            return False
        path, manifest = selected
        rid = new_checkpoint_id("rs")
        self._began = time.time()
        with structlog.contextvars.bound_contextvars(checkpoint_id=rid):
            log.info("restore_started", snapshot=path.name, saved_checkpoint=manifest["checkpoint_id"])
            self.controller.history.record(
                "restore_started", rid=rid, snapshot=path.name, saved_cid=manifest["checkpoint_id"]
            )
            await self._check_topology(manifest)
            deadline = time.time() + self.config.prepare_timeout_s
            record = msgspec.msgpack.decode((path / "ledger.msgpack").read_bytes())
            ledger = Ledger.load(record["ledger"])
            saved = {(r, a) for r, a in manifest["episodes"]}
            restarts = {(r, a) for r, a in manifest["restarts"]}
            mismatch = episode_mismatch(saved - restarts, ledger.dispatched() - restarts)
            if mismatch:
                raise SnapshotInvalid(f"{path.name}: saved episodes differ from its ledger: {mismatch}")
            # Rollouts a restart-only participant could not save restart from their prompt.
            continued = self.controller.adopt(ledger, record["controller"], saved_episodes=saved - restarts)
            scope, epoch = tuple(continued), self.controller.epoch
            # Agents first: they stop whatever the fresh processes picked up from the dead cluster's
            # queues; then the attempts the snapshot had running are fenced everywhere; TQ last, so
            # nothing generated before the fence survives in it.
            try:
                for stage in ("agent", "policy", "resources"):
                    await self._ask(
                        stage,
                        lambda _a: Restore(
                            checkpoint_id=rid,
                            deadline=deadline,
                            location=path.name,
                            episodes=scope,
                            epoch=epoch,
                        ),
                        "restore",
                    )
                    self.controller.faults.reach(f"after_restore_{stage}")
                fence = tuple(self.controller.fenced_at_restore)

                def retire(_: str) -> Retire:
                    return Retire(checkpoint_id=f"{rid}-fence", deadline=deadline, attempts=fence)

                for stage in ("agent", "policy", "resources"):
                    await self._ask(stage, retire, "fence")
                await self._ask(
                    "tq",
                    lambda _a: Restore(checkpoint_id=rid, deadline=deadline, location=path.name, epoch=epoch),
                    "restore_tq",
                )
                await self._ask("tq", retire, "fence")  # after its restore, which drops the old fences
                # From here on attempt N of every restored rollout is fenced on every participant (TQ's
                # store replaced by the snapshot's), and attempt N+1 exists.
                self.controller.history.record(
                    "fenced",
                    rid=rid,
                    snapshot=path.name,
                    saved_cid=manifest["checkpoint_id"],
                    epoch=epoch,
                    attempts=[[f.rollout_id, f.attempt] for f in fence],
                    continued=[[e.rollout_id, e.attempt, e.replica] for e in scope],
                )
                self.controller.faults.reach("after_restore_tq")
            except SnapshotFailure as failure:
                # One owner cleans up a failed restore: this controller aborts the restore id everywhere,
                # once; nobody else resumes anything (NeMo resumed twice here).
                log.error("restore_failed", step=failure.step, detail=failure.detail)
                self.controller.history.record("restore_failed", rid=rid, step=failure.step)
                targets = [a for role in ("agent", "policy", "resources", "tq") for a in self.addresses(role)]
                await asyncio.gather(
                    *(
                        self.controller.client.request(
                            a,
                            Abort(
                                checkpoint_id=rid,
                                deadline=time.time() + 5,
                                reason=f"restore failed: {failure}",
                            ),
                        )
                        for a in targets
                    ),
                    return_exceptions=True,
                )
                raise
            await self.resume_all(rid, ("resources", "policy", "agent", "tq"))  # once, by this owner only
            self.metrics.restores += 1
            self.controller.metrics.restored()
            self.metrics.rollouts_restored += len(scope)
            self._last_progress = await self._progress()
            log.info("restore_done", snapshot=path.name, continued=len(scope))
            self.controller.history.record("restore_done", rid=rid, snapshot=path.name)
        return True

    async def _restore_fallback(self, step: int) -> bool:
        """The newest trainer checkpoint has no snapshot: use its fallback marker."""
        anchor = msgspec.msgpack.decode((self.trainer_dir / f"fallback_{step}.msgpack").read_bytes())
        state = msgspec.msgpack.decode((self.trainer_dir / f"step_{step}.msgpack").read_bytes())
        log.warning(
            "restore_from_fallback_marker",
            trainer_step=step,
            detail="no snapshot matches the newest trainer checkpoint: unfinished groups restart",
        )
        self.controller.adopt_fallback(anchor, state)
        self.metrics.restores += 1
        self.controller.metrics.restored()
        self._last_progress = await self._progress()
        return True

    async def _check_topology(self, manifest: dict[str, Any]) -> None:
        capabilities = []
        for role in ("agent", "policy", "resources", "tq"):
            replies = await self._ask(
                role,
                lambda _a: Discover(checkpoint_id=new_checkpoint_id("disc"), deadline=time.time() + 10),
                "discover",
            )
            capabilities += [r for r in replies.values() if isinstance(r, Capabilities)]
        live = fingerprint(topology_of(capabilities))
        if live != manifest["topology_fingerprint"]:
            raise SnapshotInvalid(
                "the live topology differs from the snapshot's: "
                f"{[(c.role, c.replica) for c in capabilities]}"
            )
