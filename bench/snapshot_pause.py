"""What a snapshot costs: the admission-closed window and each save step against rollouts in flight.

    python bench/snapshot_pause.py [--in-flight 16 64 256 1024] [--modes embedded rabbitmq]
                                   [--delay 0.05] [--tool-delay 0.1] [--snapshots 8] [--quick]

Each point starts a cluster with ``--in-flight`` rollouts running (the default engine answering at
``--delay`` seconds per token, about 4.5 s a model call; every tool call taking ``--tool-delay``), lets
it run ``--warmup`` seconds, takes ``--snapshots`` snapshots ``--every`` seconds apart, and stops it.
Per snapshot the controller records the window, every step, the rollouts it saved, the bytes it wrote
and how long agents waited for their rollouts to reach a boundary: prepare waits for tool calls in
flight (docs/protocol.md#boundaries: tools are waited for), so that part of the pause is the tools' own time, not the
framework's. The table shows both: the pause, and the pause without that wait.

Modes: ``embedded`` (one process, in-memory broker) and ``rabbitmq`` (every actor its own process on
the local RabbitMQ, the controller in this one). Writes ``bench/results/snapshot_pause.json`` and
``.png``. Not a test: nothing here asserts on time.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import math
import statistics
import time
import uuid
from typing import Any

import cluster
import common
from parkway.actors.roles.controller.metrics import percentiles

STEPS = ("prepare", "commit", "capture", "validate", "publish", "resume")


GROUP_SIZE = 8


def workload(in_flight: int, args: argparse.Namespace) -> dict[str, Any]:
    # Twice the rollouts that run at once (finished ones are replaced, so in flight stays at the
    # target), or ``--prompts`` prompts: the dataset behind them, which must not matter.
    prompts = max(args.prompts, math.ceil(2 * in_flight / GROUP_SIZE))
    return {
        "run": f"pause{uuid.uuid4().hex[:6]}",
        "seed": 7,
        "rollout": {"group_size": GROUP_SIZE, "max_turns": args.turns, "max_in_flight": in_flight},
        "tasks": {"path": str(cluster.tasks_file(prompts))},
        "policy": {"host": "inline", "per_token_delay_s": args.delay},
        "resources": {"tool_delay_s": args.tool_delay},
        "snapshot_interval_s": 3600.0,  # the benchmark takes them, on its own clock
    }


async def measure(in_flight: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    async with cluster.started(workload(in_flight, args), mode) as c:
        run = asyncio.ensure_future(c.run())
        started = time.monotonic()
        while c.controller.snapshots is None or len(c.controller.ledger.dispatched()) < in_flight:
            if run.done():
                run.result()
            if time.monotonic() - started > 120:
                raise TimeoutError(f"{in_flight} rollouts not dispatched within 120 s")
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.warmup)
        for _ in range(args.snapshots):
            await c.controller.take_snapshot()
            await asyncio.sleep(args.every)
        await cluster.cancel(run)
        records = list(c.controller.snapshots.metrics.records)
        failed = c.controller.snapshots.metrics.failed
    return summarize(in_flight, mode, records, failed)


def summarize(in_flight: int, mode: str, records: list[dict[str, Any]], failed: int) -> dict[str, Any]:
    pause = [r["pause_ms"] for r in records]
    own = [max(0.0, r["pause_ms"] - r["park_wait_ms"]) for r in records]
    return {
        "mode": mode,
        "in_flight": in_flight,
        "snapshots": len(records),
        "failed": failed,
        "rollouts_saved_p50": statistics.median([r["rollouts"] for r in records]) if records else 0,
        "pause_ms": percentiles(pause),
        "pause_without_park_wait_ms": percentiles(own),
        "park_wait_ms": percentiles([r["park_wait_ms"] for r in records]),
        "steps_ms_p50": {
            step: round(statistics.median(r["steps_ms"].get(step, 0.0) for r in records), 3)
            for step in (records[0]["steps_ms"] if records else ())
        },
        "bytes_p50": int(statistics.median(r["bytes"] for r in records)) if records else 0,
        "records": records,
    }


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "mode",
        "in flight",
        "snaps",
        "pause p50",
        "p95",
        "max",
        "park wait p50",
        "own p50",
        "p95",
        "MB",
    ]
    body = []
    for r in rows:
        p, o, w = r["pause_ms"], r["pause_without_park_wait_ms"], r["park_wait_ms"]
        body.append(
            [
                r["mode"],
                r["in_flight"],
                r["snapshots"],
                f"{p['p50']:.1f}",
                f"{p['p95']:.1f}",
                f"{p['max']:.1f}",
            ]
            + [f"{w['p50']:.1f}", f"{o['p50']:.1f}", f"{o['p95']:.1f}", f"{r['bytes_p50'] / 1e6:.2f}"]
            + [f"{r['steps_ms_p50'].get(s, 0):.1f}" for s in STEPS]
        )
    return common.markdown_table(headers + list(STEPS), body)


def plot(rows: list[dict[str, Any]], path: _Path, title: str) -> None:
    plt = common.pyplot()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 1 + len(modes), figsize=(6 + 5 * len(modes), 4.8))
    ax = axes[0]
    colors = {"embedded": "tab:blue", "rabbitmq": "tab:red"}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        xs = [r["in_flight"] for r in mine]
        color = colors.get(mode, "tab:gray")
        ax.plot(xs, [r["pause_ms"]["p50"] for r in mine], "o-", color=color, label=f"{mode}: pause p50")
        ax.plot(xs, [r["pause_ms"]["p95"] for r in mine], "^--", color=color, label=f"{mode}: pause p95")
        ax.plot(
            xs,
            [r["pause_without_park_wait_ms"]["p50"] for r in mine],
            "s:",
            color=color,
            alpha=0.6,
            label=f"{mode}: without the wait for tool calls, p50",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["in_flight"] for r in rows}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("rollouts in flight")
    ax.set_ylabel("admission-closed window (ms)")
    ax.set_title("Snapshot pause")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(0, max(r["pause_ms"]["p95"] for r in rows) * 1.5)
    ax.legend(fontsize=7, loc="upper left")
    for ax, mode in zip(axes[1:], modes, strict=True):
        mine = [r for r in rows if r["mode"] == mode]
        labels = [str(r["in_flight"]) for r in mine]
        bottom = [0.0] * len(mine)
        for step in (*STEPS, "other"):
            if step == "other":
                values = [
                    max(0.0, r["pause_ms"]["p50"] - sum(r["steps_ms_p50"].get(s, 0) for s in STEPS))
                    for r in mine
                ]
            else:
                values = [r["steps_ms_p50"].get(step, 0.0) for r in mine]
            ax.bar(labels, values, bottom=bottom, label=step)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        wait = [r["park_wait_ms"]["p50"] for r in mine]
        ax.plot(labels, wait, "k_", markersize=28, mew=2, label="prepare's wait for tool calls")
        twin = ax.twinx()
        twin.plot(labels, [r["bytes_p50"] / 1e6 for r in mine], "kD-", label="MB written")
        twin.set_ylabel("MB written per snapshot (p50)")
        ax.set_xlabel("rollouts in flight")
        ax.set_ylabel("median step duration (ms)")
        ax.set_title(f"{mode}: the window by step (p50)")
        ax.set_ylim(0, max(bottom) * 1.6)
        twin.set_ylim(0, max(r["bytes_p50"] for r in mine) / 1e6 * 1.6)
        handles, names = ax.get_legend_handles_labels()
        more, more_names = twin.get_legend_handles_labels()
        ax.legend(handles + more, names + more_names, fontsize=7, loc="upper left", ncol=2)
    common.save_figure(fig, path, title)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 64, 256, 1024])
    common.add_modes(parser)
    common.add_engine(parser, delay=0.05, tool_delay=0.1)
    parser.add_argument("--turns", type=int, default=12, help="turns per rollout")
    parser.add_argument(
        "--prompts", type=int, default=0, help="prompts in the dataset (0: 2 x in flight / 8)"
    )
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds of running before the first")
    parser.add_argument("--snapshots", type=int, default=8, help="snapshots per point")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between snapshots")
    common.add_quick(parser, "16 and 256 in flight, 4 snapshots each")
    common.add_name(parser, "snapshot_pause")
    args = parser.parse_args()
    if args.quick:
        args.in_flight, args.snapshots, args.warmup = [16, 256], 4, 4.0
    began = common.machine()
    rows = []
    for n in args.in_flight:
        for mode in args.modes:
            rows.append(asyncio.run(measure(n, mode, args)))
            print(f"  {mode} {n}: pause p50 {rows[-1]['pause_ms']['p50']} ms", file=_sys.stderr)
    print(table(rows))
    common.write_record(args.name, "snapshot_pause", began, args, rows)
    plot(
        rows,
        common.figure_path(args.name),
        f"{args.delay * 1000:.0f} ms/token, tools {args.tool_delay * 1000:.0f} ms, {common.machine_line(began)}",
    )


if __name__ == "__main__":
    main()
