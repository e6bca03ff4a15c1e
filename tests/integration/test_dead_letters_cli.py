"""The bounded dead-letter queue with a live actor process and the ``parkway dead-letters`` verbs, on
the real RabbitMQ (issue 21: the queue had no bound, and nothing could show or empty it): a full queue
refuses what an actor dead-letters, the actor counts it (status and ``parkway_dead_letters_dropped``),
``show`` leaves the letters where they are, ``purge`` empties the queue."""

from __future__ import annotations

import asyncio
import json

import pytest
from parkway.actors.runtime.client import Client
from parkway.brokers.base import Envelope
from parkway.protocol.signing import SENDER_HEADER

from tests.support.cli import parkway
from tests.support.processes import run_variables, status_of, wait_ready
from tests.support.scrape import free_port, sample, scrape

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

BOUND = {"PARKWAY_DEAD_LETTER_MAX_LENGTH": "2"}


async def test_a_full_dead_letter_queue_drops_counted_and_the_cli_shows_and_purges(
    spawn, client: Client, amqp_url: str, run_name: str, tmp_path
) -> None:
    cli_env = run_variables(run_name, tmp_path / "cli", PARKWAY_BROKER_URL=amqp_url, **BOUND)

    def cli(*args: str) -> str:
        result = parkway("dead-letters", *args, **cli_env)
        assert result.returncode == 0, result.stderr
        return result.stdout

    # The test's own client declared the queue first, with the default bounds: make it anew with 2.
    assert "declared anew: at most 2" in await asyncio.to_thread(cli, "purge", "--recreate")
    port = free_port()
    actor = spawn("tq", args=("--metrics-port", str(port)), **BOUND)
    await wait_ready(client, actor)
    for n in range(4):  # unsigned: each is refused at the edge and dead-lettered
        garbage = Envelope(b"\x93junk", "application/msgpack", f"junk-{n}", {SENDER_HEADER: "mallory/0"})
        await client.broker.publish("tq/0", garbage)

    async with asyncio.timeout(30):
        while (await status_of(client, "tq/0")).counts.get("refused:unauthorized", 0) < 4:  # noqa: ASYNC110 - polls another process
            await asyncio.sleep(0.05)
    counts = (await status_of(client, "tq/0")).counts
    assert counts.get("dead_letter_dropped") == 2  # the last two found the queue full
    assert sample(await asyncio.to_thread(scrape, port), "parkway_dead_letters_dropped_total") == 2

    for _ in range(2):  # showing twice shows the same: nothing is taken off
        shown = json.loads(await asyncio.to_thread(cli, "show", "--json", "--limit", "10"))
        assert (shown["held"], shown["max_length"], shown["bounds_applied"]) == (2, 2, True)
        assert [d["correlation_id"] for d in shown["letters"]] == ["junk-0", "junk-1"]
        assert {(d["origin"], d["code"]) for d in shown["letters"]} == {("tq/0", "unauthorized")}
    text = await asyncio.to_thread(cli, "show", "--limit", "1")
    assert text.startswith(f"run {run_name}: 2 dead letters (bounds: at most 2") and "junk-0" in text

    assert f"run {run_name}: purged 2 dead letters" in await asyncio.to_thread(cli, "purge")
    assert json.loads(await asyncio.to_thread(cli, "show", "--json"))["held"] == 0
