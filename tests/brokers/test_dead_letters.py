"""The bounded dead-letter queue and the reply-address rule, on both brokers (issue 21: the dead-letter
queue had no bound, 2,479 messages after a fuzzing run; a reply_to naming another actor's queue made
the actor post its reply there)."""

from __future__ import annotations

import asyncio
import time

import aio_pika
import pytest
from parkway.brokers.base import REQUEST_ID_HEADER, DeadLetterBounds, Delivery, Envelope

from tests.support.waiting import until


def env(body: bytes, correlation_id: str) -> Envelope:
    return Envelope(body=body, content_type="text/plain", correlation_id=correlation_id)


async def dead_letter_each(broker, address: str, bodies: list[bytes]) -> list[bool]:
    """Publish ``bodies`` to ``address`` and dead-letter each delivery; what ``dead_letter`` said."""
    await broker.declare(address)
    for n, body in enumerate(bodies):
        await broker.publish(address, env(body, f"bad-{n}"))
    kept: list[bool] = []

    async def reject(d: Delivery) -> None:
        kept.append(await broker.dead_letter(d, code="invalid_message", detail="refused in a test"))

    await broker.consume(address, reject, prefetch=1)  # one at a time: the order is the queue's
    await until(lambda: len(kept) == len(bodies), timeout=10)
    return kept


async def test_a_full_dead_letter_queue_refuses_new_letters_and_counts_them(make_broker) -> None:
    async with make_broker(dead_letter_bounds=DeadLetterBounds(max_length=3)) as broker:
        kept = await dead_letter_each(broker, "strict/0", [f"m{n}".encode() for n in range(5)])
        assert kept == [True, True, True, False, False]
        assert broker.dead_letters_dropped == 2 and broker.dead_letter_bounds_applied

        shown, held = await broker.peek_dead_letters(limit=2)
        assert held == 3 and [d.envelope.body for d in shown] == [b"m0", b"m1"]
        shown, held = await broker.peek_dead_letters(limit=10)  # showing takes nothing off the queue
        assert held == 3 and [d.envelope.body for d in shown] == [b"m0", b"m1", b"m2"]
        assert {(d.origin, d.code) for d in shown} == {("strict/0", "invalid_message")}

        assert await broker.purge_dead_letters() == 3
        assert await broker.peek_dead_letters() == ([], 0)
        assert await dead_letter_each(broker, "strict/1", [b"again"]) == [True]  # room again


async def test_dead_letters_older_than_the_age_bound_are_gone(make_broker) -> None:
    async with make_broker(dead_letter_bounds=DeadLetterBounds(max_age_s=1.0)) as broker:
        assert await dead_letter_each(broker, "strict/0", [b"old"]) == [True]
        assert (await broker.peek_dead_letters())[1] == 1

        async def expired() -> bool:
            return (await broker.peek_dead_letters())[1] == 0

        give_up = time.monotonic() + 20
        while not await expired():  # the bound is an age: only time passing makes it lapse
            assert time.monotonic() < give_up, "a dead letter outlived its age bound by 19 s"
            await asyncio.sleep(0.2)


async def test_replies_go_only_to_reply_addresses(make_broker, run_name) -> None:
    async with make_broker() as server, make_broker() as client:
        await server.declare("echo/0")
        seen: list[str] = []

        async def echo(d: Delivery) -> None:
            assert d.envelope.reply_to
            seen.append(d.envelope.reply_to)
            headers = {REQUEST_ID_HEADER: d.envelope.headers[REQUEST_ID_HEADER]}
            await server.reply(d.envelope.reply_to, Envelope(b"re", "text/plain", "c", headers))
            await d.ack()

        await server.consume("echo/0", echo)
        reply = await client.request("echo/0", env(b"hi", "c"), deadline=time.time() + 10)
        assert reply.body == b"re"
        assert server.is_reply_address(seen[0])  # what the broker made for the requester
        for not_a_reply_address in (f"pk.{run_name}.q.echo/0", "echo/0", "pk.other.dead", ""):
            assert not server.is_reply_address(not_a_reply_address)


@pytest.mark.rabbitmq
async def test_a_dead_letter_queue_declared_with_other_bounds_is_kept_until_recreated(
    amqp_url: str, run_name: str, rabbit_cleanup
) -> None:
    from parkway.brokers.rabbitmq import RabbitBroker

    rabbit_cleanup(run_name, ["strict/0", "strict/1"])
    connection = await aio_pika.connect(amqp_url)  # the queue as an older parkway declared it: no bounds
    async with connection:
        await (await connection.channel()).declare_queue(f"pk.{run_name}.dead", durable=True)

    async with RabbitBroker(amqp_url, run_name, dead_letter_bounds=DeadLetterBounds(max_length=1)) as broker:
        assert (
            not broker.dead_letter_bounds_applied
        )  # PRECONDITION_FAILED, handled: the queue is used as it is
        assert await dead_letter_each(broker, "strict/0", [b"a", b"b"]) == [True, True]
        assert await broker.purge_dead_letters(recreate=True) == 2
        assert broker.dead_letter_bounds_applied
        assert await dead_letter_each(broker, "strict/1", [b"c", b"d"]) == [True, False]

    async with RabbitBroker(amqp_url, run_name, dead_letter_bounds=DeadLetterBounds(max_length=1)) as again:
        assert again.dead_letter_bounds_applied  # declared with these bounds now
