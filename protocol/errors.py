"""The typed error vocabulary every actor speaks, on the wire and inside the process."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    STALE_CHECKPOINT = "stale_checkpoint"  # the id already ended (resumed, aborted or lapsed) here
    CHECKPOINT_CONFLICT = "checkpoint_conflict"  # another checkpoint id is active
    INVALID_PHASE = "invalid_phase"  # the command is illegal in the participant's phase
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the command's absolute deadline has passed
    STALE_ATTEMPT = "stale_attempt"  # a message from an attempt that a newer one replaced
    STALE_EPOCH = "stale_epoch"  # a data message of a timeline a restore ended (an older epoch)
    ADMISSION_CLOSED = "admission_closed"  # the gate is closed for a checkpoint; try after resume
    UNAUTHORIZED = "unauthorized"  # missing or wrong signature, or a message from another run
    INVALID_MESSAGE = "invalid_message"  # bytes that are not a valid message of this schema
    UNSUPPORTED_VERSION = "unsupported_version"  # a schema version this actor does not speak
    UNAVAILABLE = "unavailable"  # the receiver cannot serve it now (not wired, shutting down, no route)
    INTERNAL = "internal"  # the handler failed; the message was dead-lettered for inspection


# Errors that a retry of the same command (same id) can fix. Everything else is a verdict.
RETRYABLE_CODES = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.ADMISSION_CLOSED, ErrorCode.UNAVAILABLE})


class ProtocolError(Exception):
    """An error with a wire code. Raised by pure code and handlers; the runtime turns it into a reply."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES
