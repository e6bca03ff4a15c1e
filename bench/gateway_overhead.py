"""What the black-box gateway adds to a model call: the same call made directly on a rollout's context
(what a built-in agent does) against through the gateway's HTTP server, with the ``openai`` SDK and
with a bare HTTP client.

    python bench/gateway_overhead.py [--calls 500] [--rounds 3] [--quick]

The context's model call answers at once (a reply of a fixed ~100 tokens, no policy, no broker): what is
left is the gateway's own cost per call (HTTP, JSON, the request's translation to a prompt, the reply's
to a completion), on this process's event loop. Each round runs every variant ``--calls`` times, the
variants in an order rotated from round to round; reported: the median microseconds per call of each
variant over the rounds, and the overhead against the direct call. Writes
``bench/results/NAME.json``. Not a test: nothing asserts on time.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package

import asyncio
import os
import statistics
import time
from typing import Any

import aiohttp
import common
from parkway.actors.builtin.blackbox.gateway import Gateway, Session
from parkway.actors.sdk import chat
from parkway.actors.sdk.rollout import RolloutContext, ToolOutcome
from parkway.protocol.messages import Generate, Generated, Run

TOOLS = (chat.ToolSpec("increment", (("by", "int"),)),)
REPLY = (
    *tuple(chat.encode('let me think about it <tool>{"name": "increment", "arguments": {"by": 2}}</tool>')),
    chat.EOS,
)
MESSAGES = [{"role": "system", "content": "task: count"}, {"role": "user", "content": "Count to 12."}]
BODY = {
    "model": "m",
    "messages": MESSAGES,
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "increment",
                "parameters": {"type": "object", "properties": {"by": {"type": "integer"}}},
            },
        }
    ],
}


def context() -> RolloutContext:
    run = Run(
        rollout_id="t0000_g0", attempt=0, group_id="t0000", env="counter", prompt="Count to 12.", max_turns=8
    )

    async def generate(index: int, tokens: tuple[int, ...]) -> Generated:
        Generate(rollout_id=run.rollout_id, attempt=0, call_index=index, token_ids=tokens)  # built, as sent
        return Generated(
            rollout_id=run.rollout_id,
            attempt=0,
            call_index=index,
            token_ids=REPLY,
            logprobs=(-0.1,) * len(REPLY),
            finish_reason="stop",
        )

    async def call_tool(index: int, name: str, arguments: dict[str, object]) -> ToolOutcome:
        return ToolOutcome(True, {})

    async def boundary() -> None:
        return None

    return RolloutContext(run=run, tools=TOOLS, _generate=generate, _call_tool=call_tool, _boundary=boundary)


async def direct(calls: int) -> float:
    ctx = context()
    messages = [
        chat.Message("system", "task: count\ntools: increment(by:int)\nturns: 8"),
        chat.Message("user", "Count to 12."),
    ]
    began = time.perf_counter()
    for _ in range(calls):
        await ctx.generate(messages)
    return (time.perf_counter() - began) / calls


async def through_http(gateway: Gateway, calls: int) -> float:
    token = gateway.open(Session(context()))
    url = f"{gateway.base_url(token)}/v1/chat/completions"
    async with aiohttp.ClientSession() as client:
        began = time.perf_counter()
        for _ in range(calls):
            async with client.post(url, json=BODY) as response:
                await response.json()
        spent = time.perf_counter() - began
    gateway.close(token)
    return spent / calls


async def through_sdk(gateway: Gateway, calls: int) -> float:
    from openai import AsyncOpenAI

    token = gateway.open(Session(context()))
    client = AsyncOpenAI(base_url=f"{gateway.base_url(token)}/v1", api_key=token)
    began = time.perf_counter()
    for _ in range(calls):
        await client.chat.completions.create(model="m", messages=MESSAGES, tools=BODY["tools"])  # type: ignore[arg-type]
    spent = time.perf_counter() - began
    await client.close()
    gateway.close(token)
    return spent / calls


async def measure(args: Any) -> dict[str, list[float]]:
    gateway = Gateway()
    await gateway.start()
    variants = {
        "direct": lambda: direct(args.calls),
        "gateway, aiohttp client": lambda: through_http(gateway, args.calls),
        "gateway, openai SDK": lambda: through_sdk(gateway, args.calls),
    }
    names = list(variants)
    found: dict[str, list[float]] = {name: [] for name in names}
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                found[name].append(await variants[name]())
                print(
                    f"  round {round_index}: {name}: {found[name][-1] * 1e6:.0f} us a call", file=_sys.stderr
                )
    finally:
        await gateway.stop()
    return found


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    common.add_quick(parser, "100 calls, 3 rounds")
    common.add_name(parser, "gateway_overhead")
    args = parser.parse_args()
    if args.quick:
        args.calls = 100
    began = common.machine()
    found = asyncio.run(measure(args))
    medians = {name: statistics.median(values) * 1e6 for name, values in found.items()}
    rows = [
        [name, f"{value:.0f}", f"{value - medians['direct']:.0f}", f"{value / medians['direct']:.1f}"]
        for name, value in medians.items()
    ]
    print(common.markdown_table(["variant", "us a call (median)", "over direct", "ratio"], rows))
    print(f"load average (1 min) {os.getloadavg()[0]:.2f}")
    common.write_record(
        args.name, "gateway_overhead", began, args, {"medians_us": medians, "rounds_s": found}
    )


if __name__ == "__main__":
    main()
