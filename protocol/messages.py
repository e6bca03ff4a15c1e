"""Every message parkway sends, as frozen msgspec Structs in one tagged union.

The tag field is ``type`` (the class name); ``v`` is the schema version. Decoding is strict: unknown
fields, wrong types and unknown tags are refused at the edge (see ``codec``), so handlers only ever
see plain, valid, typed objects.

Control commands carry the checkpoint id (their AMQP correlation id too) and an absolute deadline
(Unix seconds); Commit and Restore name a location in the participant's snapshot root and a scope.
"""

from __future__ import annotations

import typing
from typing import Annotated

import msgspec
from parkway.protocol import ranges
from parkway.protocol.errors import ErrorCode
from parkway.protocol.ids import CHECKPOINT_ID_PATTERN
from parkway.protocol.inspection import Allocation as Allocation
from parkway.protocol.inspection import MemoryReport, MemoryUsage
from parkway.protocol.layout import LOCATION_PATTERN, SNAPSHOT_LOCATION, tmp_dir_name
from parkway.protocol.message_base import ControlCommand as ControlCommand
from parkway.protocol.message_base import Message as Message
from parkway.protocol.message_base import check_attempt
from parkway.protocol.rows import CanonicalRow as CanonicalRow
from parkway.protocol.rows import CanonicalRows as CanonicalRows
from parkway.protocol.rows import FetchRows as FetchRows
from parkway.protocol.rows import ReleaseRows as ReleaseRows
from parkway.protocol.rows import Rows as Rows
from parkway.protocol.rows import SealRows as SealRows
from parkway.protocol.rows import StagingRow as StagingRow
from parkway.protocol.rows import TokenSegment as TokenSegment
from parkway.protocol.snapshot_failures import SnapshotHealth
from parkway.protocol.training import TrainedRollout, TrainGroup

MAX_TOKEN_ID = ranges.MAX_TOKEN_ID  # numeric fields are typed with their ranges, checked at decode
MAX_SOURCES = 4096  # saved replicas a Restore may name for one participant
# The timeline a data message belongs to: the epoch of the Run its attempt was dispatched with (0: unstamped).
Epoch = ranges.Count
BaseCut = Annotated[str, msgspec.Meta(pattern=f"^$|{CHECKPOINT_ID_PATTERN.pattern}")]  # "" or a checkpoint id


# ---------------------------------------------------------------------------------------------
# Shared parts


class AttemptRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One attempt of one logical rollout."""

    rollout_id: str
    attempt: ranges.Count

    def __post_init__(self) -> None:
        if not self.rollout_id:
            raise ValueError("rollout_id is empty")
        if self.attempt < 0:
            raise ValueError(f"attempt {self.attempt} is negative")


class EpisodeRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An attempt together with the replica that runs it: the exact scope of a commit or restore.

    ``tools`` is what the agent's cut holds of it: the tool calls made before its saved boundary. A
    tool server saves each session as it was at that call (docs/snapshots.md#the-cut)."""

    rollout_id: str
    attempt: ranges.Count
    replica: ranges.Count
    tools: ranges.Count = 0

    def __post_init__(self) -> None:
        if not self.rollout_id:
            raise ValueError("rollout_id is empty")
        if self.attempt < 0 or self.replica < 0:
            raise ValueError("attempt and replica must be >= 0")


class FileDigest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One file a participant wrote at commit, as its manifest lists it."""

    path: str
    sha256: str
    records: ranges.Count
    size: ranges.Count
    # A pack hard-linked from the snapshot before (``actors/storage/packs.py``): on disk, not written now.
    linked: bool = False


def _check_location(location: str) -> None:
    if not LOCATION_PATTERN.fullmatch(location):
        raise ValueError(f"location {location!r} does not match {LOCATION_PATTERN.pattern}")


def _check_tokens(what: str, token_ids: tuple[int, ...]) -> None:
    for token in token_ids:
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"{what} holds {token}, not a token id (0 to {MAX_TOKEN_ID})")


# ---------------------------------------------------------------------------------------------
# Control commands (controller or CLI -> participant). Correlation id = checkpoint id.


class Discover(ControlCommand, frozen=True, kw_only=True):
    """Ask a participant for its capabilities (role, mode, restart-only flag, features)."""


class Status(ControlCommand, frozen=True, kw_only=True):
    """Ask an actor for its status. The checkpoint id here is just the request's id."""


class Prepare(ControlCommand, frozen=True, kw_only=True):
    """Close admission and hold; answer when the cut can be taken, or when the deadline passes.

    ``episodes``, to an agent: the attempts the controller dispatched to it that its last ``Prepared``
    did not hold. Their ``Run`` travels on the data lane and may still be queued behind this command,
    so the agent waits until each has arrived."""

    episodes: tuple[EpisodeRef, ...] = ()
    base: BaseCut = ""  # to an agent: the id of the Prepare whose cut the controller holds ("": none)


class Renew(ControlCommand, frozen=True, kw_only=True):
    """Extend the lease of the active checkpoint to this command's deadline (plus grace)."""


class SnapshotCommand(ControlCommand, frozen=True, kw_only=True):
    """A command about one snapshot: where it lives (relative to the participant's root) and its exact scope."""

    location: str
    episodes: tuple[EpisodeRef, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_location(self.location)


class TemporaryLocation(SnapshotCommand, frozen=True, kw_only=True):
    """A command about a snapshot not yet published: its location can only be the temporary directory
    of its own checkpoint, ``tmp_<checkpoint id>``, never a published snapshot or another's files."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.location != tmp_dir_name(self.checkpoint_id):
            raise ValueError(
                f"location {self.location!r} is not the temporary directory of checkpoint "
                f"{self.checkpoint_id!r} ({tmp_dir_name(self.checkpoint_id)})"
            )


class Commit(TemporaryLocation, frozen=True, kw_only=True):
    """Take the cut: an immutable in-memory copy of the participant's state for exactly ``episodes``
    (a tool server: each session as it was at the episode's ``tools``). Nothing is written yet."""

    left_out: tuple[AttemptRef, ...] = ()  # to TQ: attempts whose rows its cut leaves out (restarted)


class Persist(TemporaryLocation, frozen=True, kw_only=True):
    """Write the cut this id's Commit took under ``location`` and answer its files' digests. Sent after
    admission reopened: the writing is outside the snapshot's pause.

    ``base``: the run's newest published snapshot (``snapshot_<seq>``), whose packs of records that did
    not change are hard-linked instead of written again; None: write everything."""

    base: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base is not None and not SNAPSHOT_LOCATION.fullmatch(self.base):
            raise ValueError(f"base {self.base!r} is not a published snapshot (snapshot_<seq>)")


class Resume(ControlCommand, frozen=True, kw_only=True):
    """Leave the checkpoint: reopen admission and release held replies."""


class Abort(ControlCommand, frozen=True, kw_only=True):
    """Cancel whatever phase this id reached and fence the id."""

    reason: str = ""


class Restore(SnapshotCommand, frozen=True, kw_only=True):
    """Install saved state from ``location`` for exactly ``episodes``, then stay paused until Resume.

    ``epoch`` is the restoring controller's incarnation: work from an older one (a ``Run`` still queued
    from the cluster that died) is refused from now on.
    """

    epoch: ranges.Count = 0
    # recovery.target_level prefix: the policy continues each restored rollout's model call from the
    # tokens the snapshot kept of it, instead of generating it again from the first token.
    keep_prefixes: bool = False
    # The saved replicas of this participant's role whose records it reads (None: its own; empty:
    # none). An agent or tool server given another's takes over the rollouts it is told to continue
    # (``episodes``) when the live cluster has another topology than the snapshot's
    # (protocol/placement.py).
    sources: tuple[ranges.Count, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not SNAPSHOT_LOCATION.fullmatch(self.location):
            raise ValueError(f"location {self.location!r} is not a published snapshot (snapshot_<seq>)")
        if self.sources is not None and (
            len(set(self.sources)) != len(self.sources) or len(self.sources) > MAX_SOURCES
        ):
            raise ValueError(f"sources {self.sources!r}: at most {MAX_SOURCES}, each once")


class Retire(ControlCommand, frozen=True, kw_only=True):
    """Stop these attempts for good; later messages from them are refused."""

    attempts: tuple[AttemptRef, ...] = ()


class Forget(ControlCommand, frozen=True, kw_only=True):
    """Drop all memory of these retired attempts."""

    attempts: tuple[AttemptRef, ...] = ()


class Probe(ControlCommand, frozen=True, kw_only=True):
    """Diagnostic: hold for ``work_s`` seconds, journal the execution, answer ``ProbeResult``.

    It exercises the real queue, handler and reply path of an actor, so ``parkway publish probe`` is
    a liveness check and the round-trip benchmark's unit of work.
    """

    work_s: ranges.Seconds = 0.0
    note: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.work_s <= 3600.0:
            raise ValueError(f"work_s {self.work_s} is outside [0, 3600]")


class Snapshot(ControlCommand, frozen=True, kw_only=True):
    """Ask the controller of a running workload to take a snapshot now (``parkway snapshot``).

    The snapshot is taken under this checkpoint id (also when nothing moved since the last one).
    """


class LoadWeights(ControlCommand, frozen=True, kw_only=True):
    """Policy: load new weights from ``directory`` into every engine replica; they become
    ``policy_version``. Generations already running finish on the old weights; new ones wait."""

    directory: str
    policy_version: ranges.Count

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.directory:
            raise ValueError("directory is empty")
        if self.policy_version < 1:
            raise ValueError(f"policy_version {self.policy_version} < 1")


# ---------------------------------------------------------------------------------------------
# Replies


class Error(Message, frozen=True, kw_only=True):
    code: ErrorCode
    detail: str
    retryable: bool = False


class Ok(Message, frozen=True, kw_only=True):
    detail: str = ""


class Capabilities(Message, frozen=True, kw_only=True):
    role: str
    replica: ranges.Count
    mode: str = "exported"  # exported | stateless | restart_only
    restart_only: bool = False
    features: tuple[str, ...] = ()


class StatusReport(Message, frozen=True, kw_only=True):
    role: str
    replica: ranges.Count
    run: str
    pid: ranges.Count
    phase: str
    checkpoint_id: str | None = None
    lease_expires_at: ranges.Seconds | None = None
    in_flight: ranges.Count = 0
    started_at: ranges.Seconds = 0.0
    handled: ranges.Count = 0
    counts: dict[str, int] = {}
    epoch: Epoch = 0  # a participant's: the newest epoch a Restore named
    snapshots: SnapshotHealth | None = None  # the controller's: newest snapshot, last failure
    structures: dict[str, ranges.Count] = {}  # entries per named per-rollout structure (structure_sizes)


class Prepared(Message, frozen=True, kw_only=True):
    checkpoint_id: str
    parked: ranges.Count = 0
    boundaries_passed: ranges.Count = 0
    restarts: tuple[AttemptRef, ...] = ()
    waited_s: ranges.Seconds = 0.0  # how long the participant waited for its rollouts to park (tool calls)
    episodes: tuple[EpisodeRef, ...] = ()  # an agent's cut: each attempt it holds, at its saved boundary
    # With a ``base`` (the Prepare's): refs new or moved since that cut, and ``gone`` (cut_changes).
    base: BaseCut = ""
    gone: tuple[AttemptRef, ...] = ()
    receipts: tuple[Completed, ...] = ()  # its receipts not yet acknowledged: they come with the cut

    def __post_init__(self) -> None:
        if self.gone and not self.base:
            raise ValueError("gone names attempts that left a cut, but no base cut is named")


class Committed(Message, frozen=True, kw_only=True):
    checkpoint_id: str
    files: tuple[FileDigest, ...] = ()
    episodes: tuple[EpisodeRef, ...] = ()


class Persisted(Message, frozen=True, kw_only=True):
    checkpoint_id: str
    files: tuple[FileDigest, ...] = ()


class Restored(Message, frozen=True, kw_only=True):
    checkpoint_id: str
    rollouts: tuple[AttemptRef, ...] = ()


class SnapshotTaken(Message, frozen=True, kw_only=True):
    snapshot: str  # snapshot_<seq>, or "" when skipped (nothing new since the last one)
    checkpoint_id: str = ""
    skipped: bool = False


class WeightsLoaded(Message, frozen=True, kw_only=True):
    policy_version: ranges.Count
    directory: str
    replicas: ranges.Count
    seconds: ranges.Seconds


class ProbeResult(Message, frozen=True, kw_only=True):
    pid: ranges.Count
    executions: ranges.Count
    note: str = ""


# ---------------------------------------------------------------------------------------------
# Data messages


class TaskOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """How an agent runs one attempt: the controller's settings for it, carried on ``Run``. Only what
    differs from the defaults goes on the wire (the keys the controller has always sent)."""

    agent: str = "tool"  # the agent program
    resources: ranges.Count | None = None  # its tool server; None: the agent's own number
    policy: ranges.Count | None = None  # the policy replica its model calls go to; None: the agent's own
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=ranges.MAX_TOKENS)] = 160  # per model call
    fail_at_turn: ranges.Turns | None = None  # an injected failure (faults.*)
    # A restored attempt: the turns its saved transcript holds (the agent restored that transcript).
    continue_from: ranges.Turns | None = None
    tokenizer: str | None = None  # a model directory whose chat template renders the prompts
    hold_at_turn: ranges.Turns | None = None  # the demo: attempt 0 parks there for good


class Run(Message, frozen=True, kw_only=True):
    """Controller -> agent: run (or continue) one attempt of a rollout."""

    rollout_id: str
    attempt: ranges.Count
    group_id: str
    env: str
    prompt: str
    max_turns: ranges.Turns = 8
    seed: ranges.Int64 = 0
    policy_version: ranges.Count = 0
    task: TaskOptions = TaskOptions()
    epoch: ranges.Count = 0  # the dispatching controller's incarnation (+1 per restore)

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt)


class Generate(Message, frozen=True, kw_only=True):
    """Agent -> policy: one model call."""

    rollout_id: str
    attempt: ranges.Count
    call_index: ranges.Count
    token_ids: tuple[ranges.TokenId, ...]
    seed: ranges.Int64 = 0
    max_tokens: ranges.TokenBudget = 64
    stop_token_ids: tuple[ranges.TokenId, ...] = ()
    policy_version: ranges.Count = 0  # the version the rollout was dispatched with
    epoch: Epoch = 0

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt, self.call_index)
        _check_tokens("token_ids", self.token_ids)
        _check_tokens("stop_token_ids", self.stop_token_ids)
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens {self.max_tokens} is negative")


class Generated(Message, frozen=True, kw_only=True):
    rollout_id: str
    attempt: ranges.Count
    call_index: ranges.Count
    token_ids: tuple[ranges.TokenId, ...]
    logprobs: tuple[ranges.LogProb, ...] = ()
    finish_reason: str = "stop"
    policy_version: ranges.Count = 0

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt, self.call_index)


class ToolCall(Message, frozen=True, kw_only=True):
    """Agent -> resources. (rollout_id, attempt, call_index) is the idempotency key.

    The first call of a rollout opens its session in environment ``env`` (initial state from ``seed``).
    Two tool names are reserved: ``verify`` scores the session (``output["reward"]``) and retires it;
    ``release`` retires it without a score (a rollout that ended without a clean end).
    """

    rollout_id: str
    attempt: ranges.Count
    call_index: ranges.Count
    env: str
    tool: str
    arguments: dict[str, object] = {}
    seed: ranges.Int64 = 0
    epoch: Epoch = 0
    # The tool calls the attempt had made at its last boundary (its agent's mark). A tool server keeps
    # the session as it was there while the round runs, so a snapshot need not wait for the round.
    # None: the sender does not say (a session is then saved only at a boundary).
    boundary_tools: ranges.Count | None = None

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt, self.call_index)


class ToolResult(Message, frozen=True, kw_only=True):
    rollout_id: str
    attempt: ranges.Count
    call_index: ranges.Count
    ok: bool
    output: dict[str, object] = {}
    revision: ranges.Count = 0

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt, self.call_index)


class Train(Message, frozen=True, kw_only=True):
    """Controller -> trainer: train step ``step`` on these groups. The correlation id names the
    controller's session and the step; a repeated ``Train`` of a step done is answered from the
    trainer's step record."""

    session: str  # one per controller process: the trainer refuses one it is not synced with
    step: ranges.Count
    groups: tuple[TrainGroup, ...]


class Trained(Message, frozen=True, kw_only=True):
    """Trainer -> controller: what step ``step`` did (``sdk.trainer.TrainStep``) and what it read."""

    step: ranges.Count
    policy_version: ranges.Count
    groups: ranges.Count
    samples: ranges.Count
    failed: ranges.Count
    mean_reward: ranges.Finite
    tokens: ranges.Count
    weights_dir: str | None = None
    rollouts: tuple[TrainedRollout, ...] = ()
    loss: float | None = None  # a gradient step's loss; NaN (it diverged) is reported, not refused


class TrainerSync(Message, frozen=True, kw_only=True):
    """Controller -> trainer, before its first ``Train``: go to step ``step`` (the run's anchor; 0 on a
    fresh start), dropping the records after it; ``Train`` of another session is refused from now on."""

    session: str
    step: ranges.Count


class TrainerAt(Message, frozen=True, kw_only=True):
    """Trainer -> controller: where ``TrainerSync`` left it."""

    step: ranges.Count
    policy_version: ranges.Count
    dropped: ranges.Count = 0  # steps after ``step`` the trainer had done and forgot (trained again later)


class Completed(Message, frozen=True, kw_only=True):
    """Agent -> controller: a receipt for a finished attempt. The agent keeps it until acknowledged."""

    rollout_id: str
    attempt: ranges.Count
    capture_key: str
    reward: ranges.Finite
    turns: ranges.Turns
    staging_keys: tuple[str, ...] = ()
    # The agent replica that ran it: where the Ack goes of an attempt the controller never dispatched.
    replica: ranges.Count | None = None
    epoch: Epoch = 0

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt)


class Ack(Message, frozen=True, kw_only=True):
    """Controller -> agent: one batch acknowledging many receipts. Acknowledging twice is a no-op."""

    receipts: tuple[AttemptRef, ...]


class Failed(Message, frozen=True, kw_only=True):
    """Agent -> controller: an attempt ended without a result. A typed failure, never a fake sample."""

    rollout_id: str
    attempt: ranges.Count
    code: str
    detail: str = ""
    turns: ranges.Turns = 0
    replica: ranges.Count | None = None  # as on ``Completed``
    epoch: Epoch = 0

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt)


AnyMessage = (
    Discover
    | Status
    | Prepare
    | Renew
    | Commit
    | Persist
    | Resume
    | Abort
    | Restore
    | Retire
    | Forget
    | Probe
    | Snapshot
    | LoadWeights
    | Error
    | Ok
    | Capabilities
    | StatusReport
    | Prepared
    | Committed
    | Persisted
    | Restored
    | ProbeResult
    | SnapshotTaken
    | WeightsLoaded
    | Run
    | Generate
    | Generated
    | ToolCall
    | ToolResult
    | Rows
    | SealRows
    | FetchRows
    | ReleaseRows
    | CanonicalRows
    | Train
    | Trained
    | TrainerSync
    | TrainerAt
    | Completed
    | Ack
    | Failed
    | MemoryReport
    | MemoryUsage
)

MESSAGE_TYPES: dict[str, type[Message]] = {cls.__name__: cls for cls in typing.get_args(AnyMessage)}
# Every control command, in the union's order.
CONTROL_COMMANDS = tuple(cls for cls in MESSAGE_TYPES.values() if issubclass(cls, ControlCommand))


# Commands whose effect outlives the process that handled them (files written, a snapshot published,
# a probe's journal line): their replies are journaled, fsynced before they leave, so a process that
# restarts answers a redelivery as before instead of doing it again. Every other command's effect is
# in memory and dies with the process (a cut, a phase, a fence): replaying its reply in a new process
# would claim what that process does not hold, and journaling it put fsyncs inside the snapshot pause.
DURABLE_REPLIES: tuple[type[ControlCommand], ...] = (Persist, Snapshot, Probe)


def is_control(message: Message) -> bool:
    return isinstance(message, ControlCommand)
