"""The public API for writing an agent: subclass ``AgentProgram`` and implement ``run``.

``run`` drives one attempt of one rollout through a ``RolloutContext``: ``generate`` is one model
call, ``call_tool`` one tool call (exactly once, however often it is delivered), ``verify`` scores the
session. The context records the boundaries (before each model call and after each tool round) where a
checkpoint can park the rollout. Raise ``RolloutFailure`` for a typed failure; any other exception is
reported as a failure of code ``agent_error``.

    class EchoAgent(AgentProgram):
        name = "echo"

        async def run(self, ctx: RolloutContext) -> float:
            reply = await ctx.generate([chat.Message("user", ctx.prompt)])
            return await ctx.verify()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

from parkway.actors.sdk import chat
from parkway.protocol.messages import Generated, Run

RESERVED_TOOLS = frozenset({"verify", "release"})  # session ends, called by the context itself


class RolloutFailure(Exception):
    """A typed end of an attempt without a result (``code`` goes to the controller in ``Failed``)."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class ModelReply:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass(frozen=True)
class ToolOutcome:
    ok: bool
    output: dict[str, object]


@dataclass
class RolloutContext:
    """Everything one attempt may do. Built by the agent actor; programs only call its methods."""

    run: Run
    tools: tuple[chat.ToolSpec, ...]
    _generate: Callable[[int, tuple[int, ...]], Awaitable[Generated]]
    _call_tool: Callable[[int, str, dict[str, object]], Awaitable[ToolOutcome]]
    _boundary: Callable[[], Awaitable[None]]
    model_calls: int = 0
    tool_calls: int = 0
    boundaries: int = 0
    turns: int = 0
    record: list[dict[str, object]] = field(default_factory=list)  # successful tool calls, for verify

    @property
    def prompt(self) -> str:
        return self.run.prompt

    @property
    def max_turns(self) -> int:
        return self.run.max_turns

    async def boundary(self) -> None:
        self.boundaries += 1
        await self._boundary()

    async def generate(self, messages: list[chat.Message]) -> ModelReply:
        """One model call on the rendered conversation (a boundary comes first)."""
        await self.boundary()
        if self.run.task.fail_at_turn == self.turns:
            raise RolloutFailure("injected", f"fault injected at turn {self.turns}")
        tokenizer = chat.tokenizer_for(self.run.task.tokenizer)
        generated = await self._generate(self.model_calls, tuple(tokenizer.encode_chat(messages)))
        self.model_calls += 1
        self.turns += 1
        return ModelReply(tokenizer.decode(generated.token_ids), generated.token_ids, generated.finish_reason)

    async def call_tool(self, name: str, arguments: dict[str, object]) -> ToolOutcome:
        if name in RESERVED_TOOLS:  # a model must not end its own session by naming these
            raise RolloutFailure("reserved_tool", f"the model called the reserved tool {name!r}")
        outcome = await self._call_tool(self.tool_calls, name, arguments)
        self.tool_calls += 1
        if outcome.ok:
            self.record.append({"tool": name, "arguments": arguments, "output": outcome.output})
        return outcome

    async def end_tool_round(self) -> None:
        await self.boundary()

    async def verify(self) -> float:
        outcome = await self._call_tool(self.tool_calls, "verify", {"calls": self.record})
        self.tool_calls += 1
        if not outcome.ok:
            raise RolloutFailure("verify_failed", str(outcome.output.get("error", "")))
        reward = outcome.output.get("reward")
        if not isinstance(reward, int | float):
            raise RolloutFailure("verify_failed", f"no reward in {outcome.output}")
        return float(reward)


class AgentProgram(ABC):
    """One kind of agent. ``run`` returns the reward of the attempt."""

    name: ClassVar[str]

    @abstractmethod
    async def run(self, ctx: RolloutContext) -> float: ...
