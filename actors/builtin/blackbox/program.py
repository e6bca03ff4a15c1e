"""The black-box agent: any executable, run once per attempt, talking to parkway only over HTTP.

``agent: command`` with ``command.argv`` (docs/blackbox.md). Per attempt the program is started with
``argv`` in a session of its own and this environment (besides the agent's own, less its ``PARKWAY_*``
variables: its keys and broker credentials are not the program's; and ``command.env``):

- ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``: the gateway's route of this attempt (``gateway.py``); any
  OpenAI client works unchanged;
- ``PARKWAY_TOOLS_URL``: ``POST $PARKWAY_TOOLS_URL/<tool>`` with the arguments as JSON calls a tool;
- ``PARKWAY_MCP_URL``: the same tools as an MCP server (streamable HTTP);
- ``PARKWAY_PROMPT``, ``PARKWAY_TOOLS`` (the tools as the OpenAI ``tools`` list, JSON),
  ``PARKWAY_MAX_TURNS``, ``PARKWAY_ROLLOUT_ID``, ``PARKWAY_ATTEMPT``.

Its exit status 0 ends the attempt with ``verify`` (the session scores what the tools recorded);
another ends it as ``agent_exit`` (its stderr's last lines in the detail); running past
``command.timeout_s``, as ``agent_timeout``. A retired or stopped attempt kills the program's whole
process group. Recovery comes from the gateway being the boundary: after a restore the program starts
again from the beginning, and its calls are answered from the saved transcript until it runs out
(nothing generated or applied again), then live; a call other than the recorded one ends the attempt
as ``replay_diverged`` and the rollout is redone from its prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Mapping
from typing import ClassVar

from parkway.actors.builtin.blackbox import openai_format
from parkway.actors.builtin.blackbox.gateway import Session, shared_gateway
from parkway.actors.sdk.rollout import AgentProgram, RolloutContext, RolloutFailure

PARKWAY_PREFIX = "PARKWAY_"
STDERR_TAIL = 2000  # bytes of a failed program's stderr kept in its failure's detail


class CommandAgent(AgentProgram):
    """Runs ``argv`` per attempt (``command_agent`` binds it from the configuration)."""

    name = "command"
    argv: ClassVar[tuple[str, ...]] = ()
    timeout_s: ClassVar[float] = 3600.0
    env: ClassVar[Mapping[str, str]] = {}

    async def run(self, ctx: RolloutContext) -> float:
        if not self.argv:
            raise RolloutFailure("agent_misconfigured", "agent command has no command.argv to run")
        gateway = await shared_gateway()
        session = Session(ctx)
        token = gateway.open(session)
        base = gateway.base_url(token)
        environment = {
            **program_environment(os.environ),
            **self.env,
            "OPENAI_BASE_URL": f"{base}/v1",
            "OPENAI_API_KEY": token,
            "PARKWAY_TOOLS_URL": f"{base}/tools",
            "PARKWAY_MCP_URL": f"{base}/mcp",
            "PARKWAY_PROMPT": ctx.prompt,
            "PARKWAY_TOOLS": json.dumps(openai_format.openai_tools(list(ctx.tools))),
            "PARKWAY_MAX_TURNS": str(ctx.max_turns),
            "PARKWAY_ROLLOUT_ID": ctx.run.rollout_id,
            "PARKWAY_ATTEMPT": str(ctx.run.attempt),
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv,
                env=environment,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group: killed whole
            )
        except OSError as exc:
            gateway.close(token)
            raise RolloutFailure("agent_exit", f"{self.argv[0]}: {exc}") from None
        try:
            stderr = asyncio.ensure_future(process.stderr.read() if process.stderr else _empty())
            exited = asyncio.ensure_future(process.wait())
            failed = asyncio.ensure_future(session.failed.wait())
            done, _ = await asyncio.wait(
                {exited, failed}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            failed.cancel()
            if session.failure is not None:
                raise session.failure
            if not done:
                raise RolloutFailure("agent_timeout", f"{self.argv[0]} ran past {self.timeout_s} s")
            if process.returncode != 0:
                tail = (await stderr).decode(errors="replace")[-STDERR_TAIL:]
                raise RolloutFailure("agent_exit", f"{self.argv[0]} exited {process.returncode}: {tail}")
            return await ctx.verify()
        finally:
            gateway.close(token)
            _kill_group(process)
            stderr.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.wait(), 10)


def program_environment(inherited: Mapping[str, str]) -> dict[str, str]:
    """What the program inherits of the agent's environment: everything but ``PARKWAY_*`` (the agent's
    signing keys, its broker address and credentials are not the program's to use)."""
    return {k: v for k, v in inherited.items() if not k.startswith(PARKWAY_PREFIX)}


async def _empty() -> bytes:
    return b""


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """The program and everything it started (its session's group), if still running."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def command_agent(
    argv: tuple[str, ...], *, timeout_s: float = 3600.0, env: Mapping[str, str] | None = None
) -> type[CommandAgent]:
    """A ``CommandAgent`` bound to a command (what ``agent: command`` runs)."""
    return type(
        "ConfiguredCommandAgent",
        (CommandAgent,),
        {"argv": tuple(argv), "timeout_s": timeout_s, "env": dict(env or {}), "__module__": __name__},
    )
