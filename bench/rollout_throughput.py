"""What snapshots cost in throughput: rollouts and tokens per second with snapshots off and every 120,
30 and 10 seconds, measured side by side in one run, reported as ratios to "off".

    python bench/rollout_throughput.py [--mode rabbitmq] [--in-flight 256] [--window 20] [--rounds 6]
                                       [--intervals 120 30 10] [--quick]

One workload runs for the whole benchmark with ``--in-flight`` rollouts at a time (the default engine
at ``--delay`` seconds per token, tools of ``--tool-delay`` seconds, rollouts of 2 to ``--turns``
turns so that they finish steadily, not in waves). Time is cut into windows of
``--window`` seconds; each round gives every schedule (off and each interval) one window, in an order
rotated from round to round, so slow drifts of this shared machine fall on every schedule alike. A
schedule "every I seconds" takes a snapshot each time the time spent in its own windows passes
(k + 1/2) I: over 6 rounds of 20 s it has 120 s of its own, so every 120 s is one snapshot, every
30 s four, every 10 s twelve. Throughput per schedule is what its windows produced
(tokens the policy generated, rollouts sealed) over their time; the ratio is against "off".

Also written per snapshot: the pause and the bytes written, against the time into the run (a run's
snapshots must not grow as it goes on). Writes ``bench/results/rollout_throughput.json`` and
``.png``. Not a test: nothing here asserts on time.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import math
import time
import uuid
from typing import Any

import cluster
import common

OFF = "off"


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
        "policy": {"host": "inline", "per_token_delay_s": args.delay},
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
    async with cluster.started(workload(args), args.mode) as c:
        run = asyncio.ensure_future(c.run())
        started = time.monotonic()
        while c.controller.snapshots is None or len(c.controller.ledger.dispatched()) < args.in_flight:
            if run.done():
                run.result()
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.warmup)
        run_started = started
        for round_index in range(args.rounds):
            for schedule in schedule_order(schedules, round_index):
                before = await sample(c)
                window_started = time.monotonic()
                end = window_started + args.window
                interval = None if schedule == OFF else float(schedule)
                pause_ms = 0.0
                while True:
                    now = time.monotonic()
                    if interval is not None:
                        due = (taken[schedule] + 0.5) * interval - own_s[schedule]  # own time to go
                        at = window_started + due
                    else:
                        at = math.inf
                    if at >= end:
                        await asyncio.sleep(max(0.0, end - now))
                        break
                    await asyncio.sleep(max(0.0, at - now))
                    count = len(c.controller.snapshots.metrics.records)
                    await c.controller.take_snapshot()
                    taken[schedule] += 1
                    records = c.controller.snapshots.metrics.records
                    if len(records) > count:
                        record = records[-1]
                        pause_ms += record["pause_ms"]
                        snapshots.append(
                            {
                                "schedule": schedule,
                                "t_s": round(time.monotonic() - run_started, 1),
                                "pause_ms": record["pause_ms"],
                                "bytes": record["bytes"],
                                "rollouts": record["rollouts"],
                                "park_wait_ms": record["park_wait_ms"],
                                "steps_ms": record["steps_ms"],
                            }
                        )
                took = time.monotonic() - window_started
                own_s[schedule] += took
                after = await sample(c)
                windows.append(
                    {
                        "round": round_index,
                        "schedule": schedule,
                        "seconds": round(took, 3),
                        "tokens": after["tokens"] - before["tokens"],
                        "model_calls": after["model_calls"] - before["model_calls"],
                        "rollouts": after["rollouts"] - before["rollouts"],
                        "pause_ms": round(pause_ms, 3),
                    }
                )
                w = windows[-1]
                print(
                    f"  round {round_index} {schedule:>4}: {w['tokens'] / took:8.1f} tokens/s "
                    f"{w['rollouts'] / took:6.2f} rollouts/s, paused {pause_ms:.0f} ms",
                    file=_sys.stderr,
                )
        await cluster.cancel(run)
        failed = c.controller.snapshots.metrics.failed
    return {"windows": windows, "snapshots": snapshots, "snapshots_failed": failed, "schedules": schedules}


async def sample(c: cluster.Cluster) -> dict[str, int]:
    policy = await c.counts("policy/0")
    return {
        "tokens": policy.get("tokens_generated", 0),
        "model_calls": policy.get("model_calls", 0),
        "rollouts": c.controller.counts["rollouts_sealed"],
    }


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
        rows.append(
            {
                "schedule": schedule,
                "seconds": round(seconds, 1),
                "snapshots": sum(1 for s in result["snapshots"] if s["schedule"] == schedule),
                "tokens_per_s": round(tokens_s, 1),
                "rollouts_per_s": round(rollouts_s, 3),
                "tokens_ratio": round(tokens_s / max(1e-9, base["tokens"] / base["seconds"]), 4),
                "rollouts_ratio": round(rollouts_s / max(1e-9, base["rollouts"] / base["seconds"]), 4),
                "tokens_ratio_by_round": [round(r, 4) for r in per_round],
                "paused_fraction": round(paused / seconds, 5),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["snapshots", "seconds", "taken", "tokens/s", "ratio", "rollouts/s", "ratio", "gate closed"]
    body = [
        [
            "off" if r["schedule"] == OFF else f"every {r['schedule']} s",
            f"{r['seconds']:.0f}",
            r["snapshots"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_ratio']:.3f}",
            f"{r['rollouts_per_s']:.2f}",
            f"{r['rollouts_ratio']:.3f}",
            f"{100 * r['paused_fraction']:.3f}%",
            " ".join(f"{x:.3f}" for x in r["tokens_ratio_by_round"]),
        ]
        for r in rows
    ]
    return common.markdown_table([*headers, "tokens ratio per round"], body, "lrrrrrrrl")


def plot(rows: list[dict[str, Any]], result: dict[str, Any], path: _Path, title: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    labels = ["off" if r["schedule"] == OFF else f"every {r['schedule']} s" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tokens_ratio"] for r in rows], 0.4, label="tokens/s, all rounds")
    ax.bar([x + 0.2 for x in xs], [r["rollouts_ratio"] for r in rows], 0.4, label="rollouts/s, all rounds")
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
    parser.add_argument("--window", type=float, default=20.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=6, help="windows per schedule")
    common.add_engine(parser, delay=0.05, tool_delay=0.1)
    parser.add_argument("--turns", type=int, default=7, help="rollouts have 2 to this many turns")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the first window")
    common.add_quick(parser, "windows of 8 s, 2 rounds, intervals 16 4 2")
    common.add_name(parser, "rollout_throughput")
    args = parser.parse_args()
    if args.quick:
        args.window, args.rounds, args.intervals, args.warmup = 8.0, 2, [16.0, 4.0, 2.0], 8.0
    args.intervals = [int(i) if float(i).is_integer() else i for i in args.intervals]
    began = common.machine()
    result = asyncio.run(measure(args))
    rows = summarize(result)
    print(table(rows))
    common.write_record(args.name, "rollout_throughput", began, args, rows, **result)
    plot(
        rows,
        result,
        common.figure_path(args.name),
        f"{args.mode}, {args.in_flight} rollouts in flight, {args.delay * 1000:.0f} ms/token, tools "
        f"{args.tool_delay * 1000:.0f} ms, windows of {args.window:.0f} s x {args.rounds} rounds, "
        f"{common.machine_line(began)}",
    )


if __name__ == "__main__":
    main()
