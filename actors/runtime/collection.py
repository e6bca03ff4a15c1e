"""Python's cycle collector kept out of the snapshot window.

CPython collects cycles when allocations cross its thresholds, wherever the process happens to be. A
collection of the older generations walks every object the collector tracks: at 1024 rollouts in
flight on a busy 2-core machine one took 40 to 320 ms of wall time in the agents, TQ and the
controller (``gc.callbacks``), and one that ran just as a Prepare arrived, or while the controller
waited for the Prepared replies, held the snapshot window that long: the tail of its p95.

While an actor of this process runs (``attach``, from ``memory.attach`` at ``Actor.start``), the
process collects on a schedule instead:

- what is alive once the first actor started (modules, functions, classes: some 50,000 of the
  objects a collection walked) is frozen (``gc.freeze``): no collection walks it again;
- only the youngest generation is collected automatically (a few hundred objects: well under a
  millisecond); what survives it waits for the next full collection;
- a full collection runs every ``PARKWAY_GC_EVERY_S`` seconds (10 by default), never while one of the
  process's actors is inside a checkpoint (a participant between its Prepare and the checkpoint's
  end, the controller while its admission gate is closed), and right after a checkpoint ends when
  one is due, which is when the next one is furthest away; a checkpoint held open six intervals no
  longer defers it.

Garbage without cycles is freed at once by reference counting, as always; only cyclic garbage waits,
at most one interval. ``PARKWAY_GC=python`` leaves Python's own collector as it is. When the last
actor stops, the process's collector is put back as it was (thresholds, frozen objects).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from parkway.actors.runtime.metrics import ActorMetrics
from parkway.actors.runtime.settings import SettingsError, seconds_setting

log = structlog.get_logger("parkway.gc")

GC_ENV = "PARKWAY_GC"
GC_EVERY_ENV = "PARKWAY_GC_EVERY_S"
SCHEDULED, PYTHON = "scheduled", "python"
DEFAULT_EVERY_S = 10.0
TICK_S = 0.5  # how often the schedule looks whether a full collection is due
NEVER = 2**30  # a threshold no count reaches: that generation is not collected automatically
# A checkpoint held open this many intervals (a controller gone, a lease running out) no longer
# defers the collection: cyclic garbage must not pile up behind a stuck checkpoint.
OVERDUE_INTERVALS = 6


@dataclass(frozen=True)
class Schedule:
    mode: str = SCHEDULED
    every_s: float = DEFAULT_EVERY_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Schedule:
        env = os.environ if environ is None else environ
        mode = env.get(GC_ENV, "").strip().lower() or SCHEDULED
        if mode not in (SCHEDULED, PYTHON):
            raise SettingsError(f"{GC_ENV}={mode!r}: want {SCHEDULED!r} (the default) or {PYTHON!r}")
        every_s = seconds_setting(
            env, GC_EVERY_ENV, DEFAULT_EVERY_S, within=(0.1, 3600), meaning="seconds between full collections"
        )
        return cls(mode=mode, every_s=every_s)


@dataclass
class Totals:
    """The process's scheduled full collections so far (its metrics read them)."""

    collections: int = 0
    seconds: float = 0.0  # spent in them
    deferred: int = 0  # looks (every TICK_S) that found one due while a checkpoint was open
    last_ms: float = 0.0


@dataclass
class _Collector:
    schedule: Schedule
    thresholds: tuple[int, int, int]  # Python's, put back when the last actor stops
    in_window: dict[int, Callable[[], bool]] = field(default_factory=dict)  # per attached actor
    last: float = field(default_factory=time.monotonic)
    timer: asyncio.Task[None] | None = None

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.schedule.every_s

    def busy(self) -> bool:
        return any(inside() for inside in list(self.in_window.values()))

    def collect_if_due(self) -> None:
        if not self.due():
            return
        overdue = time.monotonic() - self.last >= self.schedule.every_s * OVERDUE_INTERVALS
        if self.busy() and not overdue:
            totals.deferred += 1
            return
        started = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - started
        self.last = time.monotonic()
        totals.collections += 1
        totals.seconds += took
        totals.last_ms = round(took * 1000, 3)
        log.debug("gc_collected", ms=totals.last_ms)

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.collect_if_due()


totals = Totals()
_collector: _Collector | None = None


class Attached(Protocol):
    """What the schedule needs of an actor: its metrics, and whether it is inside a checkpoint now
    (a role without checkpoints has no ``in_window``: never)."""

    metrics: ActorMetrics


def attach(actor: Attached, schedule: Schedule | None = None) -> bool:
    """An actor of this process started (``memory.attach``); the first one sets the schedule up.
    False when the schedule is off (``PARKWAY_GC=python``)."""
    global _collector
    actor.metrics.gauge(
        "parkway_gc_full_collections",
        "Full garbage collections this process scheduled outside checkpoints",
        lambda: totals.collections,
    )
    actor.metrics.gauge(
        "parkway_gc_full_seconds",
        "Seconds this process spent in its scheduled full garbage collections",
        lambda: totals.seconds,
    )
    chosen = schedule or Schedule.from_env()
    if chosen.mode == PYTHON and _collector is None:
        return False
    if _collector is None:
        _collector = _Collector(schedule=chosen, thresholds=gc.get_threshold())
        # Start-up objects: never walked again while actors run (garbage among them waits for the
        # unfreeze when the last actor stops: a collection first would cost every test's cluster).
        gc.freeze()
        gc.set_threshold(_collector.thresholds[0], NEVER, NEVER)
    _collector.in_window[id(actor)] = getattr(actor, "in_window", _never)
    loop = asyncio.get_running_loop()
    timer = _collector.timer
    if timer is None or timer.done() or timer.get_loop() is not loop:  # (a loop of its own: a test's)
        if timer is not None and not timer.done() and not timer.get_loop().is_closed():
            timer.get_loop().call_soon_threadsafe(timer.cancel)
        _collector.timer = loop.create_task(_collector.tick())
    return True


def detach(actor: Attached) -> None:
    """An actor stopped; after the last one the collector is Python's again."""
    global _collector
    collector = _collector
    if collector is None or collector.in_window.pop(id(actor), None) is None or collector.in_window:
        return
    _collector = None
    if collector.timer is not None and not collector.timer.get_loop().is_closed():
        collector.timer.get_loop().call_soon_threadsafe(collector.timer.cancel)
    gc.set_threshold(*collector.thresholds)
    gc.unfreeze()


def _never() -> bool:
    return False


def window_ended() -> None:
    """A checkpoint ended in this process: collect now if a collection is due (the next window is as
    far away as it gets), after the current step of the event loop."""
    collector = _collector
    if collector is not None and collector.due():
        with contextlib.suppress(RuntimeError):  # no running loop: the tick will do it
            asyncio.get_running_loop().call_soon(collector.collect_if_due)
