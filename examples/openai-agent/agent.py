"""An agent that knows nothing of parkway: the OpenAI SDK for the model, plain HTTP for the tools.

parkway runs it once per attempt (``agent: command``) with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
pointing at its gateway, and the task in ``PARKWAY_PROMPT``, ``PARKWAY_TOOLS`` and ``PARKWAY_MAX_TURNS``
(docs/blackbox.md). The loop: ask the model; run the tool calls in its reply; repeat until it answers or
the turns run out. Exit 0: parkway scores the session with the environment's verify.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from openai import OpenAI


def call_tool(name: str, arguments: dict) -> dict:
    request = urllib.request.Request(
        f"{os.environ['PARKWAY_TOOLS_URL']}/{name}",
        data=json.dumps(arguments).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def main() -> int:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    prompt = os.environ["PARKWAY_PROMPT"]
    tools = json.loads(os.environ.get("PARKWAY_TOOLS", "[]"))
    stream = os.environ.get("AGENT_STREAM") == "1"  # the SDK's streaming path, for the tests
    messages: list[dict] = [
        {"role": "system", "content": f"task: {prompt}"},
        {"role": "user", "content": prompt},
    ]
    for _ in range(int(os.environ.get("PARKWAY_MAX_TURNS", "5"))):
        if stream:
            content, calls = "", {}
            for chunk in client.chat.completions.create(
                model="policy", messages=messages, tools=tools, stream=True
            ):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or ():
                    calls[call.index] = {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
            tool_calls = [calls[i] for i in sorted(calls)]
        else:
            message = (
                client.chat.completions.create(model="policy", messages=messages, tools=tools)
                .choices[0]
                .message
            )
            content = message.content or ""
            tool_calls = [call.model_dump() for call in message.tool_calls or ()]
        messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls or None})
        if not tool_calls:
            break
        for call in tool_calls:
            result = call_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
