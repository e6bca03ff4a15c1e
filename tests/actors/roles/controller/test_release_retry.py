"""A release of trained rows whose reply is lost with the broker connection (a broker restarting) is
sent again, not the end of the run: found by the chaos run, where it ended a controller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from parkway.brokers.base import BrokerError
from parkway.protocol.messages import ReleaseRows

from tests.support.embedded import SNAPSHOT_RUN, embedded_run


@pytest.mark.asyncio
async def test_a_release_whose_reply_is_lost_is_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from parkway.actors.runtime.client import Client

    real = Client.call
    lost: list[str] = []

    async def reply_lost_once(self: Client, address: str, message: Any, **kwargs: Any) -> Any:
        if isinstance(message, ReleaseRows) and not lost:
            lost.append(address)
            raise BrokerError("the broker connection was lost: a reply to this request can no longer arrive")
        return await real(self, address, message, **kwargs)

    monkeypatch.setattr(Client, "call", reply_lost_once)
    summary = await embedded_run(SNAPSHOT_RUN, tmp_path, snapshots=False)
    assert lost == ["tq/0"]  # the fault happened
    assert summary.train_steps >= 1 and summary.rollouts_sealed == 9 and summary.rollouts_failed == 0
