"""History records: one typed record per fact an actor reports, as a history file holds it.

A history file is JSON lines, one record a line: ``actors/runtime/history.py`` writes and reads the
files, ``actors/chaos/check`` verifies a run's invariants over them. Each record is one of the Structs
below, tagged by its kind in the field ``k`` (``"seal"``, ``"mutation"``...). Every record has the
common fields ``t`` (wall clock), ``n`` (its number in its file), ``actor``, ``pid`` and ``inc`` (the
incarnation: the pid, or ``<pid>.<k>`` for the k-th run of one actor inside one process); the writer
fills them in.

In the files the fields keep the short names they had before these types (``r``, ``a``, ``i``, ``ck``,
``cid``...), so files written then still read; the attributes say what each one is. A field that only
some writers of a kind set (a receipt from an agent and one from the controller) is ``UNSET`` when
absent, and absent from the line as it was.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType, field

COMMON_FIELDS = ("t", "n", "k", "actor", "pid", "inc")  # in every record, in the order errors name them

AttemptPair = tuple[str, int]  # (rollout id, attempt), a JSON array of two in the files

_encoder = msgspec.json.Encoder()


class HistoryFormatError(ValueError):
    """A history line or record that is not one of the kinds below; says which and why."""


class Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="k"):
    """What every record has. Its kind is the tag: ``record.kind`` is the file's ``k``."""

    t: float = 0.0
    n: int = 0
    actor: str = ""
    pid: int = 0
    inc: str = ""  # the incarnation: one process's run of one actor

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)

    @property
    def role(self) -> str:
        return self.actor.split("/", 1)[0]

    @property
    def fields(self) -> dict[str, Any]:
        """This kind's own fields as the file holds them: its names, JSON values (what ``line`` shows)."""
        data: dict[str, Any] = msgspec.json.decode(_encoder.encode(self))
        for key in COMMON_FIELDS:
            data.pop(key, None)
        return data

    def to_json(self) -> dict[str, Any]:
        """The record as its line holds it: the common fields first, then the kind's own."""
        common = {"t": self.t, "n": self.n, "k": self.kind, "actor": self.actor, "pid": self.pid}
        return {**common, "inc": self.inc, **self.fields}

    def line(self, t0: float = 0.0) -> str:
        """One readable line: time since ``t0``, actor and incarnation, kind, then the other fields."""
        rest = " ".join(f"{key}={_short(value)}" for key, value in self.fields.items())
        return f"{self.t - t0:9.3f}s {self.actor:<13} {self.inc:>9} {self.kind:<18} {rest}".rstrip()


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else _encoder.encode(value).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the shapes several kinds share ---------------------------------------------------------------
class AttemptRecord(Record, frozen=True, kw_only=True):
    """A fact about one attempt of one rollout."""

    rollout_id: str = field(name="r")
    attempt: int = field(name="a")


class CallRecord(AttemptRecord, frozen=True, kw_only=True):
    """A fact about one model or tool call of an attempt (its index within the attempt)."""

    call_index: int = field(name="i")


class CheckpointRecord(Record, frozen=True, kw_only=True):
    """A fact about one checkpoint (a snapshot being taken)."""

    checkpoint_id: str = field(name="cid")


class RestoreRecord(Record, frozen=True, kw_only=True):
    """A fact about one restore, by the id the controller gave it."""

    restore_id: str = field(name="rid")


# -- every actor ------------------------------------------------------------------------------------
class Started(Record, frozen=True, kw_only=True, tag="started"):
    started_at: float  # the actor's own start time (its status reports carry it)


class AttemptsFenced(CheckpointRecord, frozen=True, kw_only=True, tag="fence"):
    """A participant retired these attempts: from now on it accepts nothing of them."""

    attempts: tuple[AttemptPair, ...]


class PhaseChanged(CheckpointRecord, frozen=True, kw_only=True, tag="phase"):
    event: str = field(name="on")  # what moved it: a command, or "lapse"
    after: str  # the phase it is in now


class SnapshotInstalled(Record, frozen=True, kw_only=True, tag="restored"):
    """An actor installed a snapshot. An agent says how many rollouts it stopped and continues; TQ
    says which checkpoint, from where, and how many rows it now holds."""

    epoch: int | UnsetType = UNSET
    stopped: int | UnsetType = UNSET
    continuing: int | UnsetType = UNSET
    checkpoint_id: str | UnsetType = field(default=UNSET, name="cid")
    location: str | UnsetType = UNSET
    staged: int | UnsetType = UNSET
    canonical: tuple[str, ...] | UnsetType = UNSET


class Refused(Record, frozen=True, kw_only=True, tag="refused"):
    """A message of a fenced attempt turned away: a policy names the attempt, TQ the row's key."""

    rollout_id: str | UnsetType = field(default=UNSET, name="r")
    attempt: int | UnsetType = field(default=UNSET, name="a")
    capture_key: str | UnsetType = field(default=UNSET, name="ck")
    turn: int | UnsetType = field(default=UNSET, name="i")
    code: str


class Receipt(AttemptRecord, frozen=True, kw_only=True, tag="receipt"):
    """An attempt's ending: sent by its agent (with ``code`` and ``turns``), or handled by the
    controller (with ``outcome``; a failure also with its ``code`` and what the ledger does next)."""

    of: str  # "completed" or "failed"
    code: str | UnsetType | None = UNSET
    turns: int | UnsetType = UNSET
    outcome: str | UnsetType = UNSET
    redo: tuple[str, ...] | UnsetType = UNSET
    given_up: tuple[str, ...] | UnsetType = UNSET


# -- the agent --------------------------------------------------------------------------------------
class RunReceived(AttemptRecord, frozen=True, kw_only=True, tag="run"):
    epoch: int
    outcome: str  # "accepted", "stale" or "duplicate"
    continue_from: int | UnsetType | None = UNSET  # accepted runs only: the saved turns it resumes from


class ReceiptAcked(AttemptRecord, frozen=True, kw_only=True, tag="acked"):
    pass


class ContinuationRestored(AttemptRecord, frozen=True, kw_only=True, tag="continuation"):
    saved_attempt: int
    kept_model: int  # saved model calls the attempt replays instead of generating again
    kept_tools: int


class RolloutStopped(AttemptRecord, frozen=True, kw_only=True, tag="stopped"):
    turns: int


class ModelCallReplayed(CallRecord, frozen=True, kw_only=True, tag="model_replayed"):
    pass


class ModelCallSent(CallRecord, frozen=True, kw_only=True, tag="model_call"):
    pass


class ModelReplyReceived(CallRecord, frozen=True, kw_only=True, tag="model_reply"):
    pass


class ToolCallReplayed(CallRecord, frozen=True, kw_only=True, tag="tool_replayed"):
    tool: str


class ToolCallSent(CallRecord, frozen=True, kw_only=True, tag="tool_call"):
    tool: str
    resources: str = field(name="to")  # the resources actor's address


class ToolResultReceived(CallRecord, frozen=True, kw_only=True, tag="tool_result"):
    ok: bool
    revision: int = field(name="rev")


# -- resources --------------------------------------------------------------------------------------
class SessionOpened(CallRecord, frozen=True, kw_only=True, tag="session_opened"):
    pass


class DuplicateToolCall(CallRecord, frozen=True, kw_only=True, tag="duplicate"):
    tool: str


class MutationApplied(CallRecord, frozen=True, kw_only=True, tag="mutation"):
    tool: str
    revision: int = field(name="rev")
    effect: dict[str, Any]


class SessionReleased(AttemptRecord, frozen=True, kw_only=True, tag="released"):
    pass


class SessionVerified(AttemptRecord, frozen=True, kw_only=True, tag="verified"):
    reward: float
    revision: int = field(name="rev")
    applied: tuple[int, ...]  # the call indexes of the mutations the session applied
    recorded: int  # the mutations the agent's record lists


class SessionRestored(AttemptRecord, frozen=True, kw_only=True, tag="session_restored"):
    saved_attempt: int
    revision: int = field(name="rev")
    applied: tuple[int, ...]


# -- the policy -------------------------------------------------------------------------------------
class GenerationStarted(CallRecord, frozen=True, kw_only=True, tag="generate"):
    pass


class GenerationFinished(CallRecord, frozen=True, kw_only=True, tag="generated"):
    pass


class GenerationAborted(AttemptRecord, frozen=True, kw_only=True, tag="aborted"):
    request_id: str = field(name="request")


# -- TQ ---------------------------------------------------------------------------------------------
class RowStaged(Record, frozen=True, kw_only=True, tag="staged"):
    capture_key: str = field(name="ck")
    turn: int = field(name="i")


class RowSealed(AttemptRecord, frozen=True, kw_only=True, tag="sealed"):
    capture_key: str = field(name="ck")
    turns: tuple[int, ...]
    replaced: str | None  # the capture key of the canonical row this one replaced


class RowUnsealed(AttemptRecord, frozen=True, kw_only=True, tag="unsealed"):
    """TQ dropped the canonical row of an attempt it was told to fence (the controller gave up on it
    while its seal was on the way: that rollout's next attempt seals instead)."""

    capture_key: str = field(name="ck")


# -- the controller: the run ------------------------------------------------------------------------
class RunStarted(Record, frozen=True, kw_only=True, tag="run_started"):
    restored: bool
    epoch: int
    expected: tuple[str, ...]  # every rollout id the run must seal


class RunFinished(Record, frozen=True, kw_only=True, tag="run_finished"):
    sealed: int
    failed: int
    expected: int
    transcripts_sha256: str


class RunAborted(Record, frozen=True, kw_only=True, tag="run_aborted"):
    error: str


class Dispatched(AttemptRecord, frozen=True, kw_only=True, tag="dispatch"):
    epoch: int
    replica: int
    continue_from: int | None


class RolloutSealed(AttemptRecord, frozen=True, kw_only=True, tag="seal"):
    capture_key: str = field(name="ck")
    reward: float
    seq: int  # this controller's seals so far, this one included


class AcksSent(Record, frozen=True, kw_only=True, tag="ack"):
    replica: int
    refs: tuple[AttemptPair, ...]


class RolloutStalled(AttemptRecord, frozen=True, kw_only=True, tag="stalled"):
    pass


class ReplicaRestarted(Record, frozen=True, kw_only=True, tag="replica_restarted"):
    replica: int
    lost: tuple[str, ...]  # the rollouts it was running, restarted


# -- the controller: snapshots ----------------------------------------------------------------------
class OrphanAborted(CheckpointRecord, frozen=True, kw_only=True, tag="orphan_aborted"):
    participants: tuple[str, ...]


class SnapshotStep(CheckpointRecord, frozen=True, kw_only=True, tag="snap"):
    step: str  # the save step beginning


class SnapshotSkipped(CheckpointRecord, frozen=True, kw_only=True, tag="snap_skipped"):
    pass


class SnapshotFailed(CheckpointRecord, frozen=True, kw_only=True, tag="snap_failed"):
    step: str
    detail: str
    transient: bool


class SnapshotAborted(CheckpointRecord, frozen=True, kw_only=True, tag="snap_aborted"):
    step: str


class LedgerCaptured(CheckpointRecord, frozen=True, kw_only=True, tag="captured"):
    seals: int  # the controller's seals the captured ledger holds


class SnapshotPublished(CheckpointRecord, frozen=True, kw_only=True, tag="published"):
    snapshot: str  # its directory name
    episodes: tuple[AttemptPair, ...]


class SnapshotDone(CheckpointRecord, frozen=True, kw_only=True, tag="snap_done"):
    snapshot: str


# -- the controller: restores -----------------------------------------------------------------------
class RestoreStarted(RestoreRecord, frozen=True, kw_only=True, tag="restore_started"):
    snapshot: str
    saved_checkpoint_id: str = field(name="saved_cid")


class RestoreFenced(RestoreRecord, frozen=True, kw_only=True, tag="fenced"):
    """A restore stopped the dead timeline's attempts everywhere and continues these ones."""

    snapshot: str
    saved_checkpoint_id: str = field(name="saved_cid")
    epoch: int
    attempts: tuple[AttemptPair, ...]
    continued: tuple[tuple[str, int, int], ...]  # (rollout id, attempt, replica)


class RestoreFailed(RestoreRecord, frozen=True, kw_only=True, tag="restore_failed"):
    step: str


class RestoreDone(RestoreRecord, frozen=True, kw_only=True, tag="restore_done"):
    snapshot: str


# -- the chaos harness ------------------------------------------------------------------------------
class FaultInjected(Record, frozen=True, kw_only=True, tag="fault"):
    fault: str
    target: str
    step: str
    detail: str


class UnplannedExit(Record, frozen=True, kw_only=True, tag="unplanned_exit"):
    target: str
    code: int | None


AnyRecord = (
    Started
    | AttemptsFenced
    | PhaseChanged
    | SnapshotInstalled
    | Refused
    | Receipt
    | RunReceived
    | ReceiptAcked
    | ContinuationRestored
    | RolloutStopped
    | ModelCallReplayed
    | ModelCallSent
    | ModelReplyReceived
    | ToolCallReplayed
    | ToolCallSent
    | ToolResultReceived
    | SessionOpened
    | DuplicateToolCall
    | MutationApplied
    | SessionReleased
    | SessionVerified
    | SessionRestored
    | GenerationStarted
    | GenerationFinished
    | GenerationAborted
    | RowStaged
    | RowSealed
    | RowUnsealed
    | RunStarted
    | RunFinished
    | RunAborted
    | Dispatched
    | RolloutSealed
    | AcksSent
    | RolloutStalled
    | ReplicaRestarted
    | OrphanAborted
    | SnapshotStep
    | SnapshotSkipped
    | SnapshotFailed
    | SnapshotAborted
    | LedgerCaptured
    | SnapshotPublished
    | SnapshotDone
    | RestoreStarted
    | RestoreFenced
    | RestoreFailed
    | RestoreDone
    | FaultInjected
    | UnplannedExit
)
_SHAPES = (Record, AttemptRecord, CallRecord, CheckpointRecord, RestoreRecord)
KINDS: dict[str, type[Record]] = {str(cls.__struct_config__.tag): cls for cls in typing.get_args(AnyRecord)}


def _every_kind(base: type[Record]) -> set[type[Record]]:
    found: set[type[Record]] = set()
    for sub in base.__subclasses__():
        found |= {sub} | _every_kind(sub)
    return found


# Checked at import: a kind left out of the union could be written, yet never read back.
if len(KINDS) != len(typing.get_args(AnyRecord)):
    raise TypeError("two history record kinds share a tag")
if _every_kind(Record) - set(_SHAPES) != set(KINDS.values()):
    raise TypeError("a history record kind is missing from AnyRecord")

_decoder = msgspec.json.Decoder(AnyRecord)


def encode_line(record: Record) -> bytes:
    """One line of a history file, newline included."""
    return _encoder.encode(record) + b"\n"


def parse_line(line: bytes | str, where: str = "") -> Record:
    """The record on one line; ``HistoryFormatError`` (naming ``where``) if it is not one."""
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise HistoryFormatError(_why_not(line, where, exc)) from None
    except msgspec.DecodeError as exc:
        raise HistoryFormatError(f"{where}: not JSON: {exc}") from None


def _why_not(line: bytes | str, where: str, exc: msgspec.ValidationError) -> str:
    """The reason a JSON line is no record, said in terms of the format rather than the decoder's."""
    data = msgspec.json.decode(line)
    if not isinstance(data, dict) or any(key not in data for key in COMMON_FIELDS):
        return f"{where}: a record needs the fields {', '.join(COMMON_FIELDS)}"
    if data["k"] not in KINDS:
        return f"{where}: unknown record kind {data['k']!r}"
    return f"{where}: a {data['k']} record: {exc}"


def record_from_fields(kind: str, /, **fields: Any) -> Record:
    """A record of ``kind`` from fields named as in the file (``r``, ``a``, ``cid``...; the common
    ones may be given too), checked against that kind: an unknown kind or field, a missing field or a
    wrong type raises ``HistoryFormatError``."""
    cls = KINDS.get(kind)
    if cls is None:
        raise HistoryFormatError(f"unknown record kind {kind!r}")
    known = {f.encode_name for f in msgspec.structs.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise HistoryFormatError(
            f"a {kind} record has no field {', '.join(unknown)} (its fields: {', '.join(sorted(known))})"
        )
    try:
        return msgspec.convert({**fields, "k": kind}, cls)
    except msgspec.ValidationError as exc:
        raise HistoryFormatError(f"a {kind} record: {exc}") from None
