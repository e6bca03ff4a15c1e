"""The timeline of data messages: an epoch, raised by the controller on every restore.

Attempt numbers repeat across a restore (the restored ledger hands out attempt N+1 again), so a
message of the timeline that died, still queued or sent by a process the restore did not reach, would
name the same keys as the new timeline's. Every data message an attempt sends carries the epoch of the
``Run`` it was dispatched with; a receiver that has seen a newer epoch (in a ``Restore``) refuses it as
``stale_epoch``. Epoch 0 is unstamped (a hand-written message): it is refused only after a restore.
"""

from __future__ import annotations

from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import Completed, Failed, Generate, Message, Rows, ToolCall

# The messages that carry the epoch of the attempt they belong to.
EPOCH_STAMPED = (Generate, ToolCall, Rows, Completed, Failed)


def check_epoch(message: Message, timeline: int) -> None:
    """Refuse ``message`` (``stale_epoch``) when it is stamped with an epoch older than ``timeline``,
    the newest one the receiver knows."""
    if not isinstance(message, EPOCH_STAMPED):
        return
    epoch = message.epoch
    if epoch < timeline:
        raise ProtocolError(
            ErrorCode.STALE_EPOCH,
            f"{type(message).__name__} of epoch {epoch}: this receiver is at epoch {timeline} (restored)",
        )
