"""An agent that knows nothing of parkway: the OpenAI SDK for the model, HTTP or MCP for the tools.

parkway runs it once per attempt (``agent: command``) with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
pointing at its gateway, the tools at ``PARKWAY_TOOLS_URL`` (plain HTTP) and ``PARKWAY_MCP_URL`` (an MCP
server), and the task in ``PARKWAY_PROMPT``, ``PARKWAY_TOOLS`` and ``PARKWAY_MAX_TURNS``
(docs/blackbox.md). The loop: ask the model; run the tool calls in its reply; repeat until it answers or
the turns run out. Exit 0: parkway scores the session with the environment's verify.

``AGENT_TOOLS=mcp`` calls the tools through the ``mcp`` package's client instead of plain HTTP;
``AGENT_STREAM=1`` asks the model with ``stream=True``. Either way the conversation is the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from openai import AsyncOpenAI

ToolCaller = Callable[[str, dict], Awaitable[dict]]


def call_over_http(name: str, arguments: dict) -> dict:
    request = urllib.request.Request(
        f"{os.environ['PARKWAY_TOOLS_URL']}/{name}",
        data=json.dumps(arguments).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


@asynccontextmanager
async def tools() -> AsyncIterator[ToolCaller]:
    if os.environ.get("AGENT_TOOLS") != "mcp":

        async def call(name: str, arguments: dict) -> dict:
            return await asyncio.to_thread(call_over_http, name, arguments)

        yield call
        return
    from mcp import Client

    async with Client(os.environ["PARKWAY_MCP_URL"]) as session:

        async def call(name: str, arguments: dict) -> dict:
            result = await session.call_tool(name, arguments)
            return {"ok": not result.is_error, "output": result.structured_content}

        yield call


async def ask(client: AsyncOpenAI, messages: list[dict], specs: list[dict]) -> tuple[str, list[dict]]:
    """One model call: the reply's text and its tool calls."""
    if os.environ.get("AGENT_STREAM") != "1":
        response = await client.chat.completions.create(model="policy", messages=messages, tools=specs)
        message = response.choices[0].message
        return message.content or "", [call.model_dump() for call in message.tool_calls or ()]
    content, calls = "", {}
    async for chunk in await client.chat.completions.create(
        model="policy", messages=messages, tools=specs, stream=True
    ):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            calls[call.index] = {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
    return content, [calls[i] for i in sorted(calls)]


async def main() -> int:
    client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    prompt = os.environ["PARKWAY_PROMPT"]
    specs = json.loads(os.environ.get("PARKWAY_TOOLS", "[]"))
    messages: list[dict] = [
        {"role": "system", "content": f"task: {prompt}"},
        {"role": "user", "content": prompt},
    ]
    async with tools() as call_tool:
        for _ in range(int(os.environ.get("PARKWAY_MAX_TURNS", "5"))):
            content, tool_calls = await ask(client, messages, specs)
            messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls or None})
            if not tool_calls:
                break
            for call in tool_calls:
                result = await call_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
