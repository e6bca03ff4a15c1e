"""What a live actor's memory holds, asked from outside: the ``MemoryReport`` query, and SIGUSR2.

The answer (``MemoryUsage``) carries the process's RSS (now and peak), the actor's structure sizes
(``structures.py``) and, while tracemalloc traces, the top allocation sites by line. Tracing is off
by default (it slows allocation and holds memory of its own); ``MemoryReport(start=True)`` (``parkway
inspect memory ADDRESS --start``) starts it, ``PARKWAY_TRACEMALLOC=N`` starts it at boot keeping N
frames per allocation (1 is enough for "by line"). The answer says so when it is off.

``kill -USR2 <pid>`` writes the same report of every actor of the process into its log, as the
``memory_report`` event (on the run's log stream too: ``parkway logs``).

``trim_heap`` gives the C heap's free pages back to the system (glibc's ``malloc_trim``). Python hands
allocations over 512 bytes (message bodies, encoded cuts) to malloc; freed, they leave holes in the
heap that the process keeps, and a long run's RSS crept up by about 10 MB per 100,000 rollouts while
the memory Python held stayed flat (issue 22's soak, tracemalloc against ``/proc``). A participant
trims after writing each cut, the controller after each publish: in a worker thread, off the window.
``PARKWAY_MALLOC_TRIM=0`` turns it off; where the C library has no ``malloc_trim`` it does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import resource
import signal
import sys
import tracemalloc
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import msgspec
import structlog
from parkway.actors.runtime import collection
from parkway.actors.runtime.settings import SettingsError
from parkway.actors.runtime.structures import read_sizes
from parkway.protocol.inspection import Allocation, HeapUsage, MemoryReport, MemoryUsage

if TYPE_CHECKING:
    from parkway.actors.runtime.actor import Actor

log = structlog.get_logger("parkway.memory")

TRACEMALLOC_ENV = "PARKWAY_TRACEMALLOC"
MALLOC_TRIM_ENV = "PARKWAY_MALLOC_TRIM"
SIGNAL_TOP = 25  # allocation sites a SIGUSR2 report logs
_IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
_live: list[Actor] = []  # the actors of this process a SIGUSR2 reports on
_handled_on: asyncio.AbstractEventLoop | None = None  # the loop whose SIGUSR2 handler is installed


def tracemalloc_frames(environ: Mapping[str, str] | None = None) -> int:
    """Frames to trace from boot: ``PARKWAY_TRACEMALLOC`` (0 or unset: off)."""
    text = (os.environ if environ is None else environ).get(TRACEMALLOC_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) > 100:
        raise SettingsError(f"{TRACEMALLOC_ENV}={text!r}: want frames per allocation, 0 (off) to 100")
    return int(text)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library, or turned off)."""
    if os.environ.get(MALLOC_TRIM_ENV, "").strip() == "0":
        return None
    try:
        # The symbols this process already has (the C library among them): no library search, which
        # would start ``ldconfig`` as a child process.
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Give the heap's free pages back to the system; True when some were. Blocking (a few ms on a
    fragmented heap of tens of MB): call it in a worker thread (ctypes lets the GIL go meanwhile)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # ctypes reads the layout from this class attribute
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's ``mallinfo2`` (2.33 and later), or None."""
    try:
        info = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    info.argtypes, info.restype = [], _MallInfo2
    return info


def heap_usage() -> HeapUsage:
    """The C heap (in use, free but kept, mapped) and Python's block count, now. Cheap: no walk of
    the heap that a caller would notice (microseconds), so every ``MemoryReport`` carries it."""
    blocks = sys.getallocatedblocks()
    info = _mallinfo2()
    if info is None:
        return HeapUsage(python_blocks=blocks)
    got = info()
    return HeapUsage(
        c_in_use_bytes=got.uordblks + got.hblkhd,
        c_free_bytes=got.fordblks,
        c_arena_bytes=got.arena,
        python_blocks=blocks,
    )


def rss_bytes() -> tuple[int, int]:
    """(resident now, peak) of this process; now is 0 where /proc does not say."""
    now = 0
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as handle:
        now = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # kilobytes on Linux, bytes on macOS
    return now, max(now, peak)  # the two are counted apart: the peak is never below now


def top_allocations(top: int) -> list[Allocation]:
    """The ``top`` lines holding the most traced memory (none while not tracing)."""
    if top <= 0 or not tracemalloc.is_tracing():
        return []
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, pattern) for pattern in _IGNORED]
    )
    stats = snapshot.statistics("lineno")[:top]
    return [
        Allocation(
            file=stat.traceback[0].filename,
            line=stat.traceback[0].lineno,
            size_bytes=stat.size,
            count=stat.count,
        )
        for stat in stats
    ]


def report(actor: Actor, *, top: int, start: bool = False, stop: bool = False) -> MemoryUsage:
    note = ""
    if start and not tracemalloc.is_tracing():
        tracemalloc.start(max(1, tracemalloc_frames()))
        note = "tracing started now: allocations made before it are not seen; ask again later"
    elif stop and tracemalloc.is_tracing():
        tracemalloc.stop()
        note = "tracing stopped"
    tracing = tracemalloc.is_tracing()
    if not tracing and not note:
        note = (
            f"tracemalloc is off: ask with start (--start) or boot with {TRACEMALLOC_ENV}=1 for the top lines"
        )
    traced, traced_peak = tracemalloc.get_traced_memory() if tracing else (0, 0)
    now, peak = rss_bytes()
    return MemoryUsage(
        pid=os.getpid(),
        rss_bytes=now,
        peak_rss_bytes=peak,
        tracing=tracing,
        traced_bytes=traced,
        traced_peak_bytes=traced_peak,
        top=tuple(top_allocations(top)),
        structures=read_sizes(actor),
        heap=heap_usage(),
        note=note,
    )


async def answer(actor: Actor, request: MemoryReport) -> MemoryUsage:
    """The ``MemoryReport`` handler."""
    return report(actor, top=request.top, start=request.start, stop=request.stop)


def log_reports() -> None:
    """SIGUSR2: every live actor's report, into the log."""
    for actor in list(_live):
        with structlog.contextvars.bound_contextvars(**actor.log_context()):
            log.info("memory_report", **msgspec.to_builtins(report(actor, top=SIGNAL_TOP)))


def attach(actor: Actor) -> None:
    """At start: tracing from boot if asked, this actor in the SIGUSR2 report, and its process's
    garbage collection on the schedule of ``collection.py``."""
    collection.attach(actor)
    frames = tracemalloc_frames()
    if frames and not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    global _handled_on
    loop = asyncio.get_running_loop()
    if _handled_on is not loop:
        # Once per loop (an actor left attached by a loop that ended must not leave the next one with
        # no handler). Only the main thread's loop takes signal handlers; elsewhere there is none.
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError, AttributeError):
            loop.add_signal_handler(signal.SIGUSR2, log_reports)
            _handled_on = loop
    _live.append(actor)


def detach(actor: Actor) -> None:
    collection.detach(actor)
    global _handled_on
    with contextlib.suppress(ValueError):
        _live.remove(actor)
    if not _live:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError, AttributeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR2)
        _handled_on = None
