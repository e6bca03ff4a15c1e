"""The parts of the trainer's messages (``Train``, ``Trained`` in ``messages``) and the records the
trainer actor keeps of its steps: one file per step, written before the step is answered."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from parkway.protocol import ranges


class TrainGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One settled group of a ``Train``: its sealed siblings (canonical rows in TQ) and given-up ones."""

    group_id: str
    task_index: ranges.Count
    sealed: tuple[str, ...]
    failed: tuple[str, ...] = ()


class TrainedRollout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    rollout_id: str
    reward: ranges.Finite
    digest: str  # ``transcript_digest`` of its row, hex: the run's transcript digest adds them


class StepRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``steps/step_<N>.msgpack`` in the trainer's state directory (``layout.trainer_state_file_name``): the trainer's state after step N, the
    groups it trained, and its reply (a ``Trained``, MessagePack) for a repeated ``Train`` of N."""

    step: int
    session: str  # of the controller that asked for it
    groups: tuple[str, ...]
    state: dict[str, Any]
    reply: bytes


class TrainerFence(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``fence.msgpack``: the controller session that synced the trainer last; others are refused."""

    session: str


class InTraining(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A batch the controller handed the trainer and has no answer for: a snapshot cut then keeps it
    (its groups stay ``finalizing`` in the ledger, their rows in TQ), and a restore sends it again."""

    step: int
    groups: tuple[str, ...]


def train_correlation_id(session: str, step: int) -> str:
    """One per (controller session, step): a resend by the same controller is the same command; after
    a restart the same step is a new one (the trainer went back before it at the sync)."""
    return f"train-{session}-s{step}"


def transcript_digest(rollout_id: str, turns: list[tuple[int, tuple[int, ...]]]) -> int:
    """A rollout's id and tokens, turn by turn, as a 256-bit number."""
    h = hashlib.sha256(rollout_id.encode())
    for turn, token_ids in turns:
        h.update(f"/{turn}:{','.join(map(str, token_ids))};".encode())
    return int.from_bytes(h.digest(), "big")
