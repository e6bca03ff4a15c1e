"""Looking inside a live actor's memory (``runtime/memory.py``): the ``MemoryReport`` query on the
in-memory broker, tracing off by default and started on request, who may ask, bad input, SIGUSR2."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.runtime import memory
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.memory import TRACEMALLOC_ENV, tracemalloc_frames
from parkway.actors.runtime.settings import SettingsError
from parkway.actors.tools.commands.inspect import render
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ErrorCode
from parkway.protocol.messages import Error, MemoryReport, MemoryUsage

from tests.support.signed import SECRET, raw_request, signed_raw

RUN = "unit"


@pytest.fixture(autouse=True)
def no_tracing() -> Iterator[None]:
    assert not tracemalloc.is_tracing()
    yield
    tracemalloc.stop()


@pytest.fixture
async def broker():
    async with MemoryBroker(MemoryHub(), RUN) as b:
        yield b


@pytest.fixture
async def tq(broker: MemoryBroker, tmp_path: Path):
    actor = TransferQueue(broker, secret=SECRET, replica=0, snapshot_root=tmp_path / "snapshots")
    await actor.start()
    yield actor
    await actor.stop()


def ask(**fields: object) -> MemoryReport:
    return MemoryReport(checkpoint_id=f"mem-{time.monotonic_ns()}", deadline=time.time() + 10, **fields)


async def test_tracing_is_off_until_asked_and_the_answer_says_so(
    tq: TransferQueue, broker: MemoryBroker
) -> None:
    operator = Client(broker, secret=SECRET, sender="cli/1")  # signs with the controller's key
    usage = await operator.request("tq/0", ask())
    assert isinstance(usage, MemoryUsage)
    assert usage.pid == os.getpid() and usage.rss_bytes > 0 and usage.peak_rss_bytes >= usage.rss_bytes
    assert not usage.tracing and usage.top == () and "tracemalloc is off" in usage.note
    assert usage.structures["reply_cache"] == len(tq.replies)
    started = await operator.request("tq/0", ask(start=True))
    assert isinstance(started, MemoryUsage) and started.tracing and "started now" in started.note
    held = [bytearray(1000) for _ in range(2000)]  # 2 MB held at one line of this file
    sizes_only = await operator.request("tq/0", ask(top=0))  # no walk of the traces
    assert isinstance(sizes_only, MemoryUsage) and sizes_only.tracing and sizes_only.top == ()
    usage = await operator.request("tq/0", ask(top=5))
    assert isinstance(usage, MemoryUsage) and usage.tracing and len(usage.top) == 5
    here = [a for a in usage.top if a.file == __file__]
    assert here and here[0].size_bytes >= 2_000_000 and here[0].count >= 2000
    assert usage.top[0].size_bytes >= usage.top[-1].size_bytes  # largest first
    assert "top 5 allocation sites" in render("tq/0", usage)
    del held
    stopped = await operator.request("tq/0", ask(stop=True))
    assert isinstance(stopped, MemoryUsage) and not stopped.tracing and not tracemalloc.is_tracing()
    assert len(tq.replies) == 0  # a query: answered fresh, never cached


async def test_only_the_controller_key_may_ask_and_bad_input_is_a_typed_error(
    tq: TransferQueue, broker: MemoryBroker
) -> None:
    agent = Client(broker, secret=SECRET, sender="agent/0")
    refused = await agent.request("tq/0", ask())
    assert isinstance(refused, Error) and refused.code is ErrorCode.UNAUTHORIZED
    operator = Client(broker, secret=SECRET, sender="cli/1")
    for body in (
        {"top": -1},
        {"top": 10_000},
        {"start": True, "stop": True},
        {"top": "ten"},
    ):
        raw = {
            "type": "MemoryReport",
            "v": 1,
            "checkpoint_id": "mem-bad",
            "deadline": time.time() + 10,
            **body,
        }
        envelope = signed_raw(
            RUN, json.dumps(raw).encode(), correlation_id="mem-bad", to="tq/0", sender="cli/1"
        )
        reply = await raw_request(operator, "tq/0", envelope)
        assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_MESSAGE, body
    assert isinstance(await operator.request("tq/0", ask()), MemoryUsage)  # and it still answers


async def test_sigusr2_writes_the_report_into_the_log(tq: TransferQueue) -> None:
    with structlog.testing.capture_logs() as logs:
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if any(e["event"] == "memory_report" for e in logs):
                break
    [entry] = [e for e in logs if e["event"] == "memory_report"]
    assert entry["pid"] == os.getpid() and entry["rss_bytes"] > 0
    assert entry["structures"]["reply_cache"] == len(tq.replies)
    assert entry["tracing"] is False and "tracemalloc is off" in entry["note"]


async def test_the_answer_says_where_the_memory_sits_by_allocator(
    tq: TransferQueue, broker: MemoryBroker
) -> None:
    operator = Client(broker, secret=SECRET, sender="cli/1")
    usage = await operator.request("tq/0", ask())
    assert isinstance(usage, MemoryUsage) and usage.heap is not None
    assert usage.heap.python_blocks > 0
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":  # mallinfo2 from glibc 2.33
        before = memory.heap_usage()
        held = [bytes(4000) for _ in range(2000)]  # 8 MB from malloc (over pymalloc's 512 bytes)
        during = memory.heap_usage()
        assert during.c_in_use_bytes - before.c_in_use_bytes >= 7_000_000
        assert usage.heap.c_arena_bytes > 0 and len(held) == 2000
    assert "heap: C in use" in render("tq/0", usage)


def test_the_boot_setting() -> None:
    assert tracemalloc_frames({}) == 0
    assert tracemalloc_frames({TRACEMALLOC_ENV: "5"}) == 5
    with pytest.raises(SettingsError, match=TRACEMALLOC_ENV):
        tracemalloc_frames({TRACEMALLOC_ENV: "yes"})


def test_the_heap_is_trimmed_where_the_c_library_can_and_not_when_turned_off(monkeypatch) -> None:
    # glibc gives free pages back (True when some were, False when none were); elsewhere, or with
    # PARKWAY_MALLOC_TRIM=0, nothing is called and the answer is False.
    memory._malloc_trim.cache_clear()
    try:
        calls: list[int] = []
        monkeypatch.setattr(memory, "_malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
        assert memory.trim_heap() is True and calls == [0]
        monkeypatch.undo()
        monkeypatch.setenv(memory.MALLOC_TRIM_ENV, "0")
        memory._malloc_trim.cache_clear()
        assert memory._malloc_trim() is None and memory.trim_heap() is False
        monkeypatch.delenv(memory.MALLOC_TRIM_ENV)
        memory._malloc_trim.cache_clear()
        if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
            assert memory._malloc_trim() is not None
            # A fragmented heap: every tenth chunk kept, the rest freed, so the heap cannot shrink
            # from its top; trimming gives the free pages inside it back.
            chunks = [bytes(600 + (n * 37) % 3400) for n in range(50_000)]
            kept = chunks[::10]
            del chunks
            before = memory.rss_bytes()[0]
            assert memory.trim_heap() is True
            assert before - memory.rss_bytes()[0] > 20 << 20
            assert len(kept) == 5000
    finally:
        memory._malloc_trim.cache_clear()
