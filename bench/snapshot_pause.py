"""What a snapshot costs: the admission-closed window and each save step, per named variant of the
workload (rollouts in flight, tool time, turns per rollout), in interleaved rounds, with the issue's
bounds checked on the medians.

    python bench/snapshot_pause.py [--variants n16 n256 n1024 n256-tools5s n256-turns5 n256-turns50]
                                   [--rounds 3] [--modes rabbitmq] [--delay 0.05] [--tool-delay 0.1]
                                   [--turns 12] [--snapshots 8] [--every 2] [--progress 0.5] [--quick]
                                   [--baseline PYTHONPATH] [--nice-off-window N]

A variant is named by what it changes: ``n256`` is 256 rollouts in flight with the default tools
(``--tool-delay``) and turns (``--turns``); ``-tools5s`` (or ``-tools250ms``) sets every tool call's
time, ``-turns50`` every rollout's turns, ``-rate256`` makes the model calls come as often as 256
rollouts make them, whatever the variant holds in flight; any such name may be given to
``--variants``. The default set is what the issue's figures need: 16, 256 and 1024 in flight, at 256
tools of 5 s and rollouts of 5 and of 50 turns, and 16 and 1024 at the rate of 256.

Each round runs every variant once, in an order rotated from round to round (a slow drift of this
shared machine falls on all of them alike), each on a fresh cluster: in mode ``rabbitmq`` every actor
its own process on the local RabbitMQ with the controller in this one (``embedded``: one process, the
in-memory broker). The data plane is busy: the default engine answers at ``--delay`` seconds per token
(a model call of about 90 tokens, ~4.5 s), with the variant's rollouts in flight, every rollout
running exactly its turns (the tasks set none of their own; the tool agent calls a tool every turn
and the engine answers only on the last). The cluster runs until the rollouts have made, on average,
``--progress`` of their turns (0.5: a long run's rollouts, at every turn, hold half of theirs on
average; at least ``--warmup`` seconds), so a 50-turn variant is snapshotted with 25 turns of history
per rollout, not 3; then ``--snapshots`` snapshots, ``--every`` seconds apart. Before each snapshot
the resources say how many tool calls they are running (prepare waits for those: "Boundaries" in
docs/protocol.md), so a variant's tools are seen to be in flight when its snapshots begin.

Per snapshot the controller records the window (``pause_ms``), its save steps (``steps_ms``: whatever
steps the save sequence has, reported as they come), the rollouts saved, the bytes it holds and
those it wrote (the rest linked from the snapshot before), and how long agents waited for their
rollouts to reach a boundary. Per variant the report gives the median over rounds of each round's p50
and p95 window, of the p95 of the agents' round trip (``prepare`` and ``prepared``: after the window
since it ends at the cut's instant) and of each step's p50, the 1-minute load before and after every point, and the
snapshots whose window waited over 20 ms for receipts already on the wire (``drained``: taken while
many rollouts were finishing) with the p95 of the others. Then the issue's figures, each from the
rounds' p95s both as the median of the per-round ratios and as the ratio of the medians, against its
bound (p95 <= 50 ms; ratios <= 1.5).

``--baseline DIR`` compares with another build in the same sitting: DIR is a ``PYTHONPATH`` entry
whose ``parkway`` is the other build (a link tree: ``ln -s /path/to/old-checkout DIR/parkway``). Every
point of each build then runs in a process of its own, the two builds' points of one variant back to
back, which goes first alternating from round to round; the baseline's rows and figures carry the mode
``<mode>@baseline``. ``--nice-off-window N`` starts the roles no step of the window waits on (policy,
tool servers, TQ) with their CPU priority lowered by N (``parkway actor --nice``).

The defaults take about 30 minutes on this 2-core machine (the 50-turn variant's two minutes of warm-up
three times over is the longest part); ``--quick`` about one. Writes ``bench/results/snapshot_pause.json``
and ``.png``. Not a test: nothing here asserts on time.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import cluster
import common
from parkway.actors.roles.controller.metrics import percentiles

GROUP_SIZE = 8
DEFAULT_VARIANTS = (
    "n16",
    "n256",
    "n1024",
    "n256-tools5s",
    "n256-turns5",
    "n256-turns50",
    "n16-rate256",
    "n1024-rate256",
)
QUICK_VARIANTS = ("n16", "n256")
# The roles no step of a snapshot's window waits on (``protocol.snapshot.SAVE_SEQUENCE``: the window
# prepares the agents only; TQ's Commit is sent in it, and answered after): ``--nice-off-window``.
OFF_WINDOW_ROLES = ("policy", "resources", "tq")
WARMUP_LIMIT_S = 600.0  # a variant whose rollouts never reach --progress starts its snapshots anyway
_VARIANT = re.compile(
    r"n(?P<in_flight>\d+)(?:-tools(?P<tools>\d+(?:\.\d+)?)(?P<unit>ms|s))?(?:-turns(?P<turns>\d+))?"
    r"(?:-rate(?P<rate>\d+))?"
)


@dataclass(frozen=True)
class Variant:
    """One workload the snapshots are taken under, named by what it changes."""

    name: str
    in_flight: int
    tool_delay_s: float
    turns: int
    # The model calls come as fast as they would with this many rollouts in flight (the engine's time
    # per token scaled by in flight / rate), so the data plane does the same work whatever the variant
    # holds in flight; None: as fast as the engine's time per token gives.
    rate: int | None = None

    def per_token_delay_s(self, delay_s: float) -> float:
        return delay_s if self.rate is None else delay_s * self.in_flight / self.rate


def parse_variant(name: str, *, tool_delay_s: float, turns: int) -> Variant:
    """``n<in flight>[-tools<T>s|-tools<T>ms][-turns<K>][-rate<R>]``; what the name leaves out is the
    default."""
    match = _VARIANT.fullmatch(name)
    if (
        match is None
        or int(match["in_flight"]) < 1
        or (match["turns"] and int(match["turns"]) < 1)
        or (match["rate"] and int(match["rate"]) < 1)
    ):
        raise ValueError(
            f"variant {name!r}: n<in flight>[-tools<T>s|-tools<T>ms][-turns<K>][-rate<R>], e.g. n256-tools5s"
        )
    if match["tools"] is not None:
        tool_delay_s = float(match["tools"]) / (1000 if match["unit"] == "ms" else 1)
    return Variant(
        name=name,
        in_flight=int(match["in_flight"]),
        tool_delay_s=tool_delay_s,
        turns=int(match["turns"]) if match["turns"] else turns,
        rate=int(match["rate"]) if match["rate"] else None,
    )


def round_order(variants: Sequence[Variant], round_index: int) -> list[Variant]:
    """Every variant once, the order rotated by one from round to round."""
    shift = round_index % len(variants)
    return [*variants[shift:], *variants[:shift]]


@dataclass(frozen=True)
class Check:
    """One of the issue's figures: a variant's p95, or its p95 over another's, against a bound."""

    figure: str
    variant: str
    over: str | None  # None: the variant's own p95 (ms) is the figure
    bound: float


CHECKS = (
    Check("pause p95 at 256 in flight, 100 ms tools (ms)", "n256", None, 50.0),
    Check("p95 at 1024 in flight / p95 at 16", "n1024", "n16", 1.5),
    # The same with the data plane's work held equal (its model calls at 256's rate): what grows with
    # the rollouts a snapshot holds, apart from what grows with the work of the machine's processes.
    Check("p95 at 1024 / at 16, model calls at one rate", "n1024-rate256", "n16-rate256", 1.5),
    Check("p95 with 5 s tools / with 100 ms tools, at 256", "n256-tools5s", "n256", 1.5),
    Check("p95 with 50-turn rollouts / with 5-turn ones, at 256", "n256-turns50", "n256-turns5", 1.5),
)


# -- one point: a variant, a mode, a round ----------------------------------------------------------------


def workload(variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
    # Four times the rollouts that run at once (finished ones are replaced, so in flight stays at the
    # target, and the dataset never runs out during a point), or ``--prompts`` prompts: the dataset
    # behind them, which must not matter.
    # A variant at a fixed rate finishes its rollouts rate / in flight times as fast: as many more.
    prompts = max(args.prompts, math.ceil(4 * max(variant.in_flight, variant.rate or 0) / GROUP_SIZE))
    return {
        "run": f"pause{uuid.uuid4().hex[:6]}",
        "seed": 7,
        "rollout": {"group_size": GROUP_SIZE, "max_turns": variant.turns, "max_in_flight": variant.in_flight},
        "tasks": {"path": str(cluster.tasks_file(prompts))},  # no turns of their own: max_turns each
        "policy": {"host": "inline", "per_token_delay_s": variant.per_token_delay_s(args.delay)},
        "resources": {"tool_delay_s": variant.tool_delay_s},
        "snapshot_interval_s": 3600.0,  # the benchmark takes them, on its own clock
    }


async def measure(variant: Variant, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    state = _Path(tempfile.mkdtemp(prefix="parkway-bench-"))
    try:
        return await measure_in(state, variant, mode, args)
    finally:
        shutil.rmtree(state, ignore_errors=True)  # a 50-turn point's snapshots are tens of MB


async def measure_in(state: _Path, variant: Variant, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    # Killed at the end: a point's cluster is thrown away, and a graceful stop costs ~10 s a point.
    nice = dict.fromkeys(OFF_WINDOW_ROLES, args.nice_off_window)
    async with cluster.started(workload(variant, args), mode, state=state, kill_at_end=True, nice=nice) as c:
        run = asyncio.ensure_future(c.run())
        while c.controller.snapshots is None or len(c.controller.ledger.dispatched()) < variant.in_flight:
            alive(run)
            if time.monotonic() - began > 120:
                raise TimeoutError(f"{variant.in_flight} rollouts not dispatched within 120 s")
            await asyncio.sleep(0.1)
        dispatched = time.monotonic()
        turns_done = await warm_up(c, run, variant, args)
        warmed = time.monotonic()
        tools_running: list[int] = []
        for _ in range(args.snapshots):
            alive(run)
            tools_running.append(await tool_calls_running(c))
            await c.controller.take_snapshot()
            await asyncio.sleep(args.every)
        alive(run)
        snapshotted = time.monotonic()
        await cluster.cancel(run)
        metrics = c.controller.snapshots.metrics
        records, failed = list(metrics.records), metrics.failed
    point = summarize(records, failed)
    ended = time.monotonic()
    point.update(
        variant=variant.name,
        mode=mode,
        turns_done_at_first_snapshot=round(turns_done, 2),
        tool_calls_running=tools_running,
        seconds=round(ended - began, 1),
        # Where a point's time goes: starting the cluster and dispatching, the warm-up, the snapshots,
        # stopping it.
        phases_s={
            "start": round(dispatched - began, 1),
            "warmup": round(warmed - dispatched, 1),
            "snapshots": round(snapshotted - warmed, 1),
            "stop": round(ended - snapshotted, 1),
        },
    )
    return point


def alive(run: asyncio.Future[Any]) -> None:
    """The workload still runs (a snapshot of a finished run would measure an idle cluster)."""
    if run.done():
        run.result()  # its error, if it failed
        raise RuntimeError("the workload ended during the point: give it more prompts (--prompts)")


async def warm_up(
    c: cluster.Cluster, run: asyncio.Future[Any], variant: Variant, args: argparse.Namespace
) -> float:
    """Run until the rollouts have made ``--progress`` of their turns on average (and ``--warmup``
    seconds have passed); the average turns made. Until the first of them ends every model call is one
    of the rollouts in flight, so the policy's model calls over the rollouts are their turns so far."""
    started = time.monotonic()
    target = args.progress * variant.turns
    while True:
        alive(run)
        turns_done = (await c.counts("policy/0")).get("model_calls", 0) / variant.in_flight
        waited = time.monotonic() - started
        if waited >= args.warmup and turns_done >= target:
            return turns_done
        if waited > WARMUP_LIMIT_S:
            print(
                f"  {variant.name}: {turns_done:.1f} turns made of {target:.1f} after {waited:.0f} s",
                file=_sys.stderr,
            )
            return turns_done
        await asyncio.sleep(0.5)


async def tool_calls_running(c: cluster.Cluster) -> int:
    """The tool calls the resources are running now (a call counts while its handler runs)."""
    replicas = c.config.topology.resources
    return sum([(await c.status(f"resources/{i}")).in_flight for i in range(replicas)])


# A snapshot that waited this long for receipts already on the wire (``drain_receipts``; inside the
# window in the builds before the window ended at the instant): one taken while many rollouts were
# finishing. Counted apart, so the tail with and without them can be told apart (reported, not a check).
DRAINED_MS = 20.0


def drained(record: dict[str, Any]) -> bool:
    return float(record.get("steps_ms", {}).get("drain_receipts", 0.0)) > DRAINED_MS


def round_trip_ms(record: dict[str, Any]) -> float:
    """The agents' round trip of one snapshot: its ``prepare`` step, and its ``prepared`` step where
    the save sequence has one (the cuts coming back after the window; before it, ``prepare`` held both)."""
    steps = record.get("steps_ms", {})
    return float(steps.get("prepare", 0.0)) + float(steps.get("prepared", 0.0))


def summarize(records: list[dict[str, Any]], failed: int) -> dict[str, Any]:
    """One point's figures from the controller's records (steps: whatever the records name)."""
    pause = [r["pause_ms"] for r in records]
    undrained = [r["pause_ms"] for r in records if not drained(r)]
    waits = [r["park_wait_ms"] for r in records if "park_wait_ms" in r]
    return {
        "snapshots": len(records),
        "failed": failed,
        "rollouts_saved_p50": statistics.median([r.get("rollouts", 0) for r in records]) if records else 0,
        "pause_ms": percentiles(pause),
        "round_trip_ms": percentiles([round_trip_ms(r) for r in records]) if records else None,
        "drained": len(pause) - len(undrained),
        "pause_undrained_ms": percentiles(undrained) if undrained else None,
        "park_wait_ms": percentiles(waits) if waits else None,
        "pause_without_park_wait_ms": percentiles(
            [max(0.0, r["pause_ms"] - r["park_wait_ms"]) for r in records]
        )
        if waits and len(waits) == len(records)
        else None,
        "steps_ms_p50": {
            step: round(statistics.median(r["steps_ms"][step] for r in records if step in r["steps_ms"]), 3)
            for step in steps_seen(records)
        },
        "bytes_p50": int(statistics.median(r.get("bytes", 0) for r in records)) if records else 0,
        "bytes_written_p50": int(
            statistics.median(r.get("bytes_written", r.get("bytes", 0)) for r in records)
        )
        if records
        else 0,
        "records": records,
    }


def steps_seen(records: Sequence[dict[str, Any]]) -> list[str]:
    """Every step any record names: the first record's in its order, then the others' as they come."""
    seen: dict[str, None] = {}
    for record in records:
        seen.update(dict.fromkeys(record.get("steps_ms", {})))
    return list(seen)


# -- over the rounds ------------------------------------------------------------------------------------


def aggregate(
    points: list[dict[str, Any]], variants: Sequence[Variant], modes: Sequence[str]
) -> list[dict[str, Any]]:
    """Per variant and mode: the medians over rounds of each round's p50, p95 and step p50s."""
    rows = []
    steps = steps_seen([{"steps_ms": p["steps_ms_p50"]} for p in points])
    for variant in variants:
        for mode in modes:
            mine = sorted(
                (p for p in points if p["variant"] == variant.name and p["mode"] == mode),
                key=lambda p: p["round"],
            )
            if not mine:
                continue
            running = [n for p in mine for n in p["tool_calls_running"]]
            without = [
                p["pause_without_park_wait_ms"]["p50"] for p in mine if p["pause_without_park_wait_ms"]
            ]
            rows.append(
                {
                    **asdict(variant),
                    "variant": variant.name,
                    "mode": mode,
                    "rounds": len(mine),
                    "snapshots": sum(p["snapshots"] for p in mine),
                    "failed": sum(p["failed"] for p in mine),
                    "pause_p50_ms": round(statistics.median(p["pause_ms"]["p50"] for p in mine), 3),
                    "pause_p95_ms": round(statistics.median(p["pause_ms"]["p95"] for p in mine), 3),
                    "pause_p95_ms_by_round": {p["round"]: p["pause_ms"]["p95"] for p in mine},
                    "round_trip_p95_ms": median_or_none(
                        [p["round_trip_ms"]["p95"] for p in mine if p.get("round_trip_ms")]
                    ),
                    # Snapshots that waited over DRAINED_MS for receipts, and the p95 of the others.
                    "drained": sum(p.get("drained", 0) for p in mine),
                    "pause_p95_undrained_ms": median_or_none(
                        [p["pause_undrained_ms"]["p95"] for p in mine if p.get("pause_undrained_ms")]
                    ),
                    "park_wait_p50_ms": median_or_none(
                        [p["park_wait_ms"]["p50"] for p in mine if p["park_wait_ms"]]
                    ),
                    "without_park_wait_p50_ms": median_or_none(without),
                    "steps_ms_p50": {
                        step: median_or_none(
                            [p["steps_ms_p50"][step] for p in mine if step in p["steps_ms_p50"]]
                        )
                        for step in steps
                    },
                    "tool_calls_running": {"min": min(running, default=0), "p50": median_or_none(running)},
                    "turns_done_at_first_snapshot": median_or_none(
                        [p["turns_done_at_first_snapshot"] for p in mine]
                    ),
                    "bytes_p50": int(statistics.median(p["bytes_p50"] for p in mine)),
                    "bytes_written_p50": int(
                        statistics.median(p.get("bytes_written_p50", p["bytes_p50"]) for p in mine)
                    ),
                    "load_1m": [p["load_1m"] for p in mine],
                    "seconds_per_point": round(statistics.median(p["seconds"] for p in mine), 1),
                }
            )
    return rows


def median_or_none(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's figures from the per-round p95s, each mode on its own; those whose variants did not
    run are left out."""
    found = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        by_name = {r["variant"]: r for r in rows if r["mode"] == mode}
        for check in CHECKS:
            if check.variant not in by_name or (check.over is not None and check.over not in by_name):
                continue
            p95 = by_name[check.variant]["pause_p95_ms_by_round"]
            if check.over is None:
                per_round = dict(p95)
                of_medians = by_name[check.variant]["pause_p95_ms"]
            else:
                base = by_name[check.over]["pause_p95_ms_by_round"]
                per_round = {r: p95[r] / base[r] for r in p95 if r in base and base[r] > 0}
                of_medians = by_name[check.variant]["pause_p95_ms"] / max(
                    1e-9, by_name[check.over]["pause_p95_ms"]
                )
            median = statistics.median(per_round.values()) if per_round else math.nan
            found.append(
                {
                    "figure": check.figure,
                    "mode": mode,
                    "variant": check.variant,
                    "over": check.over,
                    "bound": check.bound,
                    "by_round": {r: round(v, 3) for r, v in per_round.items()},
                    "median_of_rounds": round(median, 3),
                    "of_medians": round(of_medians, 3),
                    "within": {
                        "median_of_rounds": median <= check.bound,
                        "of_medians": of_medians <= check.bound,
                    },
                }
            )
    return found


# -- this build against a baseline ----------------------------------------------------------------------


def builds_compared(baseline: str | None) -> list[tuple[str, str | None]]:
    """(mode suffix, PYTHONPATH) per build; None: this process runs the point itself."""
    if baseline is None:
        return [("", None)]
    if not (_Path(baseline) / "parkway").is_dir():
        raise SystemExit(f"--baseline {baseline}: no parkway package there (link one: DIR/parkway)")
    return [("", os.environ.get("PYTHONPATH", "")), ("@baseline", os.path.abspath(baseline))]


def run_point(
    variant: Variant, mode: str, args: argparse.Namespace, pythonpath: str | None
) -> dict[str, Any]:
    """One point: here, or in a process of its own that imports ``parkway`` from ``pythonpath``."""
    if pythonpath is None:
        return asyncio.run(measure(variant, mode, args))
    with tempfile.TemporaryDirectory(prefix="parkway-point-") as tmp:
        out = _Path(tmp) / "point.json"
        command = [
            _sys.executable,
            str(_Path(__file__).resolve()),
            *("--variants", variant.name, "--modes", mode, "--point-out", str(out)),
            *("--delay", str(args.delay), "--tool-delay", str(args.tool_delay), "--turns", str(args.turns)),
            *("--prompts", str(args.prompts), "--warmup", str(args.warmup)),
            *("--progress", str(args.progress), "--snapshots", str(args.snapshots)),
            *("--every", str(args.every), "--nice-off-window", str(args.nice_off_window)),
        ]
        env = {**os.environ, "PYTHONPATH": pythonpath}
        subprocess.run(command, env=env, check=True)
        return json.loads(out.read_text())


# -- what it prints and draws -------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def pause_ms(value: float | None) -> str:
    """A window in ms to the microsecond: it is a few microseconds long since it holds one counter's read."""
    return "-" if value is None else f"{value:.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    steps = steps_seen([{"steps_ms": r["steps_ms_p50"]} for r in rows])
    headers = [
        "variant",
        "mode",
        "in flight",
        "tools s",
        "turns",
        "turns made",
        "pause p50",
        "p95",
        "p95 per round",
        "round trip p95",
        "drained",
        "p95 undrained",
        "park wait p50",
        "without p50",
        "tool calls running min / p50",
        "MB held",
        "MB written",
        "load 1m before > after",
        *steps,
    ]
    body = [
        [
            r["variant"],
            r["mode"],
            r["in_flight"],
            f"{r['tool_delay_s']:g}",
            r["turns"],
            ms(r["turns_done_at_first_snapshot"]),
            pause_ms(r["pause_p50_ms"]),
            pause_ms(r["pause_p95_ms"]),
            " ".join(pause_ms(v) for v in r["pause_p95_ms_by_round"].values()),
            ms(r.get("round_trip_p95_ms")),
            r.get("drained", "-"),
            pause_ms(r.get("pause_p95_undrained_ms")),
            ms(r["park_wait_p50_ms"]),
            ms(r["without_park_wait_p50_ms"]),
            f"{r['tool_calls_running']['min']} / {ms(r['tool_calls_running']['p50'])}",
            f"{r['bytes_p50'] / 1e6:.2f}",
            f"{r['bytes_written_p50'] / 1e6:.2f}",
            " ".join(f"{a}>{b}" for a, b in r["load_1m"]),
            *(ms(r["steps_ms_p50"].get(s)) for s in steps),
        ]
        for r in rows
    ]
    return common.markdown_table(headers, body, "ll" + "r" * 6 + "lr" + "r" * 7 + "l" + "r" * len(steps))


def checks_table(found: list[dict[str, Any]]) -> str:
    def verdict(ok: bool) -> str:
        return "yes" if ok else "NO"

    headers = ["figure", "mode", "per round", "median of rounds", "within", "of medians", "within", "bound"]
    body = [
        [
            c["figure"],
            c["mode"],
            " ".join(f"{v:.2f}" for v in c["by_round"].values()),
            f"{c['median_of_rounds']:.2f}",
            verdict(c["within"]["median_of_rounds"]),
            f"{c['of_medians']:.2f}",
            verdict(c["within"]["of_medians"]),
            f"<= {c['bound']:g}",
        ]
        for c in found
    ]
    return common.markdown_table(headers, body, "lll" + "rlrlr")


def plot(rows: list[dict[str, Any]], path: _Path, title: str) -> None:
    plt = common.pyplot()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 1 + len(modes), figsize=(7 + 6 * len(modes), 4.8))
    ax = axes[0]
    width = 0.8 / max(1, len(modes))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    colors = {"embedded": "tab:blue", "rabbitmq": "tab:red"}
    for m, mode in enumerate(modes):
        mine = {r["variant"]: r for r in rows if r["mode"] == mode}
        xs = [i + (m - (len(modes) - 1) / 2) * width for i, n in enumerate(names) if n in mine]
        shown = [mine[n] for n in names if n in mine]
        color = colors.get(mode, "tab:gray")
        ax.bar(
            xs,
            [r["pause_p95_ms"] for r in shown],
            width,
            color=color,
            alpha=0.6,
            label=f"{mode}: p95, median of rounds",
        )
        ax.plot(xs, [r["pause_p50_ms"] for r in shown], "k_", ms=14, mew=2)
        for x, r in zip(xs, shown, strict=True):
            rounds = list(r["pause_p95_ms_by_round"].values())
            ax.plot([x] * len(rounds), rounds, ".", color="k", alpha=0.6)
    ax.plot([], [], "k_", label="p50, median of rounds")
    ax.plot([], [], "k.", label="p95 of one round")
    ax.axhline(50, color="green", lw=0.8, ls="--", label="50 ms (the bound at n256)")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("admission-closed window (ms)")
    ax.set_title("Snapshot pause per variant")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    steps = steps_seen([{"steps_ms": r["steps_ms_p50"]} for r in rows])
    palette = plt.get_cmap("tab20")
    for ax, mode in zip(axes[1:], modes, strict=True):
        mine = [r for r in rows if r["mode"] == mode]
        labels = [r["variant"] for r in mine]
        # One line per step, not a stack: a log scale shows the small steps beside a 5 s one, and a stack
        # on a log scale would misdraw the shares.
        for k, step in enumerate(steps):
            values = [r["steps_ms_p50"].get(step) for r in mine]
            ax.plot(
                labels, [v if v else float("nan") for v in values], "o-", color=palette(k % 20), label=step
            )
        ax.plot(labels, [r["pause_p50_ms"] for r in mine], "kD--", label="pause p50")
        ax.set_yscale("log")
        ax.set_ylabel("step duration, p50 (ms)")
        ax.set_title(f"{mode}: each save step's p50, median of rounds")
        ax.tick_params(axis="x", rotation=20, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    common.save_figure(fig, path, title)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), help="e.g. n256 n256-tools5s"
    )
    parser.add_argument("--rounds", type=int, default=3, help="every variant once per round")
    common.add_modes(parser, default=["rabbitmq"])
    common.add_engine(parser, delay=0.05, tool_delay=0.1)
    parser.add_argument("--turns", type=int, default=12, help="turns per rollout, unless a variant says")
    parser.add_argument(
        "--prompts", type=int, default=0, help="prompts in the dataset (0: 4 x in flight / 8)"
    )
    parser.add_argument(
        "--warmup", type=float, default=8.0, help="seconds of running before the first, at least"
    )
    parser.add_argument(
        "--progress", type=float, default=0.5, help="share of their turns the rollouts have made at the first"
    )
    parser.add_argument("--snapshots", type=int, default=8, help="snapshots per point")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between snapshots")
    common.add_quick(parser, "1 round of n16 and n256, 4 snapshots 1 s apart from a quarter of the turns")
    common.add_name(parser, "snapshot_pause")
    parser.add_argument(
        "--baseline", metavar="PYTHONPATH", help="another build's PYTHONPATH entry, measured interleaved"
    )
    parser.add_argument(
        "--nice-off-window",
        type=int,
        default=0,
        choices=range(20),
        metavar="N",
        help="the policy, tool servers and TQ lower their CPU priority by N (0 to 19; a baseline build "
        "without the setting ignores it)",
    )
    parser.add_argument("--point-out", help=argparse.SUPPRESS)  # internal: run one point, write it here
    args = parser.parse_args()
    if args.point_out:
        [variant] = [parse_variant(v, tool_delay_s=args.tool_delay, turns=args.turns) for v in args.variants]
        [mode] = args.modes
        point = asyncio.run(measure(variant, mode, args))
        _Path(args.point_out).write_text(json.dumps(point))
        return
    if args.quick:
        args.rounds, args.variants, args.snapshots, args.every, args.progress = (
            1,
            list(QUICK_VARIANTS),
            4,
            1.0,
            0.25,
        )
    variants = [parse_variant(v, tool_delay_s=args.tool_delay, turns=args.turns) for v in args.variants]
    began = common.machine()
    started = time.monotonic()
    points = []
    builds = builds_compared(args.baseline)
    for round_index in range(args.rounds):
        for variant in round_order(variants, round_index):
            for mode in args.modes:
                for suffix, pythonpath in builds[round_index % 2 :] + builds[: round_index % 2]:
                    before = common.load_1m()
                    point = run_point(variant, mode, args, pythonpath)
                    point.update(mode=mode + suffix, round=round_index, load_1m=[before, common.load_1m()])
                    points.append(point)
                    print(
                        f"  round {round_index} {variant.name} {point['mode']}: pause p50 {pause_ms(point['pause_ms']['p50'])} "
                        f"p95 {pause_ms(point['pause_ms']['p95'])} ms, tool calls running {point['tool_calls_running']}, "
                        f"{point['seconds']:.0f} s {point['phases_s']}, load {point['load_1m'][0]} > {point['load_1m'][1]}",
                        file=_sys.stderr,
                    )
    rows = aggregate(points, variants, [m + suffix for m in args.modes for suffix, _ in builds])
    found = checks(rows)
    minutes = (time.monotonic() - started) / 60
    print(table(rows))
    print()
    print(checks_table(found))
    print(
        f"{len(points)} points in {minutes:.1f} min; load (1 min) {points[0]['load_1m'][0]} to {points[-1]['load_1m'][1]}"
    )
    common.write_record(
        args.name, "snapshot_pause", began, args, rows, checks=found, minutes=round(minutes, 1), points=points
    )
    plot(
        rows,
        common.figure_path(args.name),
        f"{args.delay * 1000:.0f} ms/token, {args.rounds} rounds, {common.machine_line(began)}",
    )


if __name__ == "__main__":
    main()
