"""The conversation format between agents and the policy: a byte tokenizer, rendering, reply parsing.

Token ids 0..255 are bytes; ``EOS`` ends a reply. A conversation renders to text like::

    <|system|>
    task: reach the target with the tools
    tools: increment(by:int); get()
    turns: 5
    <|user|>
    Count to 12.
    <|assistant|>
    I will add. <tool>{"name": "increment", "arguments": {"by": 3}}</tool>
    <|tool|>
    {"ok": true, "output": {"value": 3}}
    <|assistant|>
    <answer>3</answer>

A reply holds tool calls (``<tool>{json}</tool>``, one or more) or a final ``<answer>...</answer>``;
anything else is garbage, which the agent turns into a typed failure, never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

EOS = 256
VOCAB_SIZE = 257

_TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(token_ids: list[int] | tuple[int, ...]) -> str:
    return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it: ``name(arg:type, ...)``. Types: ``int``, ``word``, ``text``, ``path``, ``choice:a|b|c``."""

    name: str
    args: tuple[tuple[str, str], ...] = ()
    mutates: bool = True

    def signature(self) -> str:
        return f"{self.name}({','.join(f'{a}:{t}' for a, t in self.args)})"


def parse_tool_signatures(line: str) -> list[ToolSpec]:
    """The inverse of the ``tools:`` line, for engines that read the prompt."""
    specs = []
    for item in filter(None, (part.strip() for part in line.split(";"))):
        name, _, rest = item.partition("(")
        args = []
        for arg in filter(None, rest.rstrip(")").split(",")):
            arg_name, _, arg_type = arg.partition(":")
            args.append((arg_name.strip(), arg_type.strip() or "word"))
        specs.append(ToolSpec(name.strip(), tuple(args)))
    return specs


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str


def render(messages: list[Message]) -> str:
    """The prompt text for the next assistant turn."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def system_prompt(task: str, tools: list[ToolSpec], turns: int) -> str:
    return f"task: {task}\ntools: {'; '.join(t.signature() for t in tools)}\nturns: {turns}"


@dataclass(frozen=True)
class ToolRequest:
    name: str
    arguments: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """What a model reply means: tool calls, a final answer, or garbage (with the reason)."""

    tool_calls: tuple[ToolRequest, ...] = ()
    answer: str | None = None
    garbage: str | None = None


def parse_reply(text: str) -> Reply:
    answer = _ANSWER.search(text)
    calls = []
    for raw in _TOOL.findall(text):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            return Reply(garbage=f"tool call is not JSON: {exc}")
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return Reply(garbage="tool call has no name")
        arguments = data.get("arguments", {})
        if not isinstance(arguments, dict):
            return Reply(garbage="tool arguments are not an object")
        calls.append(ToolRequest(data["name"], arguments))
    if calls:
        return Reply(tool_calls=tuple(calls))
    if answer is not None:
        return Reply(answer=answer.group(1).strip())
    return Reply(garbage="neither a tool call nor an answer")


class ByteTokenizer:
    """The default: bytes are tokens and the conversation renders as the text above."""

    stop_token_ids: tuple[int, ...] = ()

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return encode(render(messages))

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        return decode(token_ids)


class ModelTokenizer:
    """A model's own tokenizer (vLLM): prompts go through its chat template, replies through its decoder."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # the vllm extras bring transformers

        self._tokenizer = AutoTokenizer.from_pretrained(path)
        eos = self._tokenizer.eos_token_id
        self.stop_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()

    def encode_chat(self, messages: list[Message]) -> list[int]:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        text = self._tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string (the stubs also allow a batch)
        return text


_tokenizers: dict[str, ModelTokenizer] = {}


def tokenizer_for(path: str | None) -> ByteTokenizer | ModelTokenizer:
    """The tokenizer a rollout's model speaks: the byte one by default, a model's own when named."""
    if not path:
        return ByteTokenizer()
    if path not in _tokenizers:
        _tokenizers[path] = ModelTokenizer(path)
    return _tokenizers[path]
