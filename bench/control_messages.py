"""The control plane: messages per snapshot, by type, against rollouts in flight.

    python bench/control_messages.py [--in-flight 16 64 256 1024] [--modes embedded rabbitmq]

Every control message comes from the controller and every reply comes back to it, so the benchmark
counts at the controller's client: each request and one-way message it sends during a snapshot, by
type, with its encoded size, and each reply by type. Embedded, the participants' own Prometheus
counters (``parkway_messages_total{type,outcome}``, one registry per actor) are read as well: what
they received during the snapshot, which must be the same numbers. Expected: one Prepare, Commit and
Resume per participant, one Status per agent before the gate and one at validation, one Ack per agent
at most (the receipts batched), never one per rollout; bytes grow with the rollouts (the episode scope
rides on Commit and Committed). Writes ``bench/results/control_messages.json`` and ``.png``.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import argparse
import asyncio
import collections
import math
import statistics
import time
import uuid
from typing import Any

import cluster
import common
from parkway.actors.launch import workload as workload_module
from parkway.protocol import codec

CONTROL = ("Status", "Prepare", "Renew", "Commit", "Resume", "Abort", "Retire", "Ack")


def workload(in_flight: int, args: argparse.Namespace) -> dict[str, Any]:
    tasks = 12
    return {
        "run": f"msgs{uuid.uuid4().hex[:6]}",
        "seed": 3,
        # Short rollouts: receipts keep arriving, so snapshots have ACKs to send.
        "rollout": {
            "group_size": math.ceil(4 * in_flight / tasks),
            "max_turns": args.turns,
            "max_in_flight": in_flight,
        },
        "tasks": {"builtin": "mixed", "limit": tasks},
        "policy": {"host": "inline", "per_token_delay_s": args.delay},
        "resources": {"tool_delay_s": args.tool_delay},
        "snapshot_interval_s": 3600.0,
    }


class Counting:
    """Wraps a client's request and send: counts and sizes each message by type while ``on``, and the
    replies to control commands."""

    def __init__(self, client: Any) -> None:
        self.on = False
        self.sent: collections.Counter[str] = collections.Counter()
        self.sent_bytes: collections.Counter[str] = collections.Counter()
        self.replies: collections.Counter[str] = collections.Counter()
        self.reply_bytes: collections.Counter[str] = collections.Counter()
        self.acked = 0  # receipts the Acks sent carried
        request, send = client.request, client.send

        async def counted_request(address: str, message: Any, **kwargs: Any) -> Any:
            reply = await request(address, message, **kwargs)
            if self.on:
                self._count(message, self.sent, self.sent_bytes)
                if type(message).__name__ in CONTROL:  # replies to control commands only
                    self._count(reply, self.replies, self.reply_bytes)
            return reply

        async def counted_send(address: str, message: Any, **kwargs: Any) -> Any:
            if self.on:
                self._count(message, self.sent, self.sent_bytes)
                self.acked += len(getattr(message, "receipts", ()))
            return await send(address, message, **kwargs)

        client.request, client.send = counted_request, counted_send

    @staticmethod
    def _count(message: Any, counts: collections.Counter[str], sizes: collections.Counter[str]) -> None:
        kind = type(message).__name__
        counts[kind] += 1
        sizes[kind] += len(codec.encode(message))

    def take(self) -> dict[str, dict[str, int]]:
        taken = {
            "sent": dict(self.sent),
            "sent_bytes": dict(self.sent_bytes),
            "replies": dict(self.replies),
            "reply_bytes": dict(self.reply_bytes),
            "acked": self.acked,
        }
        self.acked = 0
        for counter in (self.sent, self.sent_bytes, self.replies, self.reply_bytes):
            counter.clear()
        return taken


def received(actors: list[Any]) -> collections.Counter[str]:
    """Messages the participants received, by type, from their Prometheus registries."""
    counts: collections.Counter[str] = collections.Counter()
    for actor in actors:
        for family in actor.metrics.registry.collect():
            if family.name != "parkway_messages":
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["type"]] += int(sample.value)
    return counts


async def measure(in_flight: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    actors: list[Any] = []
    make = workload_module.embedded_actors

    def keep(*a: Any, **k: Any) -> list[Any]:
        made = make(*a, **k)
        actors.extend(made)
        return made

    workload_module.embedded_actors = keep  # the participants' registries, for the cross-check
    try:
        async with cluster.started(workload(in_flight, args), mode) as c:
            counting = Counting(c.controller.client)
            run = asyncio.ensure_future(c.run())
            while c.controller.snapshots is None or len(c.controller.ledger.dispatched()) < in_flight:
                if run.done():
                    run.result()
                await asyncio.sleep(0.1)
            await asyncio.sleep(args.warmup)
            snapshots = []
            for _ in range(args.snapshots):
                before = received(actors)
                counting.on = True
                started = time.perf_counter()
                await c.controller.take_snapshot()
                took = time.perf_counter() - started
                counting.on = False
                got = received(actors) - before
                record = c.controller.snapshots.metrics.records[-1]
                snapshots.append(
                    {
                        **counting.take(),
                        "received_prometheus": {k: v for k, v in got.items() if k in CONTROL},
                        "rollouts": record["rollouts"],
                        "seconds": round(took, 3),
                    }
                )
                await asyncio.sleep(args.every)
            await cluster.cancel(run)
    finally:
        workload_module.embedded_actors = make
    return summarize(in_flight, mode, snapshots)


def summarize(in_flight: int, mode: str, snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    def median_of(key: str) -> dict[str, float]:
        kinds = sorted({k for s in snapshots for k in s[key]})
        return {k: statistics.median(s[key].get(k, 0) for s in snapshots) for k in kinds}

    sent = median_of("sent")
    control = {k: v for k, v in sent.items() if k in CONTROL}
    return {
        "mode": mode,
        "in_flight": in_flight,
        "rollouts_saved_p50": statistics.median(s["rollouts"] for s in snapshots),
        "control_sent_p50": control,
        "control_messages_p50": sum(control.values()),
        "acked_receipts_p50": statistics.median(s["acked"] for s in snapshots),
        "replies_p50": sum(median_of("replies").values()),
        "control_bytes_p50": sum(v for k, v in median_of("sent_bytes").items() if k in CONTROL),
        "reply_bytes_p50": sum(median_of("reply_bytes").values()),
        "other_sent_p50": {k: v for k, v in sent.items() if k not in CONTROL},
        "received_prometheus_p50": median_of("received_prometheus") if mode == "embedded" else None,
        "snapshots": snapshots,
    }


def table(rows: list[dict[str, Any]]) -> str:
    kinds = [k for k in CONTROL if any(k in r["control_sent_p50"] for r in rows)]
    headers = ["mode", "in flight", *kinds, "control", "receipts acked", "replies", "KB sent", "KB back"]
    body = []
    for r in rows:
        prom = r["received_prometheus_p50"]
        body.append(
            [
                r["mode"],
                r["in_flight"],
                *(f"{r['control_sent_p50'].get(k, 0):.0f}" for k in kinds),
                f"{r['control_messages_p50']:.0f}",
                f"{r['acked_receipts_p50']:.0f}",
                f"{r['replies_p50']:.0f}",
                f"{r['control_bytes_p50'] / 1e3:.1f}",
                f"{r['reply_bytes_p50'] / 1e3:.1f}",
                ", ".join(f"{k} {v:.0f}" for k, v in prom.items()) if prom else "-",
            ]
        )
    headers.append("received by participants (Prometheus)")
    return common.markdown_table(headers, body, "l" + "r" * (len(headers) - 2) + "l")


def plot(rows: list[dict[str, Any]], path: _Path, title: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    mode = "rabbitmq" if any(r["mode"] == "rabbitmq" for r in rows) else rows[0]["mode"]
    mine = [r for r in rows if r["mode"] == mode]
    labels = [str(r["in_flight"]) for r in mine]
    ax = axes[0]
    bottom = [0.0] * len(mine)
    for kind in CONTROL:
        values = [r["control_sent_p50"].get(kind, 0) for r in mine]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(labels, [r["replies_p50"] for r in mine], "k_", markersize=30, mew=2, label="replies")
    ax.set_xlabel("rollouts in flight")
    ax.set_ylabel("messages per snapshot (median)")
    ax.set_title(f"{mode}: control messages per snapshot, by type")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_ylim(top=max(bottom) * 1.4)
    ax.grid(True, axis="y", alpha=0.3)
    ax = axes[1]
    xs = [r["in_flight"] for r in mine]
    ax.plot(xs, [r["control_bytes_p50"] / 1e3 for r in mine], "o-", label="sent by the controller")
    ax.plot(xs, [r["reply_bytes_p50"] / 1e3 for r in mine], "s-", label="replies")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("rollouts in flight")
    ax.set_ylabel("KB per snapshot (median)")
    ax.set_title("Control-plane KB per snapshot (episode scopes ride on them)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, path, title)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 64, 256, 1024])
    common.add_modes(parser)
    parser.add_argument("--delay", type=float, default=0.02, help="engine seconds per token")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (short: receipts to ACK)")
    parser.add_argument("--tool-delay", type=float, default=0.1, help="seconds every tool call takes")
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--snapshots", type=int, default=4)
    parser.add_argument("--every", type=float, default=1.5)
    common.add_quick(parser, "16 and 256 in flight, embedded only")
    common.add_name(parser, "control_messages")
    args = parser.parse_args()
    if args.quick:
        args.in_flight, args.modes, args.snapshots = [16, 256], ["embedded"], 2
    began = common.machine()
    rows = [asyncio.run(measure(n, mode, args)) for n in args.in_flight for mode in args.modes]
    print(table(rows))
    common.write_record(args.name, "control_messages", began, args, rows)
    plot(rows, common.figure_path(args.name), f"{began['when']}, 2 agents, 2 resources, policy, TQ")


if __name__ == "__main__":
    main()
