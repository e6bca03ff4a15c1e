"""The agents parkway ships: a generic tool-using agent and a minimal counter agent."""

from __future__ import annotations

import json

from parkway.actors.sdk import chat
from parkway.actors.sdk.rollout import AgentProgram, RolloutContext, RolloutFailure


class ToolAgent(AgentProgram):
    """Ask the model; run the tool calls in its reply; repeat until it answers or turns run out."""

    name = "tool"

    async def run(self, ctx: RolloutContext) -> float:
        messages = [
            chat.Message("system", chat.system_prompt(ctx.prompt, list(ctx.tools), ctx.max_turns)),
            chat.Message("user", ctx.prompt),
        ]
        for _ in range(ctx.max_turns):
            reply = await ctx.generate(messages)
            messages.append(chat.Message("assistant", reply.text))
            parsed = chat.parse_reply(reply.text)
            if parsed.garbage is not None:
                raise RolloutFailure("garbage", parsed.garbage)
            if parsed.answer is not None:
                break
            for call in parsed.tool_calls:
                outcome = await ctx.call_tool(call.name, call.arguments)
                messages.append(
                    chat.Message("tool", json.dumps({"ok": outcome.ok, "output": outcome.output}))
                )
            await ctx.end_tool_round()
        return await ctx.verify()


class CounterAgent(AgentProgram):
    """The smallest useful agent: one model call and one ``increment`` per turn, then ``get``."""

    name = "counter"

    async def run(self, ctx: RolloutContext) -> float:
        messages = [chat.Message("system", chat.system_prompt(ctx.prompt, list(ctx.tools), ctx.max_turns))]
        for turn in range(ctx.max_turns):
            reply = await ctx.generate(messages)
            messages.append(chat.Message("assistant", reply.text))
            by = len(reply.token_ids) % 5 + 1
            outcome = await ctx.call_tool("increment", {"by": by})
            messages.append(chat.Message("tool", json.dumps(outcome.output)))
            if not outcome.ok:
                raise RolloutFailure("tool_error", f"turn {turn}: {outcome.output}")
            await ctx.end_tool_round()
        await ctx.call_tool("get", {})
        return await ctx.verify()


PROGRAMS: dict[str, type[AgentProgram]] = {p.name: p for p in (ToolAgent, CounterAgent)}
