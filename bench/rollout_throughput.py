"""What snapshots cost the data plane: tokens and rollouts per second with snapshots off and every 120,
30 and 10 seconds, measured side by side in one run, as ratios to "off"; the CPU every process used;
and how long a turn takes when a snapshot falls in it against when none does.

    python bench/rollout_throughput.py [--mode rabbitmq] [--in-flight 256] [--window 45] [--rounds 3]
                                       [--intervals 120 30 10] [--cpu-per-token 0.0001] [--quick]

One workload runs for the whole benchmark with ``--in-flight`` rollouts at a time (the default engine
at ``--delay`` seconds per token, a model call of about 90 tokens taking ~4.5 s, and spending
``--cpu-per-token`` seconds of CPU per token, ``policy.cpu_per_token_s``; tools of ``--tool-delay``
seconds; rollouts of 2 to ``--turns`` turns so that they finish steadily, not in waves). Time is cut
into windows of ``--window`` seconds, ten model calls long by default; each round gives every schedule
(off and each interval) one window, in an order rotated from round to round, so slow drifts of this
shared machine fall on every schedule alike. A schedule "every I seconds" takes a snapshot each time
the time spent in its own windows passes (k + 1/2) I: over 3 rounds of 45 s it has 135 s of its own,
so every 120 s is one snapshot, every 30 s five, every 10 s fourteen.

What is counted, per window (the windows tile the run: one sample ends a window and starts the next):

- tokens as they accrue: the policy's ``tokens_accrued`` (its ``Status``), which the deterministic
  engine keeps as the tokens of every returned generation plus, for each generation still running, the
  tokens its per-token pace has brought out so far. A window's tokens are those generated inside it,
  not the tokens of whichever calls happened to return inside it (``tokens_generated``, counted on
  return, is kept beside it in the record: with calls of 4.5 s its window-to-window spread is larger);
- rollouts sealed (the controller's count: a rollout counts when it ends, so this one does depend on
  which rollouts end inside a window);
- the CPU seconds every actor process used (``/proc``; the policy's with its engine's compute
  process, where the CPU per token is spent) and this process's (the controller's);
- the time the admission gate was closed (each snapshot's ``pause_ms``).

Per turn: the agents record their history (``PARKWAY_HISTORY``, one line per model and tool call, in
the agent processes only); a turn is the time from one model call sent to the next one of the same
attempt (the model call, its tool calls, and any wait at the boundary after them). A turn *overlaps a
snapshot* when its span meets the span of the controller's ``take_snapshot`` (which contains the
admission-closed window); the table compares those with the turns that meet none, medians and p95, per
schedule. Turns that began before the first window or ended after the last are left out.

The engine's CPU is what lets a snapshot's own CPU show in throughput: with a sleeping engine, the
cores the snapshot takes are idle ones. At the default 100 us a token and ~5,000 tokens a second the
engine's compute process spends about half a core on generation alone.

Writes ``bench/results/rollout_throughput.json`` and ``.png``. Not a test: nothing here asserts on time.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import bisect
import math
import os
import time
import uuid
from collections import defaultdict
from typing import Any

import cluster
import common
from parkway.actors.roles.controller.metrics import percentiles

OFF = "off"
THIS_PROCESS = "this process"  # the controller (over RabbitMQ), or every actor (embedded)


def workload(args: argparse.Namespace) -> dict[str, Any]:
    total_s = args.window * args.rounds * (1 + len(args.intervals)) + args.warmup
    turn_s = 90 * args.delay + args.tool_delay  # a model call is about 90 tokens here
    rollouts = math.ceil(2 * args.in_flight * total_s / (2 * turn_s))  # more than enough
    group_size = 4  # groups finish steadily, the trainer takes them, TQ lets their rows go
    return {
        "run": f"thru{uuid.uuid4().hex[:6]}",
        "seed": 11,
        "rollout": {"group_size": group_size, "max_in_flight": args.in_flight},
        "tasks": {"path": str(cluster.tasks_file(math.ceil(rollouts / group_size), turns=(2, args.turns)))},
        "policy": {
            "host": "inline",  # tokens_accrued is the inline engine's
            "per_token_delay_s": args.delay,
            "cpu_per_token_s": args.cpu_per_token,
        },
        "resources": {"tool_delay_s": args.tool_delay},
        "trainer": {"batch_groups": 1},
        "snapshot_interval_s": 3600.0,  # the benchmark takes them, on each schedule's own clock
    }


def schedule_order(schedules: list[str], round_index: int) -> list[str]:
    shift = round_index % len(schedules)
    return schedules[shift:] + schedules[:shift]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    schedules = [OFF, *(str(i) for i in args.intervals)]
    own_s = dict.fromkeys(schedules, 0.0)  # time spent in each schedule's windows so far
    taken = dict.fromkeys(schedules, 0)  # snapshots each schedule took so far
    windows: list[dict[str, Any]] = []
    snapshots: list[dict[str, Any]] = []
    async with cluster.started(workload(args), args.mode, history_roles=("agent",)) as c:
        run = asyncio.ensure_future(c.run())
        while c.controller.snapshots is None or len(c.controller.ledger.dispatched()) < args.in_flight:
            if run.done():
                run.result()
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.warmup)
        run_started = time.monotonic()
        before = await sample(c)
        for round_index in range(args.rounds):
            for schedule in schedule_order(schedules, round_index):
                end = before["monotonic"] + args.window
                interval = None if schedule == OFF else float(schedule)
                pause_ms = 0.0
                while True:
                    now = time.monotonic()
                    if interval is not None:
                        due = (taken[schedule] + 0.5) * interval - own_s[schedule]  # own time to go
                        at = before["monotonic"] + due
                    else:
                        at = math.inf
                    if at >= end:
                        await asyncio.sleep(max(0.0, end - now))
                        break
                    await asyncio.sleep(max(0.0, at - now))
                    snapshot = await timed_snapshot(c)
                    taken[schedule] += 1
                    if snapshot is not None:
                        pause_ms += snapshot["pause_ms"]
                        snapshots.append(
                            {
                                "schedule": schedule,
                                "t_s": round(time.monotonic() - run_started, 1),
                                **snapshot,
                            }
                        )
                after = await sample(c)
                windows.append(window_record(round_index, schedule, before, after, pause_ms))
                own_s[schedule] += windows[-1]["seconds"]
                before = after
                w = windows[-1]
                print(
                    f"  round {round_index} {schedule:>4}: {w['tokens'] / w['seconds']:8.1f} tokens/s "
                    f"{w['rollouts'] / w['seconds']:6.2f} rollouts/s, paused {pause_ms:.0f} ms, "
                    f"load {common.load_1m()}",
                    file=_sys.stderr,
                )
        await cluster.cancel(run)
        failed = c.controller.snapshots.metrics.failed
        turns = turn_spans(c)
    return {
        "windows": windows,
        "snapshots": snapshots,
        "snapshots_failed": failed,
        "schedules": schedules,
        "turns": turns,
    }


async def timed_snapshot(c: cluster.Cluster) -> dict[str, Any] | None:
    """One snapshot, its record, and the wall-clock span of the controller's call (the agents' history
    is on the wall clock too)."""
    assert c.controller.snapshots is not None
    records = c.controller.snapshots.metrics.records
    count = len(records)
    began = time.time()
    await c.controller.take_snapshot()
    ended = time.time()
    if len(records) == count:
        return None  # skipped or failed: nothing published
    record = records[-1]
    return {
        "began_unix": began,
        "ended_unix": ended,
        "pause_ms": record["pause_ms"],
        "bytes": record["bytes"],
        "rollouts": record["rollouts"],
        "park_wait_ms": record.get("park_wait_ms"),
        "steps_ms": record["steps_ms"],
    }


async def sample(c: cluster.Cluster) -> dict[str, Any]:
    """The counters a window is the difference of, and when they were read."""
    policy = await c.counts("policy/0")
    # Each actor process with what it started (the engine's compute process); embedded, every actor
    # is this process (and its compute process is a child of it).
    trees = common.process_tree_cpu_s([os.getpid(), *(p.pid for p in c.processes)])
    cpu = {p.name: trees[p.pid] for p in c.processes}
    cpu[THIS_PROCESS] = time.process_time() if c.processes else trees[os.getpid()]
    return {
        "monotonic": time.monotonic(),
        "unix": time.time(),
        "tokens_accrued": policy.get("tokens_accrued"),
        "tokens_generated": policy.get("tokens_generated", 0),
        "model_calls": policy.get("model_calls", 0),
        "rollouts": c.controller.counts["rollouts_sealed"],
        "cpu_s": cpu,
    }


def window_record(
    round_index: int, schedule: str, before: dict[str, Any], after: dict[str, Any], pause_ms: float
) -> dict[str, Any]:
    accrued = after["tokens_accrued"] is not None and before["tokens_accrued"] is not None
    cpu = {
        name: round(after["cpu_s"][name] - used, 3)
        for name, used in before["cpu_s"].items()
        if used is not None and after["cpu_s"].get(name) is not None
    }
    return {
        "round": round_index,
        "schedule": schedule,
        "seconds": round(after["monotonic"] - before["monotonic"], 3),
        # Without the engine's count (a Ray-hosted engine), tokens on return are all there is.
        "tokens": after["tokens_accrued"] - before["tokens_accrued"]
        if accrued
        else after["tokens_generated"] - before["tokens_generated"],
        "tokens_counted": "accrued" if accrued else "on return",
        "tokens_on_return": after["tokens_generated"] - before["tokens_generated"],
        "model_calls": after["model_calls"] - before["model_calls"],
        "rollouts": after["rollouts"] - before["rollouts"],
        "pause_ms": round(pause_ms, 3),
        "cpu_s": cpu,
        "began_unix": round(before["unix"], 3),
    }


def turn_spans(c: cluster.Cluster) -> list[tuple[float, float]]:
    """Every turn's (start, end), wall clock: from a model call sent to the next of the same attempt."""
    sent: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for record in cluster.history_records(c, "agent"):
        if record.get("k") == "model_call":
            sent[(record["r"], record["a"])][record["i"]] = record["t"]
    spans = []
    for calls in sent.values():
        for index, started in calls.items():
            if index + 1 in calls:
                spans.append((started, calls[index + 1]))
    return sorted(spans)


# -- what the samples say -------------------------------------------------------------------------------


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    windows = result["windows"]
    rows = []
    per_round_off = {w["round"]: w for w in windows if w["schedule"] == OFF}
    base = {k: sum(w[k] for w in per_round_off.values()) for k in ("tokens", "rollouts", "seconds")}
    for schedule in result["schedules"]:
        mine = [w for w in windows if w["schedule"] == schedule]
        seconds = sum(w["seconds"] for w in mine)
        tokens_s = sum(w["tokens"] for w in mine) / seconds
        rollouts_s = sum(w["rollouts"] for w in mine) / seconds
        paused = sum(w["pause_ms"] for w in mine) / 1000
        per_round = [
            (w["tokens"] / w["seconds"])
            / max(1e-9, per_round_off[w["round"]]["tokens"] / per_round_off[w["round"]]["seconds"])
            for w in mine
        ]
        cpu: dict[str, float] = defaultdict(float)
        for w in mine:
            for name, used in w["cpu_s"].items():
                cpu[name] += used
        rows.append(
            {
                "schedule": schedule,
                "seconds": round(seconds, 1),
                "snapshots": sum(1 for s in result["snapshots"] if s["schedule"] == schedule),
                "tokens_per_s": round(tokens_s, 1),
                "tokens_counted": sorted({w["tokens_counted"] for w in mine}),
                "tokens_on_return_per_s": round(sum(w["tokens_on_return"] for w in mine) / seconds, 1),
                "rollouts_per_s": round(rollouts_s, 3),
                "tokens_ratio": round(tokens_s / max(1e-9, base["tokens"] / base["seconds"]), 4),
                "rollouts_ratio": round(rollouts_s / max(1e-9, base["rollouts"] / base["seconds"]), 4),
                "tokens_ratio_by_round": [round(r, 4) for r in per_round],
                "paused_fraction": round(paused / seconds, 5),
                "cores": {name: round(used / seconds, 3) for name, used in sorted(cpu.items())},
            }
        )
    return rows


def turn_latency(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per schedule (and all together): turns that overlap a snapshot against those that overlap none,
    each turn counted in the window it began in."""
    windows = result["windows"]
    starts = [w["began_unix"] for w in windows]
    last_end = windows[-1]["began_unix"] + windows[-1]["seconds"] if windows else 0.0
    spans = sorted((s["began_unix"], s["ended_unix"]) for s in result["snapshots"])
    snapshot_starts = [b for b, _ in spans]
    by_schedule: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"overlap": [], "clear": []})
    for began, ended in result["turns"]:
        if not starts or began < starts[0] or ended > last_end:
            continue
        schedule = windows[bisect.bisect_right(starts, began) - 1]["schedule"]
        # Snapshots run one at a time: of those that began before this turn ended, the last ended last.
        before_end = bisect.bisect_left(snapshot_starts, ended)
        overlaps = before_end > 0 and spans[before_end - 1][1] > began
        ms = (ended - began) * 1000
        for key in (schedule, "all"):
            by_schedule[key]["overlap" if overlaps else "clear"].append(ms)
    rows = []
    for schedule in [*result["schedules"], "all"]:
        groups = by_schedule.get(schedule, {"overlap": [], "clear": []})
        rows.append(
            {
                "schedule": schedule,
                **{
                    f"{kind}_{stat}": value
                    for kind in ("overlap", "clear")
                    for stat, value in (
                        ("turns", len(groups[kind])),
                        ("p50_ms", percentiles(groups[kind])["p50"] if groups[kind] else None),
                        ("p95_ms", percentiles(groups[kind])["p95"] if groups[kind] else None),
                    )
                },
            }
        )
    return rows


def label(schedule: str) -> str:
    return {OFF: "off", "all": "all schedules"}.get(schedule, f"every {schedule} s")


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "snapshots",
        "seconds",
        "taken",
        "tokens/s",
        "ratio",
        "on return",
        "rollouts/s",
        "ratio",
        "gate closed",
        "cores: policy",
        "all",
    ]
    body = [
        [
            label(r["schedule"]),
            f"{r['seconds']:.0f}",
            r["snapshots"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_ratio']:.3f}",
            f"{r['tokens_on_return_per_s']:.1f}",
            f"{r['rollouts_per_s']:.2f}",
            f"{r['rollouts_ratio']:.3f}",
            f"{100 * r['paused_fraction']:.3f}%",
            f"{r['cores'].get('policy/0', 0.0):.2f}",
            f"{sum(r['cores'].values()):.2f}",
            " ".join(f"{x:.3f}" for x in r["tokens_ratio_by_round"]),
        ]
        for r in rows
    ]
    return common.markdown_table([*headers, "tokens ratio per round"], body, "l" + "r" * 10 + "l")


def latency_table(rows: list[dict[str, Any]]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    headers = [
        "turns in",
        "overlapping a snapshot",
        "p50 ms",
        "p95 ms",
        "overlapping none",
        "p50 ms",
        "p95 ms",
    ]
    body = [
        [
            label(r["schedule"]),
            r["overlap_turns"],
            ms(r["overlap_p50_ms"]),
            ms(r["overlap_p95_ms"]),
            r["clear_turns"],
            ms(r["clear_p50_ms"]),
            ms(r["clear_p95_ms"]),
        ]
        for r in rows
    ]
    return common.markdown_table(headers, body)


def plot(
    rows: list[dict[str, Any]], latency: list[dict[str, Any]], result: dict[str, Any], path: _Path, title: str
) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    labels = [label(r["schedule"]) for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tokens_ratio"] for r in rows], 0.4, label="tokens/s (accrued)")
    ax.bar([x + 0.2 for x in xs], [r["rollouts_ratio"] for r in rows], 0.4, label="rollouts/s")
    for x, r in zip(xs, rows, strict=True):
        ax.plot([x - 0.2] * len(r["tokens_ratio_by_round"]), r["tokens_ratio_by_round"], "k.", alpha=0.6)
    ax.plot([], [], "k.", label="tokens/s, one round's window")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.99, color="red", lw=0.8, ls="--", label="1% lost (the target at 120 s)")
    low = min([0.97] + [min(r["tokens_ratio_by_round"]) for r in rows] + [r["rollouts_ratio"] for r in rows])
    high = max([1.01] + [max(r["tokens_ratio_by_round"]) for r in rows] + [r["rollouts_ratio"] for r in rows])
    ax.set_ylim(low - 0.015, high + 0.015)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("throughput / throughput with snapshots off")
    ax.set_title("Throughput against snapshots off (same run, alternating windows)")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(True, axis="y", alpha=0.3)
    ax = axes[1]
    shown = [r for r in latency if r["schedule"] != OFF]
    xs = range(len(shown))
    for offset, kind, color in ((-0.2, "overlap", "tab:red"), (0.2, "clear", "tab:blue")):
        name = "overlapping a snapshot" if kind == "overlap" else "overlapping none"
        ax.bar(
            [x + offset for x in xs],
            [(r[f"{kind}_p50_ms"] or 0) / 1000 for r in shown],
            0.4,
            color=color,
            alpha=0.7,
            label=f"{name}: p50",
        )
        ax.plot(
            [x + offset for x in xs],
            [(r[f"{kind}_p95_ms"] or 0) / 1000 for r in shown],
            "_",
            color="k",
            ms=18,
        )
    ax.plot([], [], "k_", label="p95")
    ax.set_xticks(list(xs), [label(r["schedule"]) for r in shown])
    ax.set_ylabel("turn (model call sent to the next), s")
    ax.set_title("Per-turn latency")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(True, axis="y", alpha=0.3)
    ax = axes[2]
    snaps = result["snapshots"]
    ax.plot([s["t_s"] for s in snaps], [s["pause_ms"] for s in snaps], "o", color="tab:red", label="pause")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("admission-closed window (ms)")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot([s["t_s"] for s in snaps], [s["bytes"] / 1e6 for s in snaps], "s-", color="tab:blue", ms=3)
    twin.set_ylabel("MB written by the snapshot", color="tab:blue")
    twin.set_ylim(bottom=0)
    ax.set_title("Each snapshot over the run: pause (red), bytes written (blue)")
    ax.grid(True, alpha=0.3)
    common.save_figure(fig, path, title)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--mode", default="rabbitmq", choices=common.MODES)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--intervals", type=float, nargs="+", default=[120.0, 30.0, 10.0])
    parser.add_argument("--window", type=float, default=45.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=3, help="windows per schedule")
    common.add_engine(parser, delay=0.05, tool_delay=0.1)
    parser.add_argument(
        "--cpu-per-token", type=float, default=0.0001, help="engine CPU seconds per token (busy loop)"
    )
    parser.add_argument("--turns", type=int, default=7, help="rollouts have 2 to this many turns")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the first window")
    common.add_quick(parser, "windows of 10 s, 2 rounds, intervals 16 4 2")
    common.add_name(parser, "rollout_throughput")
    args = parser.parse_args()
    if args.quick:
        args.window, args.rounds, args.intervals, args.warmup = 10.0, 2, [16.0, 4.0, 2.0], 8.0
    args.intervals = [int(i) if float(i).is_integer() else i for i in args.intervals]
    began = common.machine()
    result = asyncio.run(measure(args))
    ended_load = common.load_1m()
    rows = summarize(result)
    latency = turn_latency(result)
    print(table(rows))
    print()
    print(latency_table(latency))
    print(f"load (1 min) {began['loadavg_1m_at_start']} at the start, {ended_load} at the end")
    turns = result.pop("turns")
    common.write_record(
        args.name,
        "rollout_throughput",
        began,
        args,
        rows,
        loadavg_1m_at_end=ended_load,
        turn_latency=latency,
        turns_measured=len(turns),
        **result,
    )
    plot(
        rows,
        latency,
        result,
        common.figure_path(args.name),
        f"{args.mode}, {args.in_flight} rollouts in flight, {args.delay * 1000:.0f} ms and "
        f"{args.cpu_per_token * 1e6:.0f} us CPU per token, tools {args.tool_delay * 1000:.0f} ms, windows of "
        f"{args.window:.0f} s x {args.rounds} rounds, {common.machine_line(began)}",
    )


if __name__ == "__main__":
    main()
