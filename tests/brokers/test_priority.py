"""The priority loop: urgent work ahead of ready ordinary work, in order among itself, never starving
the rest; and which deliveries are urgent, on the in-memory broker and over RabbitMQ."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from parkway.brokers import priority
from parkway.brokers.base import Delivery, Envelope, Lane
from parkway.brokers.memory import MemoryBroker, MemoryHub

T = TypeVar("T")


def on_priority_loop(main: Coroutine[Any, Any, T]) -> T:
    return priority.run(main)


async def backlog_then(urgent: bool, size: int = 50) -> list[str]:
    """``size`` ordinary callbacks made ready, then a task in an urgent (or ordinary) context that
    records its two steps: where they fall among the backlog."""
    order: list[str] = []
    loop = asyncio.get_running_loop()
    for i in range(size):
        loop.call_soon(order.append, f"data{i}")

    async def command() -> None:
        order.append("command started")
        await asyncio.sleep(0)
        order.append("command answered")

    await loop.create_task(command(), context=priority.context(urgent))
    return order


def test_an_urgent_task_runs_ahead_of_the_ready_backlog() -> None:
    order = on_priority_loop(backlog_then(urgent=True))
    assert order[:2] == ["command started", "command answered"]
    assert order[2:] == [f"data{i}" for i in range(50)]


def test_an_ordinary_task_waits_for_the_backlog_as_before() -> None:
    order = on_priority_loop(backlog_then(urgent=False))
    assert order.index("command started") == 50


def test_urgent_work_on_a_plain_loop_is_plain_arrival_order() -> None:
    order = asyncio.run(backlog_then(urgent=True))
    assert order.index("command started") == 50


def test_urgent_callbacks_keep_their_order_among_themselves() -> None:
    async def main() -> list[int]:
        order: list[int] = []
        loop = asyncio.get_running_loop()
        loop.call_soon(order.append, -1)  # ordinary: after all of them
        for i in range(20):
            loop.call_soon(order.append, i, context=priority.context(True))
        await asyncio.sleep(0.01)
        return order

    assert on_priority_loop(main()) == [*range(20), -1]


def test_an_urgent_task_that_keeps_yielding_does_not_starve_ordinary_work() -> None:
    async def main() -> int:
        spins = 0
        stop = asyncio.Event()

        async def spinner() -> None:
            nonlocal spins
            while not stop.is_set():
                spins += 1
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(spinner(), context=priority.context(True))
        await asyncio.sleep(0)  # ordinary: must come back although the spinner never waits
        await asyncio.sleep(0.01)  # and a timer fires too
        stop.set()
        await task
        return spins

    assert on_priority_loop(main()) > 1  # the spinner ran, and main got its turns between


def test_cancelled_urgent_callbacks_do_not_run_and_threads_still_reach_the_loop() -> None:
    async def main() -> list[str]:
        ran: list[str] = []
        loop = asyncio.get_running_loop()
        loop.call_soon(ran.append, "cancelled", context=priority.context(True)).cancel()
        done = asyncio.Event()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(done.set)).start()
        await asyncio.wait_for(done.wait(), 5)
        ran.append("from a thread")
        return ran

    assert on_priority_loop(main()) == ["from a thread"]


def test_an_exception_in_an_urgent_callback_goes_to_the_handler_and_the_loop_goes_on() -> None:
    async def main() -> list[str]:
        seen: list[str] = []
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: seen.append(str(ctx.get("exception"))))

        def boom() -> None:
            raise ValueError("boom")

        loop.call_soon(boom, context=priority.context(True))
        loop.call_soon(seen.append, "after", context=priority.context(True))
        await asyncio.sleep(0.01)
        return seen

    assert on_priority_loop(main()) == ["boom", "after"]


def test_a_control_delivery_is_handled_urgent_and_a_data_delivery_is_not() -> None:
    async def main() -> dict[Lane, bool]:
        seen: dict[Lane, bool] = {}
        both = asyncio.Event()
        async with MemoryBroker(MemoryHub(), "priority-test") as broker:
            await broker.declare("agent/0")

            async def handler(delivery: Delivery) -> None:
                seen[delivery.lane] = priority.URGENT.get()
                await delivery.ack()
                if len(seen) == 2:
                    both.set()

            consumers = await broker.consume_lanes(
                "agent/0", handler, prefetch={Lane.DATA: 4, Lane.CONTROL: 4}
            )
            with priority.Urgency():  # whatever the publisher's context, the lane decides
                await broker.publish(
                    "agent/0",
                    Envelope(body=b"x", content_type="application/msgpack", correlation_id="run-1"),
                    lane=Lane.DATA,
                )
            await broker.publish(
                "agent/0",
                Envelope(body=b"y", content_type="application/msgpack", correlation_id="ck-1"),
                lane=Lane.CONTROL,
            )
            await asyncio.wait_for(both.wait(), 5)
            await consumers.cancel()
        return seen

    assert on_priority_loop(main()) == {Lane.DATA: False, Lane.CONTROL: True}


def test_urgency_ends_where_it_is_ended() -> None:
    async def main() -> list[bool]:
        marks = [priority.URGENT.get()]
        with priority.Urgency() as urgency:
            marks.append(priority.URGENT.get())
            urgency.end()
            marks.append(priority.URGENT.get())
        marks.append(priority.URGENT.get())
        return marks

    assert on_priority_loop(main()) == [False, True, False, False]


@pytest.mark.rabbitmq
def test_over_rabbitmq_the_lane_decides_and_consumers_still_close(
    amqp_url: str, run_name: str, rabbit_cleanup: Callable[[str, list[str]], None]
) -> None:
    """The same over a real connection, whose reader and consumer channels run urgent; cancelling
    the consumers (their channels' close, which once waited out a 60 s heartbeat timeout when it ran
    behind its channel's reader) comes back."""
    from parkway.brokers.rabbitmq import RabbitBroker

    rabbit_cleanup(run_name, ["agent/0"])

    async def main() -> dict[Lane, bool]:
        seen: dict[Lane, bool] = {}
        both = asyncio.Event()
        async with RabbitBroker(amqp_url, run_name) as broker:
            await broker.declare("agent/0")

            async def handler(delivery: Delivery) -> None:
                seen[delivery.lane] = priority.URGENT.get()
                await delivery.ack()
                if len(seen) == 2:
                    both.set()

            consumers = await broker.consume_lanes(
                "agent/0", handler, prefetch={Lane.DATA: 4, Lane.CONTROL: 4}
            )
            await broker.publish("agent/0", Envelope(b"x", "application/msgpack", "run-1"), lane=Lane.DATA)
            await broker.publish("agent/0", Envelope(b"y", "application/msgpack", "ck-1"), lane=Lane.CONTROL)
            await asyncio.wait_for(both.wait(), 30)
            await asyncio.wait_for(consumers.cancel(), 30)
        return seen

    assert on_priority_loop(main()) == {Lane.DATA: False, Lane.CONTROL: True}
