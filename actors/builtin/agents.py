"""The agents parkway ships: a generic tool-using agent, a minimal counter agent and the learning
example's submit agent."""

from __future__ import annotations

import json

from parkway.actors.sdk import chat
from parkway.actors.sdk.environments import MAX_WORD_LENGTH
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


def as_word(text: str) -> str:
    """A reply as one ``word`` argument: printable characters without spaces, at most 64 of them."""
    kept = "".join(c for c in text if c.isprintable() and not c.isspace())
    return kept[:MAX_WORD_LENGTH] or "_"


class SubmitAgent(AgentProgram):
    """The learning example's agent: one model call on the prompt, its reply submitted as is (the
    ``letters`` environment scores it)."""

    name = "submit"

    async def run(self, ctx: RolloutContext) -> float:
        reply = await ctx.generate([chat.Message("user", ctx.prompt)])
        outcome = await ctx.call_tool("submit", {"text": as_word(reply.text)})
        if not outcome.ok:
            raise RolloutFailure("tool_error", str(outcome.output))
        return await ctx.verify()


BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
# A template may hold ``.delay``: seconds each test run takes (the crash test's command in flight).
TESTS = (
    "import pathlib, sys, time\n"
    "from calc import add\n\n"
    "delay = pathlib.Path('.delay')\n"
    "time.sleep(float(delay.read_text()) if delay.exists() else 0)\n"
    "cases = [(1, 2), (0, 0), (5, -3)]\n"
    "failed = [f'add({a}, {b}) gave {add(a, b)}, expected {a + b}' for a, b in cases if add(a, b) != a + b]\n"
    "print('\\n'.join(failed) or f'{len(cases)} passed')\n"  # no traceback: it would name absolute paths
    "sys.exit(1 if failed else 0)\n"
)
RUN_TESTS = '"$PYTHON" test_calc.py'


class CoderAgent(AgentProgram):
    """A coding agent over the ``workspace`` environment, deterministic whatever the model says: it
    writes a module with a bug and its tests, runs them, reads the failure, fixes the module and runs
    them again; one model call per turn (docs/workspace.md)."""

    name = "coder"

    async def run(self, ctx: RolloutContext) -> float:
        messages = [chat.Message("system", chat.system_prompt(ctx.prompt, list(ctx.tools), ctx.max_turns))]

        async def turn(*calls: tuple[str, dict[str, object]]) -> list[dict[str, object]]:
            reply = await ctx.generate(messages)
            messages.append(chat.Message("assistant", reply.text))
            outputs = []
            for tool, arguments in calls:
                outcome = await ctx.call_tool(tool, arguments)
                if not outcome.ok:
                    raise RolloutFailure("tool_error", f"{tool}: {outcome.output}")
                messages.append(chat.Message("tool", json.dumps(outcome.output, sort_keys=True)))
                outputs.append(outcome.output)
            await ctx.end_tool_round()
            return outputs

        await turn(
            ("write_file", {"path": "calc.py", "content": BUGGY}),
            ("write_file", {"path": "test_calc.py", "content": TESTS}),
        )
        (failed,) = await turn(("run", {"command": RUN_TESTS}))
        if failed.get("exit_code") == 0:
            raise RolloutFailure("tool_error", "the tests of the buggy module passed")
        (source,) = await turn(("read_file", {"path": "calc.py"}))
        fixed = str(source.get("content", "")).replace("a - b", "a + b")
        await turn(("write_file", {"path": "calc.py", "content": fixed}))
        await turn(("run", {"command": RUN_TESTS}))
        return await ctx.verify()


PROGRAMS: dict[str, type[AgentProgram]] = {
    p.name: p for p in (ToolAgent, CounterAgent, SubmitAgent, CoderAgent)
}
