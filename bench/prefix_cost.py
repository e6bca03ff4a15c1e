"""What keeping the prefixes costs a run that never crashes: ``recovery.target_level`` ``turn`` against
``prefix``, interleaved, with the engine in the policy's process (read at each cut) and in a Ray actor
(polled every ``policy.progress_interval_s``).

    python bench/prefix_cost.py [--rounds 3] [--in-flight 64] [--filler 150] [--delay 0.001]
                                [--hosts inline ray] [--interval 0.5] [--quick]

Each round runs every (host, level) once, in an order rotated from round to round, embedded (every
actor in this process: the cut and the polls compete with the rollouts for the same cores). The
workload: 12 prompts x 8 siblings of the built-in mixed tasks, up to 6 turns, model calls of about ``6 x filler``
tokens at ``--delay`` seconds a token, a snapshot every ``--interval`` seconds. Per run: rollouts a
second, the admission-closed window (p50, p95), the bytes a snapshot wrote (p50), and at ``prefix``
the prefixes cut and their tokens. Reported: the medians over the rounds and the ratio prefix / turn
per host, with the load average. Writes ``bench/results/NAME.json``. Not a test: nothing asserts.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import asyncio
import contextlib
import os
import statistics
from typing import Any

import cluster
import common

LEVELS = ("turn", "prefix")


def workload(host: str, level: str, args: Any) -> dict[str, Any]:
    return {
        "run": f"pc{host[0]}{level[0]}",
        "seed": 3,
        "rollout": {"group_size": 8, "max_turns": 6, "max_in_flight": args.in_flight, "max_tokens": 1500},
        "tasks": {"builtin": "mixed", "limit": args.prompts},
        "policy": {"host": host, "per_token_delay_s": args.delay, "filler_words": args.filler},
        "recovery": {"target_level": level},
        "trainer": {"batch_groups": 2},
        "snapshot_interval_s": args.interval,
    }


async def one(host: str, level: str, args: Any) -> dict[str, Any]:
    async with cluster.started(workload(host, level, args)) as c:
        run = asyncio.ensure_future(c.run())
        counts: dict[str, int] = {}
        while not run.done():  # the policy's counts as the run goes (its actors stop with the run)
            with contextlib.suppress(Exception):
                counts = await c.counts("policy/0")
            await asyncio.wait({run}, timeout=0.5)
        summary = run.result()
    return {
        "host": host,
        "level": level,
        "load_1m": round(os.getloadavg()[0], 2),
        "rollouts_per_s": summary.rollouts_per_s,
        "wall_s": summary.wall_s,
        "snapshots": summary.snapshots_published,
        "pause_p50_ms": summary.pause_ms.get("p50"),
        "pause_p95_ms": summary.pause_ms.get("p95"),
        "snapshot_bytes_p50": summary.snapshot_bytes.get("p50"),
        "prefixes_cut": counts.get("prefixes_cut", 0),
        "prefix_tokens_cut": counts.get("prefix_tokens_cut", 0),
        "progress_polls": counts.get("progress_polls", 0),
        "complete": summary.rollouts_sealed == summary.rollouts_expected,
    }


async def measure(args: Any) -> list[dict[str, Any]]:
    variants = [(host, level) for host in args.hosts for level in LEVELS]
    runs = []
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for host, level in variants[shift:] + variants[:shift]:
            result = await one(host, level, args)
            result["round"] = round_index
            runs.append(result)
            print(
                f"  round {round_index}: {host:<6} {level:<6} {result['rollouts_per_s']:.2f} rollouts/s, "
                f"pause p50 {result['pause_p50_ms']} ms, load {result['load_1m']}",
                file=_sys.stderr,
            )
    return runs


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for host in sorted({r["host"] for r in runs}):
        by_level = {}
        for level in LEVELS:
            mine = [r for r in runs if (r["host"], r["level"]) == (host, level)]
            by_level[level] = {
                key: statistics.median(r[key] for r in mine if r[key] is not None)
                for key in (
                    "rollouts_per_s",
                    "pause_p50_ms",
                    "pause_p95_ms",
                    "snapshot_bytes_p50",
                    "prefix_tokens_cut",
                )
            }
        rows.append(
            {
                "host": host,
                **{f"{level}_{k}": v for level, values in by_level.items() for k, v in values.items()},
                "throughput_ratio": round(
                    by_level["prefix"]["rollouts_per_s"] / by_level["turn"]["rollouts_per_s"], 3
                ),
                "pause_p50_ratio": round(
                    by_level["prefix"]["pause_p50_ms"] / by_level["turn"]["pause_p50_ms"], 3
                ),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "host",
        "rollouts/s turn",
        "prefix",
        "ratio",
        "pause p50 turn (ms)",
        "prefix",
        "ratio",
        "bytes/snapshot turn",
        "prefix",
        "tokens cut per run",
    ]
    body = [
        [
            r["host"],
            f"{r['turn_rollouts_per_s']:.2f}",
            f"{r['prefix_rollouts_per_s']:.2f}",
            f"{r['throughput_ratio']:.3f}",
            f"{r['turn_pause_p50_ms']:.1f}",
            f"{r['prefix_pause_p50_ms']:.1f}",
            f"{r['pause_p50_ratio']:.3f}",
            f"{r['turn_snapshot_bytes_p50']:.0f}",
            f"{r['prefix_snapshot_bytes_p50']:.0f}",
            f"{r['prefix_prefix_tokens_cut']:.0f}",
        ]
        for r in rows
    ]
    return common.markdown_table(headers, body)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=12, help="prompts (8 siblings each; 12 at most)")
    parser.add_argument("--filler", type=int, default=150, help="words before each tool call or answer")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between snapshots")
    parser.add_argument("--hosts", nargs="+", default=["inline", "ray"], choices=["inline", "ray"])
    common.add_engine(parser, delay=0.001, tool_delay=0.0)
    common.add_quick(parser, "one round, inline only, 2 prompts")
    common.add_name(parser, "prefix_cost")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.hosts, args.prompts = 1, ["inline"], 2
    began = common.machine()
    runs = asyncio.run(measure(args))
    rows = medians(runs)
    print(table(rows))
    loads = [r["load_1m"] for r in runs]
    print(
        f"load average (1 min) over the runs: min {min(loads)} median {statistics.median(loads)} max {max(loads)}"
    )
    common.write_record(args.name, "prefix_cost", began, args, {"medians": rows, "runs": runs})


if __name__ == "__main__":
    main()
