"""Looking inside a live actor's memory from outside: ``MemoryReport`` asks, ``MemoryUsage`` answers.

It is a query (answered fresh, never cached), sent by an operator with the controller's key
(``authorization.py``). Tracing allocations (tracemalloc) costs time and memory, so it is off unless
started: by ``start`` here, or at boot by ``PARKWAY_TRACEMALLOC``; the answer says when it is off.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from parkway.protocol import ranges
from parkway.protocol.message_base import ControlCommand, Message

MAX_TOP = 500  # allocation sites in one answer: a bounded reply


class MemoryReport(ControlCommand, frozen=True, kw_only=True):
    """RSS, the structure sizes and the ``top`` allocation sites by line; ``start`` / ``stop`` tracing."""

    top: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP)] = 10  # 0: sizes only, no walk of the traces
    start: bool = False
    stop: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start and self.stop:
            raise ValueError("start and stop together: ask for one")


class Allocation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Memory allocated at one line and still held."""

    file: str
    line: ranges.Count
    size_bytes: ranges.Count
    count: ranges.Count


class HeapUsage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the memory sits, by allocator: RSS can grow while Python's objects stay flat (freed C heap
    the process keeps, fragmentation), and these tell the two apart. From glibc's ``mallinfo2`` (zero
    where the C library has none) and ``sys.getallocatedblocks``."""

    c_in_use_bytes: ranges.Count = 0  # malloc'd and not freed (small chunks and mmapped ones)
    c_free_bytes: ranges.Count = 0  # freed but still held by the process (holes in the heap)
    c_arena_bytes: ranges.Count = 0  # the heap itself, all arenas (in use + free)
    python_blocks: ranges.Count = 0  # blocks Python's own allocator has handed out (objects and more)


class MemoryUsage(Message, frozen=True, kw_only=True):
    pid: ranges.Count
    rss_bytes: ranges.Count  # resident now (0 where the platform does not say)
    peak_rss_bytes: ranges.Count = 0
    tracing: bool = False
    traced_bytes: ranges.Count = 0  # held by traced allocations now / at their peak
    traced_peak_bytes: ranges.Count = 0
    top: tuple[Allocation, ...] = ()
    structures: dict[str, ranges.Count] = {}
    heap: HeapUsage | None = None  # None from an actor too old to say
    note: str = ""  # why there is no top (tracing off, just started)
