"""One contract, two brokers: every test here runs on the in-memory broker and on the real RabbitMQ.

The tests at the end are about lanes: each address has a data and a control queue, each keeping the
whole contract on its own."""

from __future__ import annotations

import asyncio
import time

import pytest
from parkway.brokers.base import (
    REQUEST_ID_HEADER,
    Broker,
    Delivery,
    Envelope,
    Lane,
    RequestTimeout,
    Unroutable,
)

from tests.support.waiting import until


def env(body: bytes, correlation_id: str = "c-1") -> Envelope:
    return Envelope(body=body, content_type="text/plain", correlation_id=correlation_id)


async def collect(n: int, received: list, timeout: float = 5.0) -> None:
    await until(lambda: len(received) >= n, timeout=timeout)


async def test_publish_then_consume_in_order_with_manual_ack(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("work/0")
        for i in range(20):
            await broker.publish("work/0", env(f"m{i}".encode()))
        received: list[Delivery] = []

        async def handler(d: Delivery) -> None:
            received.append(d)
            await d.ack()

        await broker.consume("work/0", handler, prefetch=1)
        await collect(20, received)
        assert [d.envelope.body for d in received] == [f"m{i}".encode() for i in range(20)]
        assert not any(d.redelivered for d in received)
        assert received[0].envelope.correlation_id == "c-1"


async def test_unroutable_publish_raises(make_broker) -> None:
    async with make_broker() as broker:
        with pytest.raises(Unroutable):
            await broker.publish("nobody/0", env(b"lost?"))


async def test_request_reply_matches_request_ids(make_broker) -> None:
    async with make_broker() as server, make_broker() as client:
        await server.declare("echo/0")

        async def echo(d: Delivery) -> None:
            # Answer out of order: the second request first. Replies must still find their requests.
            if d.envelope.body == b"slow":
                await asyncio.sleep(0.05)
            reply = Envelope(
                b"re:" + d.envelope.body,
                "text/plain",
                d.envelope.correlation_id,
                {REQUEST_ID_HEADER: d.envelope.headers[REQUEST_ID_HEADER]},
            )
            assert d.envelope.reply_to
            await server.reply(d.envelope.reply_to, reply)
            await d.ack()

        await server.consume("echo/0", echo, prefetch=4)
        deadline = time.time() + 5
        slow, fast = await asyncio.gather(
            client.request("echo/0", env(b"slow", "same-id"), deadline=deadline),
            client.request("echo/0", env(b"fast", "same-id"), deadline=deadline),
        )
        assert (slow.body, fast.body) == (b"re:slow", b"re:fast")


async def test_request_times_out_at_its_deadline(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("silent/0")
        with pytest.raises(RequestTimeout):
            await broker.request("silent/0", env(b"anyone?"), deadline=time.time() + 0.3)


async def test_nack_requeue_redelivers_marked(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("retry/0")
        await broker.publish("retry/0", env(b"once"))
        seen: list[Delivery] = []

        async def handler(d: Delivery) -> None:
            seen.append(d)
            if len(seen) == 1:
                await d.nack(requeue=True)
            else:
                await d.ack()

        await broker.consume("retry/0", handler, prefetch=1)
        await collect(2, seen)
        assert [d.envelope.body for d in seen] == [b"once", b"once"]
        assert [d.redelivered for d in seen] == [False, True]


async def test_unsettled_deliveries_of_a_dead_consumer_are_redelivered(make_broker) -> None:
    async with make_broker() as first, make_broker() as second:
        await first.declare("jobs/0")
        for i in range(3):
            await first.publish("jobs/0", env(f"j{i}".encode()))
        taken: list[Delivery] = []

        async def hold(d: Delivery) -> None:
            taken.append(d)  # never settles: the consumer "dies" holding them

        await first.consume("jobs/0", hold, prefetch=3)
        await collect(3, taken)
        await first.close()  # like the process dying: its connection goes away

        again: list[Delivery] = []

        async def finish(d: Delivery) -> None:
            again.append(d)
            await d.ack()

        await second.consume("jobs/0", finish, prefetch=10)
        await collect(3, again)
        assert sorted(d.envelope.body for d in again) == [b"j0", b"j1", b"j2"]
        assert all(d.redelivered for d in again)


async def test_pause_holds_deliveries_and_resume_hands_them_over_in_order(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("gate/0")
        handled: list[bytes] = []

        async def handler(d: Delivery) -> None:
            handled.append(d.envelope.body)
            await d.ack()

        consumer = await broker.consume("gate/0", handler, prefetch=8)
        await broker.publish("gate/0", env(b"before"))
        await collect(1, handled)
        consumer.pause()
        for i in range(3):
            await broker.publish("gate/0", env(f"during{i}".encode()))
        await until(lambda: consumer.held == 3)  # they did arrive, and were held rather than handled
        assert handled == [b"before"]
        consumer.resume()
        await collect(4, handled)
        assert handled == [b"before", b"during0", b"during1", b"during2"]


async def test_dead_letter_keeps_the_message_and_the_reason(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("strict/0")
        await broker.publish("strict/0", env(b"\x00garbage", "bad-1"))
        done = asyncio.Event()

        async def reject(d: Delivery) -> None:
            await broker.dead_letter(d, code="invalid_message", detail="not a parkway message")
            done.set()

        await broker.consume("strict/0", reject)
        await asyncio.wait_for(done.wait(), 5)
        letters = await broker.read_dead_letters()
        assert len(letters) == 1
        assert letters[0].envelope.body == b"\x00garbage"
        assert letters[0].envelope.correlation_id == "bad-1"
        assert (letters[0].origin, letters[0].code) == ("strict/0", "invalid_message")
        assert letters[0].detail == "not a parkway message"
        assert await broker.read_dead_letters() == []


async def test_two_runs_on_one_broker_never_see_each_other(make_broker, run_name) -> None:
    async with make_broker(run_name + "a") as run_a, make_broker(run_name + "b") as run_b:
        await run_a.declare("agent/0")
        await run_b.declare("agent/0")
        got_a: list[Delivery] = []
        got_b: list[Delivery] = []

        def into(bucket: list[Delivery]):
            async def handler(d: Delivery) -> None:
                bucket.append(d)
                await d.ack()

            return handler

        await run_a.consume("agent/0", into(got_a))
        await run_b.consume("agent/0", into(got_b))
        await run_a.publish("agent/0", env(b"for-a"))
        await run_b.publish("agent/0", env(b"for-b"))
        await collect(1, got_a)
        await collect(1, got_b)
        await run_a.publish_log(b'{"event":"a"}', checkpoint_id="x")
        await run_b.publish_log(b'{"event":"b"}', checkpoint_id="x")
        lines = run_a.follow_logs(from_start=True)
        first = await asyncio.wait_for(anext(lines), 5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(lines), 0.5)
        await lines.aclose()
        assert [d.envelope.body for d in got_a] == [b"for-a"]
        assert [d.envelope.body for d in got_b] == [b"for-b"]
        assert first == b'{"event":"a"}'


async def test_logs_are_readable_from_the_start_and_live(make_broker) -> None:
    async with make_broker() as writer, make_broker() as reader:
        for i in range(3):
            await writer.publish_log(f'{{"n":{i}}}'.encode(), checkpoint_id="ck-1")
        lines = reader.follow_logs(from_start=True)
        got = [await asyncio.wait_for(anext(lines), 5) for _ in range(3)]
        await writer.publish_log(b'{"n":3}', checkpoint_id="ck-2")
        got.append(await asyncio.wait_for(anext(lines), 5))
        await lines.aclose()
        assert got == [b'{"n":0}', b'{"n":1}', b'{"n":2}', b'{"n":3}']


async def test_headers_travel_as_they_were_published(make_broker) -> None:
    # Trace context rides in headers (docs/tracing.md): both brokers hand them over unchanged.
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "x-any": "v"}
    async with make_broker() as broker:
        await broker.declare("work/0")
        await broker.publish("work/0", Envelope(b"m", "text/plain", "c-h", headers))
        received: list[Delivery] = []

        async def handler(d: Delivery) -> None:
            received.append(d)
            await d.ack()

        await broker.consume("work/0", handler)
        await collect(1, received)
        assert {k: received[0].envelope.headers.get(k) for k in headers} == headers


def taking(bucket: list[Delivery]):
    async def handler(d: Delivery) -> None:
        bucket.append(d)
        await d.ack()

    return handler


def bodies(deliveries: list[Delivery]) -> list[bytes]:
    return [d.envelope.body for d in deliveries]


async def test_a_lane_is_consumed_only_by_its_own_consumer(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("work/0")  # both lanes
        data: list[Delivery] = []
        control: list[Delivery] = []
        await broker.consume("work/0", taking(data))  # the data lane, as before lanes
        await broker.consume("work/0", taking(control), lane=Lane.CONTROL)
        for i in range(3):
            await broker.publish("work/0", env(f"d{i}".encode()))
            await broker.publish("work/0", env(f"c{i}".encode()), lane=Lane.CONTROL)
        await collect(3, data)
        await collect(3, control)
        await asyncio.sleep(0.2)  # nothing more comes on either
        assert bodies(data) == [b"d0", b"d1", b"d2"]
        assert bodies(control) == [b"c0", b"c1", b"c2"]
        assert {d.lane for d in data} == {Lane.DATA} and {d.lane for d in control} == {Lane.CONTROL}
        assert {d.address for d in data + control} == {"work/0"}


async def test_each_lane_is_fifo_on_its_own(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("work/0")
        for i in range(20):  # interleaved, queued before anyone consumes
            await broker.publish("work/0", env(f"m{i}".encode()), lane=Lane.CONTROL if i % 2 else Lane.DATA)
        data: list[Delivery] = []
        control: list[Delivery] = []
        await broker.consume("work/0", taking(control), prefetch=1, lane=Lane.CONTROL)
        await broker.consume("work/0", taking(data), prefetch=1, lane=Lane.DATA)
        await collect(10, data)
        await collect(10, control)
        assert bodies(data) == [f"m{i}".encode() for i in range(0, 20, 2)]
        assert bodies(control) == [f"m{i}".encode() for i in range(1, 20, 2)]


async def test_a_command_is_not_held_behind_a_paused_or_full_data_lane(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("gate/0")
        data: list[Delivery] = []
        control: list[Delivery] = []
        stuck = asyncio.Event()

        async def hold_the_first(d: Delivery) -> None:
            data.append(d)
            if len(data) == 1:
                await stuck.wait()  # the data lane's only prefetch slot stays taken
            await d.ack()

        data_consumer = await broker.consume("gate/0", hold_the_first, prefetch=1)
        control_consumer = await broker.consume("gate/0", taking(control), lane=Lane.CONTROL)
        for i in range(3):
            await broker.publish("gate/0", env(f"d{i}".encode()))
        await collect(1, data)
        await broker.publish("gate/0", env(b"c0"), lane=Lane.CONTROL)
        await collect(1, control)  # past the two data messages still queued
        data_consumer.pause()
        stuck.set()
        await broker.publish("gate/0", env(b"c1"), lane=Lane.CONTROL)
        await collect(2, control)  # the data lane is paused, the control lane is not
        await until(lambda: data_consumer.held == 1)  # d1 came (its prefetch is one) and is held
        assert bodies(data) == [b"d0"]
        control_consumer.pause()
        data_consumer.resume()
        await collect(3, data)
        assert bodies(data) == [b"d0", b"d1", b"d2"]
        await broker.publish("gate/0", env(b"c2"), lane=Lane.CONTROL)
        await until(lambda: control_consumer.held == 1)
        control_consumer.resume()
        await collect(3, control)
        assert bodies(control) == [b"c0", b"c1", b"c2"]


async def test_a_request_on_the_control_lane_gets_its_reply(make_broker) -> None:
    async with make_broker() as server, make_broker() as client:
        await server.declare("echo/0")
        on_data: list[Delivery] = []

        async def echo(d: Delivery) -> None:
            reply = Envelope(
                b"re:" + d.envelope.body,
                "text/plain",
                d.envelope.correlation_id,
                {REQUEST_ID_HEADER: d.envelope.headers[REQUEST_ID_HEADER]},
            )
            assert d.envelope.reply_to and d.lane is Lane.CONTROL
            await server.reply(d.envelope.reply_to, reply)
            await d.ack()

        await server.consume("echo/0", taking(on_data))
        await server.consume("echo/0", echo, lane=Lane.CONTROL)
        reply = await client.request("echo/0", env(b"ping"), deadline=time.time() + 5, lane=Lane.CONTROL)
        assert reply.body == b"re:ping"
        assert on_data == []


@pytest.mark.parametrize("lane", list(Lane))
async def test_an_undeclared_address_is_unroutable_on_either_lane(make_broker, lane: Lane) -> None:
    async with make_broker() as broker:
        with pytest.raises(Unroutable):
            await broker.publish("nobody/0", env(b"lost?"), lane=lane)

    async def ignore(d: Delivery) -> None:
        await d.ack()

    async with make_broker() as broker:  # a fresh connection: a refused consume may close a channel
        with pytest.raises(Unroutable):
            await broker.consume("nobody/0", ignore, lane=lane)


async def test_unsettled_deliveries_of_both_lanes_are_redelivered_on_their_lanes(make_broker) -> None:
    async with make_broker() as first, make_broker() as second:
        await first.declare("jobs/0")
        for lane in Lane:
            for i in range(2):
                await first.publish("jobs/0", env(f"{lane}{i}".encode()), lane=lane)
        taken: list[Delivery] = []

        async def hold(d: Delivery) -> None:
            taken.append(d)  # never settles: the consumer "dies" holding them

        await first.consume_lanes("jobs/0", hold, prefetch={Lane.DATA: 2, Lane.CONTROL: 2})
        await collect(4, taken)
        await first.close()

        again: dict[Lane, list[Delivery]] = {lane: [] for lane in Lane}
        for lane in Lane:
            await second.consume("jobs/0", taking(again[lane]), lane=lane)
        await collect(2, again[Lane.DATA])
        await collect(2, again[Lane.CONTROL])
        assert bodies(again[Lane.DATA]) == [b"data0", b"data1"]
        assert bodies(again[Lane.CONTROL]) == [b"control0", b"control1"]
        assert all(d.redelivered for lane in Lane for d in again[lane])


async def test_a_dead_letter_from_the_control_lane_lands_in_the_runs_queue(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("strict/0")
        await broker.publish("strict/0", env(b"\x00garbage", "bad-c"), lane=Lane.CONTROL)
        done = asyncio.Event()

        async def reject(d: Delivery) -> None:
            await broker.dead_letter(d, code="unauthorized", detail="not signed")
            done.set()

        await broker.consume("strict/0", reject, lane=Lane.CONTROL)
        await asyncio.wait_for(done.wait(), 5)
        letters = await broker.read_dead_letters()
        assert [(x.envelope.body, x.envelope.correlation_id) for x in letters] == [(b"\x00garbage", "bad-c")]
        assert (letters[0].origin, letters[0].code, letters[0].detail) == (
            "strict/0",
            "unauthorized",
            "not signed",
        )


async def test_lane_consumers_pause_drain_and_cancel_together(make_broker) -> None:
    async with make_broker() as broker:
        await broker.declare("both/0")
        handled: list[Delivery] = []
        release = asyncio.Event()

        async def slow(d: Delivery) -> None:
            await release.wait()
            handled.append(d)
            await d.ack()

        group = await broker.consume_lanes("both/0", slow, prefetch={Lane.DATA: 4, Lane.CONTROL: 4})
        await broker.publish("both/0", env(b"d0"))
        await broker.publish("both/0", env(b"c0"), lane=Lane.CONTROL)
        await until(lambda: group.in_flight == 2)  # one running on each lane
        group.pause()
        await broker.publish("both/0", env(b"d1"))
        await broker.publish("both/0", env(b"c1"), lane=Lane.CONTROL)
        await until(lambda: group.held == 2)
        release.set()
        await group.drain()
        assert sorted(bodies(handled)) == [b"c0", b"d0"] and group.in_flight == 0
        await group.cancel()  # the held ones go back to their queues

        again: list[Delivery] = []
        other: Broker = make_broker()
        async with other:
            await other.consume_lanes("both/0", taking(again), prefetch={Lane.DATA: 4, Lane.CONTROL: 4})
            await collect(2, again)
        assert sorted(bodies(again)) == [b"c1", b"d1"]
        assert {d.lane for d in again} == {Lane.DATA, Lane.CONTROL}
