"""Try an agent program without a cluster: one rollout of it in this process, against the deterministic
engine and a built-in environment (``docs/agents.md`` shows the program).

    python3 examples/try_agent.py [--env counter|workplace|bank] [--seed N]

The context it builds does what an agent actor's does, minus the network: a model call goes to the
engine, a tool call to the environment, ``verify`` scores the environment's state against the
program's record of its successful calls. A boundary is a no-op here (no checkpoint ever parks it).
"""

from __future__ import annotations

import argparse
import asyncio

from parkway.actors.builtin.environments import ENVIRONMENTS
from parkway.actors.engines.base import GenerationRequest
from parkway.actors.engines.deterministic import DeterministicEngine
from parkway.actors.roles.resources import parse_record
from parkway.actors.sdk import chat
from parkway.actors.sdk.environments import ToolError
from parkway.actors.sdk.rollout import AgentProgram, RolloutContext, RolloutFailure, ToolOutcome
from parkway.protocol.messages import Generated, Run


class OneShot(AgentProgram):
    """One model call, the tool calls in its reply, then the reward."""

    name = "one-shot"

    async def run(self, ctx: RolloutContext) -> float:
        messages = [
            chat.Message("system", chat.system_prompt(ctx.prompt, list(ctx.tools), ctx.max_turns)),
            chat.Message("user", ctx.prompt),
        ]
        reply = await ctx.generate(messages)  # one model call (a boundary comes first)
        parsed = chat.parse_reply(reply.text)
        if parsed.garbage:
            raise RolloutFailure("garbage", parsed.garbage)  # a typed failure, never a fake sample
        for call in parsed.tool_calls:
            await ctx.call_tool(call.name, call.arguments)  # applied exactly once
        await ctx.end_tool_round()  # a boundary
        return await ctx.verify()  # the reward


async def try_program(program: AgentProgram, env_name: str, seed: int) -> tuple[float, RolloutContext]:
    env = ENVIRONMENTS[env_name](seed)
    engine = DeterministicEngine()
    run = Run(
        rollout_id="t0000_g0",
        attempt=0,
        group_id="t0000",
        env=env_name,
        prompt=f"Use the {env_name} tools.",
        max_turns=5,
        seed=seed,
    )

    async def generate(index: int, tokens: tuple[int, ...]) -> Generated:
        result = await engine.generate(
            GenerationRequest(
                request_id=f"{run.rollout_id}:{index}",
                token_ids=tokens,
                seed=seed,
                max_tokens=160,
                stop_token_ids=(chat.EOS,),
            )
        )
        return Generated(
            rollout_id=run.rollout_id,
            attempt=run.attempt,
            call_index=index,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason,
        )

    async def call_tool(index: int, tool: str, arguments: dict[str, object]) -> ToolOutcome:
        try:
            if tool == "verify":
                return ToolOutcome(True, {"reward": env.verify(parse_record(arguments))})
            return ToolOutcome(True, env.apply(tool, dict(arguments)))
        except ToolError as err:  # the model's mistake: the program sees ok=False
            return ToolOutcome(False, {"error": err.message})

    async def boundary() -> None:
        return None

    ctx = RolloutContext(
        run=run, tools=env.tools, _generate=generate, _call_tool=call_tool, _boundary=boundary
    )
    return await program.run(ctx), ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="counter", choices=sorted(ENVIRONMENTS))
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    reward, ctx = asyncio.run(try_program(OneShot(), args.env, args.seed))
    print(
        f"{OneShot.name} on {args.env}: {ctx.model_calls} model call, {ctx.tool_calls} tool calls, reward {reward}"
    )


if __name__ == "__main__":
    main()
