"""The epoch rule of data messages (``protocol/epochs.py``): older than the receiver's timeline is refused."""

from __future__ import annotations

import time

import pytest
from parkway.protocol.epochs import check_epoch
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import Completed, Failed, Generate, Message, Prepare, Rows, ToolCall

STAMPED: list[Message] = [
    Generate(rollout_id="r_g0", attempt=1, call_index=0, token_ids=(1,), epoch=2),
    ToolCall(rollout_id="r_g0", attempt=1, call_index=0, env="counter", tool="add", epoch=2),
    Rows(rows=(), epoch=2),
    Completed(rollout_id="r_g0", attempt=1, capture_key="r_g0-a1", reward=0.0, turns=1, epoch=2),
    Failed(rollout_id="r_g0", attempt=1, code="garbage", epoch=2),
]


@pytest.mark.parametrize("message", STAMPED, ids=lambda m: type(m).__name__)
def test_a_data_message_of_an_older_epoch_is_refused_and_its_own_or_newer_is_not(message: Message) -> None:
    check_epoch(message, 2)
    check_epoch(message, 1)
    with pytest.raises(ProtocolError) as refused:
        check_epoch(message, 3)
    assert refused.value.code is ErrorCode.STALE_EPOCH and not refused.value.retryable
    assert "epoch 2" in refused.value.detail and "epoch 3" in refused.value.detail


def test_control_commands_carry_no_epoch_and_pass() -> None:
    check_epoch(Prepare(checkpoint_id="ck-1", deadline=time.time() + 5), 9)


def test_an_unstamped_message_passes_until_a_restore() -> None:
    unstamped = Rows(rows=())
    check_epoch(unstamped, 0)
    with pytest.raises(ProtocolError):
        check_epoch(unstamped, 2)
