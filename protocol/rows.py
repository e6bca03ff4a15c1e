"""The TransferQueue's messages: staging rows per model call, canonical rows per sealed rollout, and what
the controller and the trainer ask of them. Part of the one tagged union (``messages.py``)."""

from __future__ import annotations

import msgspec
from parkway.protocol import ranges
from parkway.protocol.message_base import Message, check_attempt

# The timeline a data message belongs to: the epoch of the Run its attempt was dispatched with (0: unstamped).
Epoch = ranges.Count


class TokenSegment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A run of a staging row's tokens sampled by one attempt under one policy version. A call that a
    crash cut off and a restore continued (``recovery.target_level: prefix``) has two or more: the
    prefix the snapshot kept, sampled by the attempt that died, then what the continuing attempt
    sampled. A trainer reads per-token versions from them (each token's version is its segment's)."""

    tokens: ranges.Count
    attempt: ranges.Count
    policy_version: ranges.Count = 0
    checkpoint_id: str = ""  # the snapshot that kept these tokens; "" for those this row's call sampled


class StagingRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    capture_key: str
    turn: ranges.Count
    token_ids: tuple[ranges.TokenId, ...]
    logprobs: tuple[ranges.LogProb, ...] = ()
    policy_version: ranges.Count = 0
    # The tokens the call was prompted with: a trainer scores the sampled tokens in their context.
    # Empty in rows written before it existed (they still decode) and where a writer leaves it out.
    prompt_token_ids: tuple[ranges.TokenId, ...] = ()
    # Where the tokens came from, in order, when not all from this row's call under ``policy_version``
    # (empty: they all are). The segments' tokens add up to ``len(token_ids)``.
    segments: tuple[TokenSegment, ...] = ()

    def __post_init__(self) -> None:
        if self.segments and sum(s.tokens for s in self.segments) != len(self.token_ids):
            raise ValueError(
                f"segments cover {sum(s.tokens for s in self.segments)} tokens of {len(self.token_ids)}"
            )

    def token_versions(self) -> tuple[int, ...]:
        """The policy version each token was sampled under."""
        if not self.segments:
            return (self.policy_version,) * len(self.token_ids)
        return tuple(v for s in self.segments for v in (s.policy_version,) * s.tokens)


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
