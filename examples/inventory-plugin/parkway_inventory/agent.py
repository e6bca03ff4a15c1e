"""``stocker``: the agent program that works the inventory, several turns of mutations, then verify.

Like parkway's ``counter`` agent it is deterministic given the model's reply: which item, how many and
whether to restock or sell come from the reply's token count, so the tiny deterministic engine's text
(noise) still drives a reproducible ledger, and a restored rollout makes the same calls as an uncrashed one.
"""

from __future__ import annotations

import json

from parkway.actors.sdk import AgentProgram, Message, RolloutContext, RolloutFailure, system_prompt

from parkway_inventory.environment import ITEMS


class Stocker(AgentProgram):
    """Each turn: one model call, then a restock (even turns) or a sale (odd turns); at the end it
    counts every shelf and asks for the verdict. A refused sale (too little on the shelf) is the
    model's mistake and is not in the record; any other refusal fails the rollout."""

    name = "stocker"

    async def run(self, ctx: RolloutContext) -> float:
        messages = [Message("system", system_prompt(ctx.prompt, list(ctx.tools), ctx.max_turns))]
        for turn in range(ctx.max_turns):
            reply = await ctx.generate(messages)
            messages.append(Message("assistant", reply.text))
            size = len(reply.token_ids)
            tool = "restock" if turn % 2 == 0 else "sell"
            arguments: dict[str, object] = {"item": ITEMS[size % len(ITEMS)], "qty": size % 7 + 1}
            outcome = await ctx.call_tool(tool, arguments)
            messages.append(Message("tool", json.dumps({"ok": outcome.ok, "output": outcome.output})))
            if not outcome.ok and tool != "sell":
                raise RolloutFailure("tool_error", f"turn {turn}: {outcome.output}")
            await ctx.end_tool_round()
        for item in ITEMS:
            await ctx.call_tool("stock", {"item": item})
        return await ctx.verify()
