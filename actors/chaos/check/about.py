"""What a history record is about: the attempt it names, the rollouts its lists name."""

from __future__ import annotations

from collections.abc import Iterator

from msgspec import UNSET
from parkway.protocol.history import (
    AcksSent,
    AttemptRecord,
    AttemptsFenced,
    Record,
    Refused,
    ReplicaRestarted,
    RestoreFenced,
    RowStaged,
    SnapshotPublished,
)
from parkway.protocol.ids import parse_capture_key

NEMESIS = "nemesis"  # the actor name of the chaos harness's own records (faults injected)


def attempt_of(record: Record) -> tuple[str, int] | None:
    """The (rollout, attempt) a record is about, if it is about one: by its rollout id and attempt,
    or by a row's capture key (a key no builder makes names no attempt)."""
    if isinstance(record, AttemptRecord):
        return record.rollout_id, record.attempt
    if isinstance(record, Refused) and record.rollout_id is not UNSET and record.attempt is not UNSET:
        return record.rollout_id, record.attempt
    key = record.capture_key if isinstance(record, RowStaged | Refused) else UNSET
    if key is UNSET:
        return None
    try:
        return parse_capture_key(key)
    except ValueError:
        return None


def named_rollouts(record: Record) -> Iterator[str]:
    """The rollouts a record names in its lists of attempts (fences, acks, episodes) or rollouts."""
    if isinstance(record, AttemptsFenced | RestoreFenced):
        yield from (rollout for rollout, _ in record.attempts)
    if isinstance(record, RestoreFenced):
        yield from (rollout for rollout, _, _ in record.continued)
    if isinstance(record, AcksSent):
        yield from (rollout for rollout, _ in record.refs)
    if isinstance(record, SnapshotPublished):
        yield from (rollout for rollout, _ in record.episodes)
    if isinstance(record, ReplicaRestarted):
        yield from record.lost


def mentions(record: Record, rollout: str) -> bool:
    """Whether a record is about ``rollout``: its own attempt, or a list that names it."""
    about = attempt_of(record)
    if about is not None:
        return about[0] == rollout
    return any(named == rollout for named in named_rollouts(record))
