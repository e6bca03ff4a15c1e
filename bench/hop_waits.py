"""What a hop between actors waits for, measured from outside while a command runs: the broker, or a
process waiting for a core.

    python bench/hop_waits.py [--every 0.05] [--name hop_waits] [--out FILE] -- COMMAND...

e.g. ``python bench/hop_waits.py -- python bench/snapshot_pause.py --variants n1024-rate256 --rounds 1``.
While the command runs, two samplers:

- a broker ping: this process, which does nothing else, publishes a message to a queue of its own on
  the local RabbitMQ every ``--every`` seconds and times its delivery back: one hop through the broker
  (and this idle process's wake-up, which the kernel favours), under whatever load the command makes;
- the kernel's scheduler statistics (``/proc/PID/task/TID/schedstat``, every second, in a thread of its
  own) of every process whose command line names parkway or RabbitMQ's ``beam.smp``, and of the command
  itself: the time its threads ran on a core, the time they were runnable but waited for one, and the
  timeslices they got.

At the end it prints, per process (named by its role and replica where it is an actor), its CPU (the
share of one core), its runqueue wait (ms per second of wall time), timeslices per second and the
wait per timeslice; and the ping's p50, p90 and p99. A process that waits for a core cannot read the
message the broker delivered it; a broker that is slow is slow for the idle ping too. Every sample is
written to ``bench/results/<name>.json`` (or ``--out``), so one window (a benchmark point) can be cut
out. Linux only (schedstat). Not a test: nothing here asserts on time.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import common

BROKER_URL = os.environ.get("PARKWAY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")  # as cluster.py
_ACTOR = re.compile(r"\bactor (?P<role>[a-z_]+) --replica (?P<replica>\d+)")

# A process's scheduler sample: wall time (s), ns on a core, ns runnable and waiting, timeslices.
Sample = tuple[float, int, int, int]


def process_label(cmdline: str, command_pid: int, pid: int) -> str | None:
    """What a process is, from its command line: ``agent/0`` for an actor process, ``rabbitmq`` for
    the broker's VM, ``command`` for the command run; None for any other process."""
    if pid == command_pid:
        return "command"
    if match := _ACTOR.search(cmdline):
        return f"{match['role']}/{match['replica']}"
    if "beam.smp" in cmdline:
        return "rabbitmq"
    if "parkway" in cmdline:
        return "parkway"
    return None


def read_schedstat(pid: int) -> tuple[int, int, int] | None:
    """(ns on a core, ns waiting for one, timeslices), summed over the process's threads; None once it
    is gone."""
    run = wait = slices = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on_cpu, waited, count = f.read().split()
            run, wait, slices = run + int(on_cpu), wait + int(waited), slices + int(count)
    except (OSError, ValueError):
        return None
    return run, wait, slices


def rates(samples: Sequence[Sample]) -> dict[str, float] | None:
    """Between a process's first and last sample: CPU (share of one core), runqueue wait (ms per s of
    wall time), timeslices per s, and wait per timeslice (µs). None with under a second between them."""
    (t0, run0, wait0, slices0), (t1, run1, wait1, slices1) = samples[0], samples[-1]
    wall = t1 - t0
    if wall < 1.0:
        return None
    slices = slices1 - slices0
    return {
        "seconds": wall,
        "cpu": (run1 - run0) / 1e9 / wall,
        "wait_ms_per_s": (wait1 - wait0) / 1e6 / wall,
        "slices_per_s": slices / wall,
        "wait_per_slice_us": (wait1 - wait0) / 1e3 / slices if slices else 0.0,
    }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class SchedSampler:
    """Every second, in a thread: each watched process's scheduler statistics, by pid."""

    def __init__(self, command_pid: int) -> None:
        self.command_pid = command_pid
        self.labels: dict[int, str] = {}
        self.samples: dict[int, list[Sample]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="schedstat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(1.0)

    def sample(self) -> None:
        now = time.time()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            if pid not in self.labels:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                label = process_label(cmdline, self.command_pid, pid)
                if label is None or pid == os.getpid():
                    continue
                self.labels[pid] = label
            stat = read_schedstat(pid)
            if stat is not None:
                self.samples.setdefault(pid, []).append((now, *stat))


async def ping(every_s: float, stop: asyncio.Event) -> list[tuple[float, float]]:
    """(sent at, ms until delivered back) for a message every ``every_s`` through the broker."""
    import aio_pika

    connection = await aio_pika.connect(BROKER_URL)
    pings: list[tuple[float, float]] = []
    try:
        channel = await connection.channel(publisher_confirms=False)
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        arrived: asyncio.Queue[float] = asyncio.Queue()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            arrived.put_nowait(time.perf_counter())
            await message.ack()

        await queue.consume(on_message)
        while not stop.is_set():
            sent_at, began = time.time(), time.perf_counter()
            await channel.default_exchange.publish(aio_pika.Message(b"ping"), routing_key=queue.name)
            pings.append((sent_at, (await arrived.get() - began) * 1e3))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
    finally:
        await connection.close()
    return pings


async def measure(
    command: Sequence[str], every_s: float
) -> tuple[int, SchedSampler, list[tuple[float, float]]]:
    process = await asyncio.create_subprocess_exec(*command)
    sampler = SchedSampler(process.pid)
    sampler.start()
    stop = asyncio.Event()
    pinging = asyncio.ensure_future(ping(every_s, stop))
    try:
        code = await process.wait()
    finally:
        stop.set()
        sampler.stop()
    return code, sampler, await pinging


def report(
    sampler: SchedSampler, pings: list[tuple[float, float]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    processes = []
    for pid, samples in sampler.samples.items():
        measured = rates(samples)
        if measured is not None:
            processes.append({"process": sampler.labels[pid], "pid": pid, "from": samples[0][0], **measured})
    processes.sort(key=lambda p: (p["from"], p["process"]))
    ms = [m for _, m in pings]
    ping_summary = {
        "pings": len(ms),
        **({f"p{q}": percentile(ms, q / 100) for q in (50, 90, 99)} if ms else {}),
    }
    return processes, ping_summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--every", type=float, default=0.05, help="seconds between two pings")
    common.add_name(parser, "hop_waits")
    parser.add_argument("--out", type=_Path, help="where the samples go (default bench/results/NAME.json)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: hop_waits.py [options] -- COMMAND...")
    if not os.path.exists("/proc/self/schedstat"):
        parser.error("this kernel has no /proc/PID/schedstat")
    began = common.machine()
    code, sampler, pings = asyncio.run(measure(command, args.every))
    processes, ping_summary = report(sampler, pings)
    print(
        common.markdown_table(
            ("process", "pid", "seconds", "cpu %", "runqueue wait ms/s", "slices/s", "wait per slice µs"),
            [
                (
                    p["process"],
                    p["pid"],
                    f"{p['seconds']:.0f}",
                    f"{100 * p['cpu']:.1f}",
                    f"{p['wait_ms_per_s']:.1f}",
                    f"{p['slices_per_s']:.0f}",
                    f"{p['wait_per_slice_us']:.0f}",
                )
                for p in processes
            ],
            "lrrrrrr",
        )
    )
    if ping_summary["pings"]:
        print(
            f"broker ping every {args.every}s from an idle process: {ping_summary['pings']} pings, "
            f"p50 {ping_summary['p50']:.2f} p90 {ping_summary['p90']:.2f} p99 {ping_summary['p99']:.2f} ms"
        )
    record = {
        "bench": "hop_waits",
        **began,
        "command": command,
        "exit_code": code,
        "processes": processes,
        "ping": ping_summary,
        "samples": {
            str(pid): {"process": sampler.labels[pid], "schedstat": s} for pid, s in sampler.samples.items()
        },
        "pings": pings,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(record) + "\n")
    else:
        common.write_json(args.name, record)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
