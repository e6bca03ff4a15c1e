"""A small deterministic "model" that speaks the tool-call format of ``actors/sdk/chat.py``.

It reads the prompt the way a trained policy would have to: the ``tools:`` and ``turns:`` lines of the
system block say what it may call and how many turns it has; every ``<|tool|>`` block is a tool round
already done. While rounds are left it says a few filler words and makes one tool call, with arguments
of the declared types; on the last turn (or with no tools) it answers ``<answer>N</answer>``. Then EOS.

Everything it says comes from an RNG seeded with sha256 of (seed, prompt token ids), never from
Python's ``hash()``, so the same request and seed give the same tokens and logprobs in every process.
The reply takes an optional simulated time per token (one timed wait per generation, not a sleep per
token): a generation takes a realistic time, and ``abort`` cuts it at the tokens "generated" so far.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import struct
from collections import defaultdict

import anyio
from parkway.actors.engines.base import Engine, GenerationRequest, GenerationResult, require_directory
from parkway.actors.sdk import chat

FILLER = (
    "let",
    "me",
    "think",
    "about",
    "the",
    "next",
    "step",
    "first",
    "then",
    "check",
    "state",
    "carefully",
    "now",
    "so",
    "ok",
)
WORDS = ("red", "blue", "apple", "stone", "river", "cloud", "tiger", "lamp", "seed", "moon", "pine", "frog")

_SYSTEM = "<|system|>\n"


class DeterministicEngine(Engine):
    """Same request and seed, same tokens and logprobs, in any process; ``filler_words`` words per reply."""

    def __init__(self, per_token_delay_s: float = 0.0, filler_words: int = 6) -> None:
        if per_token_delay_s < 0 or filler_words < 0:
            raise ValueError("per_token_delay_s and filler_words must be >= 0")
        self.per_token_delay_s = per_token_delay_s
        self.filler_words = filler_words
        self._running = 0
        self.weights: str | None = None
        self._aborts: dict[str, list[asyncio.Event]] = defaultdict(list)

    # -- the model ---------------------------------------------------------------------------
    def reply_tokens(self, request: GenerationRequest) -> tuple[list[int], list[float]]:
        """The whole reply this engine gives to ``request`` (before max_tokens and stop tokens)."""
        rng = request_rng(request.seed, request.token_ids)
        text = chat.decode(request.token_ids)
        tools, turns = read_system_block(text)
        rounds_done = text.count("<|tool|>")
        words = [rng.choice(FILLER) for _ in range(self.filler_words)]
        if tools and rounds_done < turns - 1:
            spec = rng.choice(tools)
            call = {"name": spec.name, "arguments": tool_arguments(spec, rng)}
            body = f"<tool>{json.dumps(call)}</tool>"
        else:
            body = f"<answer>{rng.randint(0, 99)}</answer>"
        tokens = [*chat.encode(" ".join([*words, body])), chat.EOS]
        logprobs = [-round(0.001 + 2.5 * rng.random() ** 3, 6) for _ in tokens]
        return tokens, logprobs

    # -- Engine ------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        tokens, logprobs = self.reply_tokens(request)
        stops = set(request.stop_token_ids)
        aborted = asyncio.Event()
        self._aborts[request.request_id].append(aborted)
        self._running += 1
        out: list[int] = []
        finish = "length"
        for token in tokens:
            if len(out) >= request.max_tokens:
                break
            out.append(token)
            if token == chat.EOS or token in stops:
                finish = "stop"
                break
        try:
            if self.per_token_delay_s > 0 and out:
                # One timed wait per generation, not one sleep per token: the reply takes
                # len(out) * per_token_delay_s, and an abort cuts it at the tokens "generated" so far.
                # (A sleep per token costs an event-loop wake-up per token: at hundreds of calls in
                # flight that is the benchmark measuring this stand-in, not the framework.)
                loop = asyncio.get_running_loop()
                started = loop.time()
                with anyio.move_on_after(len(out) * self.per_token_delay_s) as generating:
                    await aborted.wait()
                if not generating.cancelled_caught:  # aborted before the last token
                    done = int((loop.time() - started) / self.per_token_delay_s)
                    if done < len(out):
                        out, finish = out[:done], "abort"
        finally:
            self._running -= 1
            events = self._aborts[request.request_id]
            events.remove(aborted)
            if not events:
                del self._aborts[request.request_id]
        return GenerationResult(
            request_id=request.request_id,
            token_ids=tuple(out),
            logprobs=tuple(logprobs[: len(out)]),
            finish_reason=finish,
        )

    async def abort(self, request_id: str) -> bool:
        events = self._aborts.get(request_id)
        if not events:
            return False
        for event in events:
            event.set()
        return True

    def in_flight(self) -> int:
        return self._running

    async def load_weights(self, directory: str) -> None:
        # No weights to replace: a rule-based stand-in for a model. The directory must still exist, so
        # a wrong path fails here as it would with a real engine.
        require_directory(directory)
        self.weights = directory


def request_rng(seed: int, token_ids: tuple[int, ...] | list[int]) -> random.Random:
    """An RNG that depends on exactly (seed, prompt token ids), identical across processes."""
    digest = hashlib.sha256()
    digest.update(b"parkway-deterministic-v1\0")
    digest.update(str(int(seed)).encode() + b"\0")
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return random.Random(int.from_bytes(digest.digest(), "big"))


def read_system_block(text: str) -> tuple[list[chat.ToolSpec], int]:
    """The tools and turn budget of the system block: its last ``tools:`` and ``turns:`` lines."""
    start = text.find(_SYSTEM)
    if start < 0:
        return [], 1
    block = text[start + len(_SYSTEM) :]
    end = block.find("<|")
    if end >= 0:
        block = block[:end]
    tools: list[chat.ToolSpec] = []
    turns = 1
    for line in block.splitlines():
        if line.startswith("tools:"):
            tools = chat.parse_tool_signatures(line[len("tools:") :])
        elif line.startswith("turns:"):
            try:
                turns = int(line[len("turns:") :].strip())
            except ValueError:
                turns = 1
    return tools, turns


def tool_arguments(spec: chat.ToolSpec, rng: random.Random) -> dict[str, object]:
    """Arguments of the declared types; ``src`` and ``dst`` from one choice set are kept distinct."""
    types = dict(spec.args)
    arguments: dict[str, object] = {}
    for name, kind in spec.args:
        other = {"src": "dst", "dst": "src"}.get(name)
        exclude = (
            arguments.get(other)
            if other in arguments and types.get(other) == kind and kind.startswith("choice:")
            else None
        )
        arguments[name] = argument_value(kind, rng, exclude=exclude)
    return arguments


def argument_value(kind: str, rng: random.Random, *, exclude: object = None) -> object:
    if kind == "int":
        return rng.randint(1, 9)
    if kind.startswith("choice:"):
        options = [o for o in kind[len("choice:") :].split("|") if o]
        allowed = [o for o in options if o != exclude] or options
        return rng.choice(allowed) if allowed else rng.choice(WORDS)
    return rng.choice(WORDS)  # "word", and any type this engine does not know
