"""A reply the transport cannot send (issue 14: after a broker restart every reply failed and the error
escaped the delivery handler): the delivery is left for redelivery, and the redelivery is answered from
the reply cache, the command executed once. On the in-memory broker, its reply failing on purpose."""

from __future__ import annotations

import time
from pathlib import Path

from parkway.actors.roles.tq import TransferQueue
from parkway.actors.runtime.client import Client
from parkway.brokers.base import BrokerError, Envelope
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.messages import Probe, ProbeResult

from tests.support.signed import SECRET

RUN = "unit"


class FlakyReplies(MemoryBroker):
    """A connection whose first ``failures`` replies fail, as they do while a broker restarts."""

    def __init__(self, hub: MemoryHub, run: str, failures: int) -> None:
        super().__init__(hub, run)
        self.failures = failures
        self.sent = 0

    async def reply(self, reply_to: str, envelope: Envelope) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise BrokerError("reply failed: the channel is closed")
        self.sent += 1
        await super().reply(reply_to, envelope)


async def test_a_reply_that_cannot_be_sent_is_redelivered_and_answered_from_the_cache(tmp_path: Path) -> None:
    hub = MemoryHub()
    async with FlakyReplies(hub, RUN, failures=2) as server, MemoryBroker(hub, RUN) as requester:
        tq = TransferQueue(server, secret=SECRET, replica=0, state_dir=tmp_path / "tq")
        await tq.start()
        try:
            client = Client(requester, secret=SECRET, sender="test/0")
            reply = await client.request(
                "tq/0", Probe(checkpoint_id="p-1", deadline=time.time() + 10, note="x")
            )
            assert isinstance(reply, ProbeResult) and reply.executions == 1  # run once, answered at last
            assert tq.counts["Probe"] == 1 and tq.counts["reply_failed"] == 2 and tq.counts["replayed"] == 2
            assert server.sent == 1 and requester.duplicate_replies == 0
        finally:
            await tq.stop()
