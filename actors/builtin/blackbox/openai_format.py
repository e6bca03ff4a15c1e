"""The OpenAI chat-completions format, translated to parkway's conversation and back. No I/O.

A request's ``messages`` (system, user, assistant with ``tool_calls``, tool) become ``chat.Message``s;
its ``tools`` (JSON-schema functions) become the ``tools:`` line of the system block the model reads,
with the rollout's turn budget. A reply's text becomes an assistant message: the text outside the
``<tool>`` blocks as ``content``, each block as a ``tool_calls`` item. The translation is a pure function
of the request, so a program that sends the same request after a restart gets the same prompt tokens
(and so the recorded reply: ``program.py``), and one that sends another gets a divergence.

What is refused (``FormatError``, an HTTP 400 with the OpenAI error shape): a body that is not an
object, ``messages`` that are not a list of role/content objects, an unknown role, ``n`` other than 1.
Sampling settings (``temperature``, ``seed``...) are the run's, not the caller's: they are ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any

from parkway.actors.sdk import chat

_TOOL_BLOCK = re.compile(r"<tool>.*?</tool>", re.DOTALL)
ROLES = ("system", "user", "assistant", "tool")


class FormatError(ValueError):
    """A request the gateway cannot take: the message says which field and why."""


def tool_specs(tools: Any) -> list[chat.ToolSpec]:
    """``tools`` of a request (``[{"type": "function", "function": {"name", "parameters"}}]``) as specs."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise FormatError("tools: must be a list")
    specs = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FormatError(f"tools[{index}]: want {{'type': 'function', 'function': {{'name': ...}}}}")
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties", {}) if isinstance(parameters, dict) else {}
        if not isinstance(properties, dict):
            raise FormatError(f"tools[{index}].function.parameters.properties: must be an object")
        specs.append(
            chat.ToolSpec(
                function["name"], tuple((name, _arg_type(schema)) for name, schema in properties.items())
            )
        )
    return specs


def _arg_type(schema: Any) -> str:
    """A JSON-schema property as the type the model's tools line names."""
    if not isinstance(schema, dict):
        return "word"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "choice:" + "|".join(str(v) for v in schema["enum"])
    return {"integer": "int", "number": "int"}.get(str(schema.get("type")), "word")


def openai_tools(specs: list[chat.ToolSpec]) -> list[dict[str, Any]]:
    """Tool specs as a request's ``tools`` (what a black-box program is handed to pass on)."""

    def schema(kind: str) -> dict[str, Any]:
        if kind == "int":
            return {"type": "integer"}
        if kind.startswith("choice:"):
            return {"type": "string", "enum": [o for o in kind[len("choice:") :].split("|") if o]}
        return {"type": "string"}

    return [
        {
            "type": "function",
            "function": {
                "name": spec.name,
                "parameters": {
                    "type": "object",
                    "properties": {name: schema(kind) for name, kind in spec.args},
                    "required": [name for name, _ in spec.args],
                },
            },
        }
        for spec in specs
    ]


def conversation(body: Any, *, max_turns: int) -> list[chat.Message]:
    """The parkway conversation of a chat-completions request body."""
    if not isinstance(body, dict):
        raise FormatError("the body must be a JSON object")
    if body.get("n", 1) != 1:
        raise FormatError("n: only 1 is served")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise FormatError("messages: must be a non-empty list")
    specs = tool_specs(body.get("tools"))
    messages: list[chat.Message] = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or item.get("role") not in ROLES:
            raise FormatError(f"messages[{index}]: want an object with a role of {', '.join(ROLES)}")
        content = _text(item.get("content"), index)
        if item["role"] == "assistant":
            content += "".join(_tool_block(call, index) for call in item.get("tool_calls") or ())
        messages.append(chat.Message(item["role"], content))
    if specs:
        # The tools and the turn budget go in the system block, where the model reads them.
        block = f"tools: {'; '.join(s.signature() for s in specs)}\nturns: {max_turns}"
        if messages[0].role == "system":
            messages[0] = chat.Message("system", f"{messages[0].content}\n{block}")
        else:
            messages.insert(0, chat.Message("system", block))
    return messages


def _text(content: Any, index: int) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise FormatError(f"messages[{index}].content: want a string or a list of text parts")


def _tool_block(call: Any, index: int) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise FormatError(f"messages[{index}].tool_calls: want {{'function': {{'name', 'arguments'}}}}")
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as exc:
        raise FormatError(f"messages[{index}].tool_calls: arguments are not JSON: {exc}") from None
    return f"<tool>{json.dumps({'name': function['name'], 'arguments': arguments})}</tool>"


def completion(
    text: str, *, finish_reason: str, call_id: str, model: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A ``chat.completion`` object for a reply's text."""
    parsed = chat.parse_reply(text)
    message: dict[str, Any] = {"role": "assistant", "content": _TOOL_BLOCK.sub("", text).strip() or None}
    reason = {"stop": "stop", "length": "length"}.get(finish_reason, "stop")
    if parsed.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"{call_id}-{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for i, call in enumerate(parsed.tool_calls)
        ]
        reason = "tool_calls"
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": 0,  # a replayed reply is the recorded one: no wall-clock in it
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_chunks(done: dict[str, Any]) -> list[dict[str, Any]]:
    """A completion as ``chat.completion.chunk`` events (``stream: true``): the role and content, each
    tool call, then the finish reason; the caller writes each as a server-sent event, then ``[DONE]``."""
    [choice] = done["choices"]
    message = choice["message"]
    base = {"id": done["id"], "object": "chat.completion.chunk", "created": 0, "model": done["model"]}
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}]
    for i, call in enumerate(message.get("tool_calls") or ()):
        chunks.append(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": i, **call}]}, "finish_reason": None}
                ],
            }
        )
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})
    return chunks


def error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """The OpenAI error shape (the SDKs raise it as ``BadRequestError`` and the like)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
