"""Memory inspection and the bounded reply journal on a real actor process over RabbitMQ."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from parkway.actors.runtime.client import Client
from parkway.protocol.messages import MemoryReport, MemoryUsage, Probe, ProbeResult

from tests.support.processes import status_of, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def ask(**fields: object) -> MemoryReport:
    return MemoryReport(checkpoint_id=f"mem-{time.monotonic_ns()}", deadline=time.time() + 30, **fields)


async def test_a_live_actor_reports_its_memory_and_bounds_its_journal(
    spawn, client: Client, tmp_path
) -> None:
    budget = 64 << 10
    tq = spawn("tq", PARKWAY_TRACEMALLOC="1", PARKWAY_REPLY_JOURNAL_MAX_BYTES=str(budget))
    await wait_ready(client, tq)
    for n in range(120):  # each reply journalled, about 1.2 KB: twice the budget in all
        reply = await client.request(
            "tq/0", Probe(checkpoint_id=f"jr-{n}", deadline=time.time() + 30, note="x" * 1000)
        )
        assert isinstance(reply, ProbeResult)
    journal = next((tmp_path / "state" / "state").glob("*/tq/0/replies.journal"))
    assert 0 < journal.stat().st_size <= budget
    status = await status_of(client, "tq/0")
    assert status.structures["reply_journal_bytes"] == journal.stat().st_size
    assert status.structures["reply_cache"] < 120  # the oldest were compacted away with the journal

    usage = await client.request("tq/0", ask(top=5))
    assert isinstance(usage, MemoryUsage) and usage.pid == tq.pid
    assert usage.tracing and len(usage.top) == 5 and usage.traced_bytes > 0  # traced from boot
    assert usage.rss_bytes > 0 and usage.structures["reply_cache"] == status.structures["reply_cache"]
    stopped = await client.request("tq/0", ask(stop=True))
    assert isinstance(stopped, MemoryUsage) and not stopped.tracing

    tq.signal(signal.SIGUSR2)
    for _ in range(100):
        if '"memory_report"' in tq.log_text():
            break
        await asyncio.sleep(0.1)
    line = next(text for text in tq.log_text().splitlines() if '"memory_report"' in text)
    assert f'"pid":{tq.pid},' in line.replace(" ", "")
    assert "reply_journal_bytes" in line and "tracemalloc is off" in line
    await status_of(client, "tq/0")  # and it carries on serving
