"""The policy model: in-flight calls, token lineage, weight updates; engines in Ray actors.

Each ``Generate`` is one model call, request id ``<capture key>:<call index>``. Its tokens go to TQ as
one staging row *before* the reply goes back, so a lost reply never loses the capture.

A checkpoint holds no call here: the policy's part of a cut is its weights' version (and counters),
and the calls go on through it. At ``recovery.target_level: prefix`` (``keep_prefixes``) the cut also
keeps the tokens each call in flight has brought out so far (the engine's ``progress``: read at the cut
from an engine in this process, polled every ``progress_interval_s`` from Ray replicas), and a restore
that keeps prefixes continues each restored rollout's call from them: the engine generates only what
follows, the reply is the whole call, and its staging row says which tokens came from which attempt
(``TokenSegment``). docs/recovery.md#prefix. What a rollout's cut needs of its model calls the agents hold
themselves: a rollout they hold at its boundary keeps a reply that comes meanwhile until the release,
and one cut mid-round may take its replies (docs/snapshots.md#the-cut). The weights cannot change
during a snapshot (the controller loads them under its snapshot lock).

A weight update closes a gate of its own: new calls wait while it runs, and it waits for the calls
generating to finish. A graceful stop leaves calls that wait at that gate unacked, for redelivery; the
same request and seed give the same tokens again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog
from parkway.actors.engines.base import GenerationRequest
from parkway.actors.engines.ray_host import EnginePool, EngineSpec
from parkway.actors.engines.ray_placement import RayPlacement
from parkway.actors.roles.generations import GENERATIONS_FILE, GenerationRecords
from parkway.actors.roles.prefixes import DEFAULT_PROGRESS_INTERVAL_S, KeptPrefix, Prefixes
from parkway.actors.runtime.participant import Cut, ParkReport, Participant
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import GenerationAborted, GenerationFinished, GenerationStarted, Refused
from parkway.protocol.ids import Role, capture_key, staging_key
from parkway.protocol.messages import (
    AttemptRef,
    Commit,
    FileDigest,
    Generate,
    Generated,
    LoadWeights,
    Message,
    Prepare,
    Restore,
    Retire,
    Rows,
    StagingRow,
    WeightsLoaded,
)
from parkway.protocol.placement import tq_address

log = structlog.get_logger("parkway.policy")


class Policy(Participant):
    role = Role.POLICY
    takes_over_replicas = True  # prefixes and counts are per rollout; the weights are every replica's
    prefetch = 1024  # generations wait concurrently (on the engines or at the gate)

    def __init__(
        self,
        *args: Any,
        engine: EngineSpec | None = None,
        engine_host: str = "ray",
        engines: int = 1,
        placement: RayPlacement | None = None,
        tq_shards: int = 1,
        keep_prefixes: bool = False,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.engine_spec = engine or EngineSpec()
        self.pool = EnginePool(self.engine_spec, host=engine_host, replicas=engines, placement=placement)
        self.tq_shards = tq_shards  # a row goes to its rollout's shard (``placement.tq_of``)
        self.policy_version = 0  # set by the controller when weights change; stamped on every call
        self._stopping = asyncio.Event()
        self._generating: dict[str, tuple[str, int]] = {}  # request id -> (rollout id, attempt)
        self.prefixes = Prefixes(
            self.pool, self.counts, enabled=keep_prefixes, progress_interval_s=progress_interval_s
        )
        self._restores = 0  # restores installed by this process: calls from before one are dropped
        # A weight update: new calls wait while it runs; it waits for the calls generating to finish.
        self.weights_dir: str | None = None  # None: the weights the engines started with
        self._weights_open = asyncio.Event()
        self._weights_open.set()
        self._weights_lock = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
        # The run's generations in every process of this policy (its state directory's records).
        self.generations = GenerationRecords(self.state_dir / GENERATIONS_FILE if self.state_dir else None)
        self._count_generations()
        self.handlers[Generate] = self.on_generate
        self.handlers[LoadWeights] = self.on_load_weights
        self.metrics.gauge(
            "parkway_policy_requests_in_flight",
            "Model calls generating or holding their reply for a checkpoint",
            lambda: len(self._generating),
        )

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.pool.start()
        await super().start()
        self.prefixes.start()

    async def stop(self) -> None:
        self._stopping.set()  # calls waiting at a closed gate give up; they are redelivered later
        await self.prefixes.stop()
        try:
            await super().stop()
        finally:
            self.generations.close()
            await self.pool.stop()

    # -- model calls ---------------------------------------------------------------------------
    async def on_generate(self, call: Generate) -> Message:
        attempt = (call.rollout_id, call.attempt)
        self._refuse_retired(attempt)
        restores = self._restores  # a restore while this call waits or generates makes it the dead cluster's
        key = capture_key(call.rollout_id, call.attempt)
        request_id = staging_key(key, call.call_index)  # the key of the staging row this call makes
        await self.wait_for_weights(request_id)  # a call not yet generating waits while weights load
        self._refuse_retired(attempt, restores)
        # The version the rollout was dispatched with; the engine's own weights (vLLM) update separately.
        version = max(call.policy_version, self.policy_version)
        prefix = self.prefixes.take(call)
        self._generating[request_id] = attempt
        self.prefixes.started(request_id, call, version, prefix)
        self.history.record(
            GenerationStarted(rollout_id=call.rollout_id, attempt=call.attempt, call_index=call.call_index)
        )
        self._idle.clear()
        try:
            result = await self.pool.generate(
                GenerationRequest(
                    request_id=request_id,
                    token_ids=call.token_ids,
                    seed=call.seed,
                    max_tokens=call.max_tokens,
                    stop_token_ids=call.stop_token_ids,
                    prefix=prefix.token_ids if prefix else (),
                    prefix_logprobs=prefix.logprobs if prefix else (),
                )
            )
        except (ValueError, OverflowError) as exc:
            # A request this engine cannot take (a token outside its vocabulary, a seed out of range).
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"the engine refused {request_id}: {exc}") from exc
        finally:
            self._generating.pop(request_id, None)
            self.prefixes.finished(request_id)
            if not self._generating:
                self._idle.set()
        segments = self.prefixes.segments(prefix, result.kept, call, version, len(result.token_ids))
        self.counts["model_calls"] += 1  # this process's
        self.counts["tokens_generated"] += len(result.token_ids) - result.kept
        self.generations.generated(call.rollout_id, call.call_index)  # the run's, in every process
        self._count_generations()
        self._refuse_retired(
            attempt, restores
        )  # retired while generating: nothing to capture, nobody to answer
        row = StagingRow(
            capture_key=key,
            turn=call.call_index,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            policy_version=version,
            prompt_token_ids=call.token_ids,
            segments=segments,
        )
        try:
            await self.client.send(
                tq_address(call.rollout_id, self.tq_shards),
                Rows(rows=(row,), epoch=call.epoch),
                correlation_id=request_id,
            )
        except BrokerError as exc:
            raise ProtocolError(
                ErrorCode.UNAVAILABLE, f"staging row for {request_id} not sent: {exc}"
            ) from exc
        self.history.record(
            GenerationFinished(rollout_id=call.rollout_id, attempt=call.attempt, call_index=call.call_index)
        )
        log.debug(
            "generated",
            request_id=request_id,
            tokens=len(result.token_ids),
            kept=result.kept,
            finish_reason=result.finish_reason,
            policy_version=version,
        )
        return Generated(
            rollout_id=call.rollout_id,
            attempt=call.attempt,
            call_index=call.call_index,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason,
            policy_version=version,
        )

    async def on_retire(self, command: Retire) -> Message:
        reply = await super().on_retire(command)
        for request_id, attempt in list(self._generating.items()):
            if attempt in self.retired:
                await self.pool.abort(request_id)
        return reply

    # -- weight updates ------------------------------------------------------------------------
    async def on_load_weights(self, command: LoadWeights) -> Message:
        """New weights for every engine replica. Calls already generating finish on the old weights
        (their version is the one they were sent with); calls that arrive meanwhile wait, then run on
        the new ones. Loading the version already loaded from the same directory is a no-op."""
        async with self._weights_lock:
            if command.policy_version < self.policy_version or (
                command.policy_version == self.policy_version and command.directory != self.weights_dir
            ):
                raise ProtocolError(
                    ErrorCode.INVALID_MESSAGE,
                    f"policy version {command.policy_version} from {command.directory} is not newer than "
                    f"the loaded {self.policy_version} from {self.weights_dir or 'the start-up weights'}",
                )
            if command.policy_version == self.policy_version:
                return WeightsLoaded(
                    policy_version=self.policy_version, directory=command.directory, replicas=0, seconds=0.0
                )
            started = time.monotonic()
            replicas = await self._load(command.directory)
            self.policy_version = command.policy_version
            self.counts["weight_updates"] += 1
            seconds = time.monotonic() - started
            log.info(
                "weights_loaded",
                policy_version=self.policy_version,
                directory=command.directory,
                replicas=replicas,
                seconds=round(seconds, 3),
            )
            return WeightsLoaded(
                policy_version=self.policy_version,
                directory=command.directory,
                replicas=replicas,
                seconds=seconds,
            )

    async def _load(self, directory: str) -> int:
        self._weights_open.clear()
        try:
            await self._idle.wait()
            try:
                replicas = await self.pool.load_weights(directory)
            except (FileNotFoundError, NotImplementedError) as exc:
                raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"weights not loaded: {exc}") from None
            self.weights_dir = directory
            return replicas
        finally:
            self._weights_open.set()

    def _count_generations(self) -> None:
        self.counts["generations"] = self.generations.total
        self.counts["generations_repeated"] = self.generations.repeated

    def forget_attempts(self, keys: list[tuple[str, int]]) -> None:
        """Sealed rollouts' per-turn counts fold into the totals (``generations_repeated`` stays exact)."""
        forgotten = {rollout_id for rollout_id, _ in keys}
        self.generations.forget(forgotten)
        self.prefixes.forget(forgotten)

    def status_fields(self, *, asking: int = 0) -> dict[str, Any]:
        """``tokens_accrued`` among the counts where the engine keeps it: tokens as they come out, those of
        calls still generating included (a benchmark's throughput over a window must not hinge on which
        calls happen to return inside it)."""
        fields = super().status_fields(asking=asking)
        accrued = self.pool.tokens_accrued() if self.pool.started else None
        if accrued is not None:
            fields["counts"]["tokens_accrued"] = accrued
        return fields

    def structure_sizes(self) -> dict[str, int]:
        return {
            **super().structure_sizes(),
            "generating": len(self._generating),
            "generation_turns": len(self.generations.turns),
            "kept_prefixes": len(self.prefixes.kept),
        }

    def _refuse_retired(self, attempt: tuple[str, int], restores: int | None = None) -> None:
        self.refuse_forgotten(*attempt)
        if attempt in self.retired:
            self.history.record(Refused(rollout_id=attempt[0], attempt=attempt[1], code="stale_attempt"))
            raise ProtocolError(ErrorCode.STALE_ATTEMPT, f"attempt {attempt[1]} of {attempt[0]} is retired")
        if restores is not None and restores != self._restores:
            # Not a verdict on the attempt (the restored ledger may reuse its number), so not cached:
            # a call with this request id after the restore is served afresh.
            self.history.record(Refused(rollout_id=attempt[0], attempt=attempt[1], code="restored"))
            raise ProtocolError(
                ErrorCode.UNAVAILABLE,
                f"attempt {attempt[1]} of {attempt[0]}: the cluster was restored while this call waited",
            )

    async def wait_for_weights(self, request_id: str) -> None:
        """Return when no weight update is loading; while stopping, a closed gate cancels the call."""
        while not self._weights_open.is_set():
            if self._stopping.is_set():
                raise asyncio.CancelledError  # left unacked: redelivered to the next policy process
            opened = asyncio.ensure_future(self._weights_open.wait())
            stopping = asyncio.ensure_future(self._stopping.wait())
            try:
                await asyncio.wait({opened, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()
                stopping.cancel()
            if self._stopping.is_set():  # (even if the gate opened meanwhile: it was waiting at a stop)
                raise asyncio.CancelledError

    # -- checkpoint hooks ----------------------------------------------------------------------
    def parked_now(self, command: Prepare) -> ParkReport:
        # Never waits for a generation, and holds none: the calls go on through a checkpoint.
        return ParkReport(parked=len(self._generating))

    def take_cut(self, command: Commit) -> Cut:
        # The policy's own state is its weights' version; the calls in flight are recorded by request
        # id for diagnosis (their agents re-send them after a restore), and at ``prefix`` with the
        # tokens each has brought out so far (copies: the cut is written later, in another thread).
        prefixes = self.prefixes.cut(command.checkpoint_id)
        if prefixes:
            self.counts["prefixes_cut"] += len(prefixes)
            self.counts["prefix_tokens_cut"] += sum(len(p.token_ids) for p in prefixes)
        record = {
            "role": self.role,
            "replica": self.replica,
            "checkpoint_id": command.checkpoint_id,
            "episodes": [msgspec.to_builtins(e) for e in command.episodes],
            "policy_version": self.policy_version,
            "weights_dir": self.weights_dir,
            "generating": sorted(self._generating),
            "generations": [self.generations.session, self.generations.total, self.generations.repeated],
        }

        def write(directory: Path) -> tuple[FileDigest, ...]:
            # The prefixes are frozen copies: turned into records here, in the writer's thread.
            full = {**record, "prefixes": [p.record() for p in prefixes]}
            return (self.records.plain(directory / "participant.msgpack", [full]),)

        return Cut(write=write)

    async def install_snapshot(self, directory: Path, command: Restore) -> tuple[AttemptRef, ...]:
        # Read first: a snapshot that cannot be read changes nothing here. Onto another number of
        # replicas this one takes over the saved replicas of ``sources`` (their prefixes and counts);
        # one that takes over none still loads the snapshot's weights, which every replica had
        # (replica 0's record, which every snapshot holds).
        taken = [read_policy_record(d) for d in self.source_dirs(directory, command)]
        record = taken[0] if taken else read_policy_record(self.participant_dir(command.location, 0))
        weights_dir = record.get("weights_dir")
        policy_version = int(record["policy_version"])
        prefixes = [KeptPrefix.from_record(item) for r in taken for item in r.get("prefixes") or ()]
        # Calls in flight belong to the cluster that died: abort them and capture nothing of them (the
        # restored agents re-issue what they need: same request, same tokens). Their attempts are not
        # fenced here: the controller fences exactly the attempts the snapshot holds, and the restored
        # ledger may give an attempt of the dead cluster's its number again.
        self._restores += 1
        for request_id, attempt in list(self._generating.items()):
            await self.pool.abort(request_id)
            self.history.record(
                GenerationAborted(rollout_id=attempt[0], attempt=attempt[1], request_id=request_id)
            )
        if weights_dir is not None and weights_dir != self.weights_dir:
            # The rollouts resume on the weights they were generating with, not on the start-up ones.
            await self._load(weights_dir)
        self.policy_version = policy_version
        self.prefixes.install(prefixes, command)
        # The generation counts of the replicas taken over (absent in snapshots from before them).
        counts = [r.get("generations") for r in taken]
        valid = [
            c for c in counts if isinstance(c, list) and len(c) == 3 and all(isinstance(n, int) for n in c)
        ]
        if valid:
            self.generations.adopt(
                max(c[0] for c in valid), sum(c[1] for c in valid), sum(c[2] for c in valid)
            )
            self._count_generations()
        return ()

    @property
    def loading_weights(self) -> bool:
        return not self._weights_open.is_set()

    @property
    def generating(self) -> int:
        return len(self._generating)


def read_policy_record(directory: Path) -> dict[str, Any]:
    """A policy replica's saved record (``participant.msgpack``: one map)."""
    [record] = msgspec.msgpack.decode((directory / "participant.msgpack").read_bytes())
    if not isinstance(record, dict):
        raise TypeError(f"participant.msgpack holds a {type(record).__name__}, not a record")
    return record
