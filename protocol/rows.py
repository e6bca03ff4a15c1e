"""The TransferQueue's messages: staging rows per model call, canonical rows per sealed rollout, and what
the controller and the trainer ask of them. Part of the one tagged union (``messages.py``)."""

from __future__ import annotations

import msgspec
from parkway.protocol import ranges
from parkway.protocol.message_base import Message, check_attempt

# The timeline a data message belongs to: the epoch of the Run its attempt was dispatched with (0: unstamped).
Epoch = ranges.Count


class StagingRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    capture_key: str
    turn: ranges.Count
    token_ids: tuple[ranges.TokenId, ...]
    logprobs: tuple[ranges.LogProb, ...] = ()
    policy_version: ranges.Count = 0
    # The tokens the call was prompted with: a trainer scores the sampled tokens in their context.
    # Empty in rows written before it existed (they still decode) and where a writer leaves it out.
    prompt_token_ids: tuple[ranges.TokenId, ...] = ()


class Rows(Message, frozen=True, kw_only=True):
    """Policy or agent -> TQ: staging rows, one per model call."""

    rows: tuple[StagingRow, ...]
    epoch: Epoch = 0  # the epoch of the Generate that made them


class SealRows(Message, frozen=True, kw_only=True):
    """Controller -> TQ: the attempt is sealed; make its staging rows the rollout's canonical row."""

    rollout_id: str
    attempt: ranges.Count
    capture_key: str
    reward: ranges.Finite
    # "<capture key>:<turn>" per turn; a continued attempt's first turns come from the attempt before.
    staging_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_attempt(self.rollout_id, self.attempt)


class CanonicalRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A finished rollout as the trainer reads it: one staging row per model call, in turn order."""

    rollout_id: str
    attempt: ranges.Count
    capture_key: str
    reward: ranges.Finite
    turns: tuple[StagingRow, ...]


class FetchRows(Message, frozen=True, kw_only=True):
    """Trainer (controller) -> TQ: read canonical rows."""

    rollout_ids: tuple[str, ...]


class ReleaseRows(Message, frozen=True, kw_only=True):
    """Trainer (controller) -> TQ: the trainer consumed these rollouts; drop their canonical row and the
    staging rows of every attempt (a snapshot then carries only rows still to be trained on)."""

    rollout_ids: tuple[str, ...]


class CanonicalRows(Message, frozen=True, kw_only=True):
    rows: tuple[CanonicalRow, ...]
    missing: tuple[str, ...] = ()
