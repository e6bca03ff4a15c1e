"""The gateway a black-box agent talks to: an OpenAI-compatible HTTP server in the agent's process.

One server per agent process, on 127.0.0.1 and a port the system picks; every live attempt has a
route of its own, ``/r/<token>/``, where ``token`` is a random secret handed to that attempt's program
only (in ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``), so one rollout's program cannot reach another's.

- ``POST /r/<token>/v1/chat/completions`` (``stream`` true or false): one model call of the rollout,
  through its ``RolloutContext`` exactly as a built-in agent's ``generate``: a boundary first, the call
  staged in TQ, replayed from the saved transcript after a restore (``openai_format.py`` turns the
  request into the prompt);
- ``GET /r/<token>/v1/models``: the one model the run serves;
- ``POST /r/<token>/tools/<name>`` with the arguments as a JSON object: one tool call, exactly once,
  replayed after a restore; the answer is ``{"ok": ..., "output": ...}``; ``GET /r/<token>/tools``: the
  rollout's tools in the OpenAI ``tools`` shape;
- ``POST /r/<token>/mcp``: the same tools as an MCP server over streamable HTTP (``mcp_format.py``),
  each call exactly once like the plain route's (a ``GET`` there is 405: no stream is offered).

A call the rollout cannot take (a divergence from the recorded history, a reserved tool) ends the
attempt: the gateway answers 409 and the program that waits for its exit is told (``Session.failure``).
Requests of one rollout are served one at a time, in the order they come.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import structlog
from aiohttp import web
from parkway.actors.builtin.blackbox import mcp_format, openai_format
from parkway.actors.sdk import chat
from parkway.actors.sdk.rollout import RolloutContext, RolloutFailure, ToolOutcome

log = structlog.get_logger("parkway.gateway")

MODEL_NAME = "parkway-policy"
MAX_BODY_BYTES = 8 << 20


class Session:
    """One attempt's route: its context, the lock that orders its calls, and how it ended if it failed."""

    def __init__(self, ctx: RolloutContext) -> None:
        self.ctx = ctx
        self.lock = asyncio.Lock()
        self.failure: RolloutFailure | None = None
        self.failed = asyncio.Event()
        self.calls = 0

    def fail(self, failure: RolloutFailure) -> None:
        if self.failure is None:
            self.failure = failure
            self.failed.set()


class Gateway:
    """The HTTP server and the routes of the live attempts."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()

    @property
    def started(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        async with self._lock:
            if self._runner is not None:
                return
            app = web.Application(client_max_size=MAX_BODY_BYTES)
            app.add_routes(
                [
                    web.post("/r/{token}/v1/chat/completions", self.chat_completions),
                    web.get("/r/{token}/v1/models", self.models),
                    web.get("/r/{token}/tools", self.list_tools),
                    web.post("/r/{token}/tools/{name}", self.call_tool),
                    web.post("/r/{token}/mcp", self.mcp),
                    web.get("/r/{token}/mcp", self.mcp_stream),
                    web.delete("/r/{token}/mcp", self.mcp_end),
                ]
            )
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            # The port the system picked (port 0): the runner's listening address.
            [address] = [a for a in runner.addresses if isinstance(a, tuple)][:1]
            self.port = int(address[1])
            self._runner = runner
            log.info("gateway_started", port=self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, session: Session) -> str:
        """A route for ``session``; its token."""
        token = secrets.token_urlsafe(18)
        self.sessions[token] = session
        return token

    def close(self, token: str) -> None:
        self.sessions.pop(token, None)

    def base_url(self, token: str) -> str:
        return f"http://{self.host}:{self.port}/r/{token}"

    # -- routes --------------------------------------------------------------------------------
    def _session(self, request: web.Request) -> Session:
        session = self.sessions.get(request.match_info["token"])
        if session is None:
            raise web.HTTPNotFound(
                text=json.dumps(openai_format.error("no live rollout at this address", "not_found_error")),
                content_type="application/json",
            )
        return session

    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"the body is not JSON: {exc}") from None

    async def models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "parkway"}],
            }
        )

    async def list_tools(self, request: web.Request) -> web.Response:
        session = self._session(request)
        return web.json_response(openai_format.openai_tools(list(session.ctx.tools)))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request)
        ctx = session.ctx
        try:
            messages = openai_format.conversation(body, max_turns=ctx.max_turns)
        except openai_format.FormatError as exc:
            raise _bad(str(exc)) from None
        async with session.lock:
            if session.failure is not None:
                raise _ended(session.failure)
            index = ctx.model_calls
            try:
                reply = await ctx.generate(messages)
            except RolloutFailure as failure:
                session.fail(failure)
                raise _ended(failure) from None
            session.calls += 1
        tokenizer = chat.tokenizer_for(ctx.run.task.tokenizer)
        done = openai_format.completion(
            reply.text,
            finish_reason=reply.finish_reason,
            call_id=f"chatcmpl-{ctx.run.rollout_id}-{ctx.run.attempt}-{index}",
            model=str(body.get("model") or MODEL_NAME),
            prompt_tokens=len(tokenizer.encode_chat(messages)),
            completion_tokens=len(reply.token_ids),
        )
        if not body.get("stream"):
            return web.json_response(done)
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await stream.prepare(request)
        for chunk in openai_format.stream_chunks(done):
            await stream.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    async def call_tool(self, request: web.Request) -> web.Response:
        session = self._session(request)
        arguments = await self._body(request)
        if not isinstance(arguments, dict):
            raise _bad("the body must be the tool's arguments, a JSON object")
        try:
            outcome = await self._tool(session, request.match_info["name"], arguments)
        except RolloutFailure as failure:
            raise _ended(failure) from None
        return web.json_response({"ok": outcome.ok, "output": outcome.output})

    async def _tool(self, session: Session, name: str, arguments: dict[str, object]) -> ToolOutcome:
        """One tool call of the rollout, in turn with its other calls; a failure ends the attempt."""
        async with session.lock:
            if session.failure is not None:
                raise session.failure
            try:
                outcome = await session.ctx.call_tool(name, arguments)
            except RolloutFailure as failure:
                session.fail(failure)
                raise
            session.calls += 1
        return outcome

    async def mcp(self, request: web.Request) -> web.Response:
        session = self._session(request)
        ident: str | int | None = None
        try:
            message = mcp_format.parse(await request.read())
            ident = message.id
            if not message.is_request:
                return web.Response(status=202)  # a notification (or a response): taken, nothing to say
            answer = await self._mcp_request(session, message)
        except mcp_format.RpcError as exc:
            return web.json_response(mcp_format.error(ident, exc.code, exc.message))
        return web.json_response(mcp_format.result(ident, answer))

    async def _mcp_request(self, session: Session, message: mcp_format.Message) -> dict[str, object]:
        if message.method == "initialize":
            return mcp_format.initialize(message.params)
        if message.method == "ping":
            return {}
        if message.method == "tools/list":
            return mcp_format.list_tools(list(session.ctx.tools))
        if message.method == "tools/call":
            name, arguments = mcp_format.tool_call(message.params)
            try:
                outcome = await self._tool(session, name, arguments)
            except RolloutFailure as failure:
                raise mcp_format.RpcError(
                    mcp_format.ROLLOUT_ENDED, f"the rollout ended: {failure.code}: {failure.detail}"
                ) from None
            return mcp_format.call_result(outcome.ok, outcome.output)
        raise mcp_format.RpcError(mcp_format.METHOD_NOT_FOUND, f"method not found: {message.method}")

    async def mcp_stream(self, request: web.Request) -> web.Response:
        self._session(request)
        # The gateway never speaks first, so it offers no event stream (the transport allows a 405).
        return web.Response(status=405, headers={"Allow": "POST, DELETE"})

    async def mcp_end(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.Response(status=200)  # nothing is kept per MCP session: the route is the attempt's


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps(openai_format.error(message)), content_type="application/json")


def _ended(failure: RolloutFailure) -> web.HTTPConflict:
    """The attempt ended with ``failure``: this program's rollout is over (it is redone by the run)."""
    return web.HTTPConflict(
        text=json.dumps(
            openai_format.error(f"the rollout ended: {failure.code}: {failure.detail}", "rollout_ended")
        ),
        content_type="application/json",
    )


_shared: dict[asyncio.AbstractEventLoop, Gateway] = {}


async def shared_gateway() -> Gateway:
    """This event loop's gateway (one per agent process), started on first use."""
    loop = asyncio.get_running_loop()
    for other in [other for other in _shared if other.is_closed()]:
        del _shared[other]  # a loop that ended took its server with it
    gateway = _shared.setdefault(loop, Gateway())
    await gateway.start()
    return gateway
