"""The gateway's MCP server (``actors/builtin/blackbox/mcp_format.py``): the ``mcp`` package's own
client lists and calls a rollout's tools over streamable HTTP, each call through the rollout's context
exactly once and in order; malformed messages, unknown methods and calls after the attempt ended get
JSON-RPC errors, never a tool call."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from parkway.actors.builtin.blackbox import mcp_format
from parkway.actors.builtin.blackbox.gateway import Gateway, Session
from parkway.actors.sdk import chat
from parkway.actors.sdk.rollout import RolloutContext, ToolOutcome
from parkway.protocol.messages import Run

TOOLS = (chat.ToolSpec("transfer", (("src", "choice:a|b"), ("amount", "int"))), chat.ToolSpec("balance"))


class Tools:
    """A rollout's tool server as the context sees it: every call, by index."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, dict[str, object]]] = []

    async def call(self, index: int, name: str, arguments: dict[str, object]) -> ToolOutcome:
        self.calls.append((index, name, arguments))
        if name == "transfer" and arguments.get("amount", 0) > 100:  # type: ignore[operator]
            return ToolOutcome(False, {"error": "insufficient funds"})
        return ToolOutcome(True, {"index": index, "name": name})


async def _never(*_: object) -> object:
    raise AssertionError("no model call in these cases")


async def _boundary() -> None:
    return None


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Tools, Session]]:
    tools = Tools()
    ctx = RolloutContext(
        run=Run(rollout_id="g0-r0", attempt=0, group_id="g0", env="bank", prompt="p"),
        tools=TOOLS,
        _generate=_never,  # type: ignore[arg-type]
        _call_tool=tools.call,
        _boundary=_boundary,
    )
    gateway = Gateway()
    await gateway.start()
    session = Session(ctx)
    token = gateway.open(session)
    try:
        yield f"{gateway.base_url(token)}/mcp", tools, session
    finally:
        await gateway.stop()


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_mcp_client_lists_and_calls_the_rollouts_tools(served, mode: str) -> None:
    mcp = pytest.importorskip("mcp")
    url, tools, _ = served
    async with mcp.Client(url, mode=mode) as client:
        listed = await client.list_tools()
        assert [tool.name for tool in listed.tools] == ["transfer", "balance"]
        assert listed.tools[0].input_schema["properties"] == {
            "src": {"type": "string", "enum": ["a", "b"]},
            "amount": {"type": "integer"},
        }
        done = await client.call_tool("transfer", {"src": "a", "amount": 5})
        refused = await client.call_tool("transfer", {"src": "b", "amount": 500})
        again = await client.call_tool("balance", {})
    assert (done.is_error, done.structured_content) == (False, {"index": 0, "name": "transfer"})
    assert (refused.is_error, refused.structured_content) == (True, {"error": "insufficient funds"})
    assert again.structured_content == {"index": 2, "name": "balance"}
    assert [index for index, _, _ in tools.calls] == [0, 1, 2]  # one call each, in order


async def post(url: str, body: bytes) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http, http.post(url, data=body) as response:
        text = await response.text()
        return response.status, (await response.json(content_type=None)) if text else None


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", mcp_format.PARSE_ERROR),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', mcp_format.INVALID_REQUEST),
        (b'{"id": 1, "method": "ping"}', mcp_format.INVALID_REQUEST),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": [1]}', mcp_format.INVALID_REQUEST),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "server/discover"}', mcp_format.METHOD_NOT_FOUND),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {}}', mcp_format.INVALID_PARAMS),
        (
            b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x", "arguments": 3}}',
            mcp_format.INVALID_PARAMS,
        ),
    ],
)
async def test_bad_messages_get_json_rpc_errors_and_call_nothing(served, body: bytes, code: int) -> None:
    url, tools, session = served
    status, answer = await post(url, body)
    assert status == 200 and answer["error"]["code"] == code  # type: ignore[index]
    assert tools.calls == [] and session.failure is None


async def test_notifications_are_taken_and_a_stream_is_not_offered(served) -> None:
    url, tools, _ = served
    assert await post(url, b'{"jsonrpc": "2.0", "method": "notifications/initialized"}') == (202, None)
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as response:
            assert response.status == 405
        async with http.post(url.replace("/r/", "/r/x"), data=b"{}") as response:
            assert response.status == 404  # another rollout's route is not guessable
    assert tools.calls == []


async def test_a_reserved_tool_ends_the_attempt_and_every_later_call(served) -> None:
    url, tools, session = served
    call = b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "%s", "arguments": {}}}'
    status, answer = await post(url, call % b"verify")
    assert status == 200
    assert (
        answer["error"]["code"] == mcp_format.ROLLOUT_ENDED and "reserved_tool" in answer["error"]["message"]
    )  # type: ignore[index]
    assert session.failure is not None and session.failure.code == "reserved_tool"
    _, later = await post(url, call % b"balance")
    assert later["error"]["code"] == mcp_format.ROLLOUT_ENDED  # type: ignore[index]
    assert tools.calls == []
