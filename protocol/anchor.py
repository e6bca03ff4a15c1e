"""What the controller saves beside its ledger: its anchor, the ledger file and the trainer's fallback.

``ledger.msgpack`` in a snapshot is a ``LedgerFile``: the ledger's own encoding and the controller's
``ControllerAnchor``. A trainer checkpoint's ``fallback_<step>.msgpack`` is the anchor alone, written
before the snapshot anchored at that step (a restore falls back to it when that snapshot never
published). Every reader decodes through ``decode_ledger_file`` or ``decode_anchor``, which also read
the anchors older snapshots hold: with ``sealed_rows`` (every trained rollout and its reward) instead
of the sums, and without ``next_task``, ``first_in_play`` or ``trained_groups``.
"""

from __future__ import annotations

import msgspec
from parkway.protocol.training import InTraining

TRANSCRIPTS_BITS = 256


class ControllerAnchor(msgspec.Struct, kw_only=True):
    """The trainer anchor, the task cursor and the run's counters; nothing in it grows with the run."""

    policy_version: int
    epoch: int  # the incarnation of the controller that wrote it; a restore runs as epoch + 1
    train_steps: int
    # The task cursor: the tasks before it were admitted. None in anchors from before the cursor,
    # when every task was admitted at the start (so all of them are in that ledger).
    next_task: int | None = None
    first_in_play: int = 0  # every group before it was trained
    # What the trainer received, as sums: rollouts, their rewards, and their token digests added up
    # modulo 2**256 (hex), so that a run's transcript digest survives a restore.
    sealed: int = 0
    reward_sum: float = 0.0
    transcripts: str = "0" * (TRANSCRIPTS_BITS // 4)
    trained_groups: list[str] = []  # the trained groups from ``first_in_play`` to the cursor
    counts: dict[str, int] = {}
    # The batch handed to the trainer and not answered at the cut: a restore sends it again.
    training: InTraining | None = None
    # The run's session tag (``ids.task_group_id``): 0, or the tag of a session started afresh on
    # actors that served the run before; a restore continues it under the same ids.
    session: int = 0

    @property
    def transcripts_sum(self) -> int:
        return int(self.transcripts, 16)


def transcripts_hex(total: int) -> str:
    """The ``transcripts`` field of a sum of rollout digests."""
    return f"{total % 2**TRANSCRIPTS_BITS:0{TRANSCRIPTS_BITS // 4}x}"


class _StoredAnchor(ControllerAnchor, kw_only=True):
    """An anchor as any snapshot may hold it: from before the sums, it lists every trained rollout."""

    sealed_rows: dict[str, float] | None = None


def _current(stored: _StoredAnchor) -> ControllerAnchor:
    fields = {f: getattr(stored, f) for f in ControllerAnchor.__struct_fields__}
    if stored.sealed_rows is not None:  # from before the sums: their digests were not kept
        rewards = stored.sealed_rows.values()
        fields.update(sealed=len(rewards), reward_sum=float(sum(rewards)), transcripts=transcripts_hex(0))
    return ControllerAnchor(**fields)


class LedgerFile(msgspec.Struct):
    """``ledger.msgpack``: the ledger (``Ledger.export``) and the anchor cut with it."""

    ledger: bytes
    controller: ControllerAnchor


class _StoredLedgerFile(msgspec.Struct):
    ledger: bytes
    controller: _StoredAnchor


def encode_ledger_file(record: LedgerFile) -> bytes:
    return msgspec.msgpack.encode(record)


def decode_ledger_file(data: bytes) -> LedgerFile:
    """Raises ``msgspec.DecodeError`` (not MessagePack) or ``msgspec.ValidationError`` (another shape)."""
    stored = msgspec.msgpack.decode(data, type=_StoredLedgerFile)
    return LedgerFile(ledger=stored.ledger, controller=_current(stored.controller))


def encode_anchor(anchor: ControllerAnchor) -> bytes:
    """A trainer checkpoint's fallback marker."""
    return msgspec.msgpack.encode(anchor)


def decode_anchor(data: bytes) -> ControllerAnchor:
    return _current(msgspec.msgpack.decode(data, type=_StoredAnchor))
