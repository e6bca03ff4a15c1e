"""The Model Context Protocol's tool methods over streamable HTTP, as the gateway serves them. No I/O.

A black-box program reaches its rollout's tools as an MCP server at ``$PARKWAY_MCP_URL``: JSON-RPC 2.0
messages POSTed one at a time, each request answered with one JSON response (the streamable-HTTP
transport lets a server answer with JSON instead of an event stream; the gateway never needs to send
anything unasked). What is served:

- ``initialize`` (the handshake of the 2024-11-05 to 2025-11-25 revisions): the client's revision when
  it is one of ``PROTOCOL_VERSIONS``, else the newest of them; the one capability, ``tools``;
- ``ping``; ``tools/list``: the rollout's tools with their JSON schemas; ``tools/call``: one tool call,
  exactly once per call index like every other way in (``gateway.py``), its output as
  ``structuredContent`` and as JSON text, ``isError`` when the tool refused;
- notifications (``notifications/initialized``, cancellations) are taken and ignored.

Everything else is a JSON-RPC error: an unknown method ``-32601`` (so a client that first probes a
newer revision's ``server/discover`` falls back to ``initialize``), a message that is not JSON-RPC
``-32600``, bad parameters ``-32602``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from parkway.actors.builtin.blackbox import openai_format
from parkway.actors.sdk import chat

PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
SERVER_INFO = {"name": "parkway-gateway", "version": "1"}

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
ROLLOUT_ENDED = -32000  # server-defined: this attempt is over (a divergence, a reserved tool)


class RpcError(Exception):
    """A JSON-RPC error answer: ``code`` and ``message`` go back to the client as they are."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Message:
    """One JSON-RPC message from the client: a request (``id`` set) or a notification."""

    method: str
    params: dict[str, Any]
    id: str | int | None
    is_request: bool


def parse(body: bytes) -> Message:
    """The message in a POST body, or ``RpcError`` saying what is wrong with it."""
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RpcError(PARSE_ERROR, f"the body is not JSON: {exc}") from None
    if isinstance(raw, list):
        raise RpcError(INVALID_REQUEST, "send one JSON-RPC message per request (batches are not served)")
    if not isinstance(raw, dict) or raw.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, 'want a JSON-RPC 2.0 object ({"jsonrpc": "2.0", ...})')
    if "method" not in raw:
        # A response or an error from the client: the gateway never asks it anything.
        return Message(method="", params={}, id=None, is_request=False)
    method, params = raw["method"], raw.get("params", {})
    if not isinstance(method, str):
        raise RpcError(INVALID_REQUEST, "method: must be a string")
    if not isinstance(params, dict):
        raise RpcError(INVALID_REQUEST, "params: must be an object")
    ident = raw.get("id")
    if "id" in raw and not (
        isinstance(ident, str) or (isinstance(ident, int) and not isinstance(ident, bool))
    ):
        raise RpcError(INVALID_REQUEST, "id: must be a string or an integer")
    return Message(method=method, params=params, id=ident, is_request="id" in raw)


def result(ident: str | int | None, value: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "result": value}


def error(ident: str | int | None, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message}}


def initialize(params: dict[str, Any]) -> dict[str, Any]:
    requested = params.get("protocolVersion")
    version = requested if requested in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]
    return {
        "protocolVersion": version,
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": SERVER_INFO,
    }


def list_tools(specs: list[chat.ToolSpec]) -> dict[str, Any]:
    return {
        "tools": [
            {"name": tool["function"]["name"], "inputSchema": tool["function"]["parameters"]}
            for tool in openai_format.openai_tools(specs)
        ]
    }


def tool_call(params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``tools/call``'s tool name and arguments."""
    name, arguments = params.get("name"), params.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise RpcError(INVALID_PARAMS, "tools/call: name must be a tool's name")
    if not isinstance(arguments, dict):
        raise RpcError(INVALID_PARAMS, "tools/call: arguments must be an object")
    return name, arguments


def call_result(ok: bool, output: dict[str, object]) -> dict[str, Any]:
    return {
        "content": [{"type": "text", "text": json.dumps(output, sort_keys=True)}],
        "structuredContent": output,
        "isError": not ok,
    }
