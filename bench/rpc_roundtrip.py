"""Request/reply round trip over RabbitMQ on this machine: p50 / p95 / p99 / max.

Three layers, each measured the same way (sequential requests after a warm-up):

- ``broker``: the transport alone (aio-pika publish with confirms + direct reply-to), echo in-process;
- ``actor``: a signed ``Probe`` to a real actor process (``parkway actor tq``): signature, decode,
  reply cache, journal fsync, signed reply;
- ``actor-query``: a ``Status`` to the same process (no journal: queries are not cached).

    python bench/rpc_roundtrip.py [--n 2000] [--url amqp://guest:guest@127.0.0.1:5672/]

Prints a table and writes ``bench/results/rpc_roundtrip.json``. Not a test: no assertions on time.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import common
from parkway.actors.launch import processes as launch
from parkway.actors.runtime.client import Client
from parkway.brokers.base import REQUEST_ID_HEADER, Delivery, Envelope
from parkway.brokers.rabbitmq import RabbitBroker
from parkway.brokers.rabbitmq_layout import run_exchanges, run_queues
from parkway.protocol.messages import Probe, Status

SECRET = "bench-secret"


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    q = statistics.quantiles(ms, n=100)
    return {
        "n": len(ms),
        "p50_ms": round(q[49], 3),
        "p95_ms": round(q[94], 3),
        "p99_ms": round(q[98], 3),
        "max_ms": round(ms[-1], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def timed(n: int, warmup: int, call) -> list[float]:
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples


async def bench_broker(url: str, n: int) -> dict[str, float]:
    run = f"bench{uuid.uuid4().hex[:6]}"
    async with RabbitBroker(url, run) as server, RabbitBroker(url, run) as client:
        await server.declare("echo/0")

        async def echo(d: Delivery) -> None:
            reply = Envelope(
                d.envelope.body,
                d.envelope.content_type,
                d.envelope.correlation_id,
                {REQUEST_ID_HEADER: d.envelope.headers[REQUEST_ID_HEADER]},
                persistent=False,
            )
            await server.reply(d.envelope.reply_to or "", reply)
            await d.ack()

        await server.consume("echo/0", echo)
        body = Envelope(b"x" * 100, "application/octet-stream", "bench")
        samples = await timed(n, 200, lambda: client.request("echo/0", body, deadline=time.time() + 10))
        await _delete(url, run, ["echo/0"])
    return summary(samples)


async def bench_actor(url: str, n: int) -> dict[str, dict[str, float]]:
    run = f"bench{uuid.uuid4().hex[:6]}"
    state = tempfile.mkdtemp(prefix="parkway-bench-")
    env = launch.run_environment(run=run, secret=SECRET, state=Path(state))
    actor = launch.start_actor("tq", 0, env=env, broker_url=url, log_level="warning")
    try:
        async with RabbitBroker(url, run) as broker:
            client = Client(broker, secret=SECRET.encode(), sender="bench/0")
            await launch.wait_ready(client, actor, timeout=30)
            counter = iter(range(10**9))

            async def probe() -> None:
                await client.call(
                    "tq/0", Probe(checkpoint_id=f"b-{next(counter)}", deadline=time.time() + 10)
                )

            async def status() -> None:
                await client.call(
                    "tq/0", Status(checkpoint_id=f"s-{next(counter)}", deadline=time.time() + 10)
                )

            result = {
                "actor": summary(await timed(n, 200, probe)),
                "actor-query": summary(await timed(n, 200, status)),
            }
    finally:
        actor.stop(grace=30)
        await _delete(url, run, ["tq/0"])
    return result


async def _delete(url: str, run: str, addresses: list[str]) -> None:
    import aio_pika

    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        for name in run_queues(run, addresses):
            await channel.queue_delete(name)
        for name in run_exchanges(run):
            await channel.exchange_delete(name)


async def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--n", type=int, default=2000, help="timed requests per layer")
    parser.add_argument(
        "--url", default=os.environ.get("PARKWAY_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    args = parser.parse_args()
    results = {"broker": await bench_broker(args.url, args.n), **(await bench_actor(args.url, args.n))}
    columns = ("n", "p50_ms", "p95_ms", "p99_ms", "max_ms")
    print(
        common.markdown_table(
            ["layer", "n", "p50 ms", "p95 ms", "p99 ms", "max ms"],
            [[layer, *(s[c] for c in columns)] for layer, s in results.items()],
        )
    )
    record = {
        "bench": "rpc_roundtrip",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
    }
    common.write_json("rpc_roundtrip", record)


if __name__ == "__main__":
    asyncio.run(main())
