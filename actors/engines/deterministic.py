"""A small deterministic "model" that speaks the tool-call format of ``actors/sdk/chat.py``.

It reads the prompt the way a trained policy would have to: the ``tools:`` and ``turns:`` lines of the
system block say what it may call and how many turns it has; every ``<|tool|>`` block is a tool round
already done. While rounds are left it says a few filler words and makes one tool call, with arguments
of the declared types; on the last turn (or with no tools) it answers ``<answer>N</answer>``. Then EOS.

Everything it says comes from an RNG seeded with sha256 of (seed, prompt token ids), never from
Python's ``hash()``, so the same request and seed give the same tokens and logprobs in every process.
The reply takes an optional simulated time per token (one timed wait per generation, not a sleep per
token): a generation takes a realistic time, and ``abort`` cuts it at the tokens "generated" so far.
It may also spend real CPU per token (``cpu_per_token_s``: a busy loop in a compute process of its own,
as a real engine computes outside the process that serves its requests), so a benchmark's data plane
competes for the cores with everything else; that never changes what it says.
``tokens_accrued`` counts the tokens out so far, those of generations still running included, at the
pace they come out (not when a generation returns).

It ``continues`` a generation: given a request's ``prefix`` (the tokens a snapshot kept of a call a
crash cut off), it checks that the prefix is the start of its reply to that request and brings out
only the rest, at the same pace; ``progress`` reads each running generation's tokens out so far. A
prefix that is not its own (another engine's, another seed) is not continued: the reply is generated
from the first token (``kept`` 0). ``record`` (a file path) appends one JSON line per generation
(request id, prompt digest, tokens kept, tokens generated, finish reason): the engine's own account
of its work, which crash tests read.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import random
import struct
import threading
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import anyio
from parkway.actors.engines.base import (
    Engine,
    GenerationRequest,
    GenerationResult,
    Progress,
    require_directory,
)
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

    continues = True

    def __init__(
        self,
        per_token_delay_s: float = 0.0,
        filler_words: int = 6,
        cpu_per_token_s: float = 0.0,
        record: str | None = None,
    ) -> None:
        if per_token_delay_s < 0 or filler_words < 0 or cpu_per_token_s < 0:
            raise ValueError("per_token_delay_s, filler_words and cpu_per_token_s must be >= 0")
        self.per_token_delay_s = per_token_delay_s
        self.filler_words = filler_words
        self.cpu_per_token_s = cpu_per_token_s
        self._running = 0
        self._tokens_returned = 0  # tokens of the generations that returned
        self._paces: set[Pace] = set()  # the generations running
        self._compute: ProcessPoolExecutor | None = None  # where the CPU per token is spent
        self.cpu_asked_s = 0.0  # CPU seconds asked of the compute process so far
        self.weights: str | None = None
        self._aborts: dict[str, list[asyncio.Event]] = defaultdict(list)
        # request id -> (the reply being brought out, its logprobs, tokens kept, its pace): ``progress``
        self._runs: dict[str, tuple[list[int], list[float], int, Pace]] = {}
        self.record = Path(record) if record else None

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
    async def start(self) -> None:
        if self.cpu_per_token_s > 0:
            # Started (and its imports done) here, not in the first generation.
            await asyncio.get_running_loop().run_in_executor(self._compute_process(), burn_cpu, 0.0)

    async def stop(self) -> None:
        if self._compute is not None:
            self._compute.shutdown(wait=False, cancel_futures=True)
            self._compute = None

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
        # A prefix is continued when it is the start of this reply: only the rest is brought out.
        kept = (
            len(request.prefix)
            if request.prefix and tuple(out[: len(request.prefix)]) == request.prefix
            else 0
        )
        pace, full = Pace(done=kept, kept=kept), len(out)
        self._paces.add(pace)
        reply = out  # the list ``progress`` reads (``out`` is cut short on an abort)
        self._runs[request.request_id] = (reply, logprobs, kept, pace)
        try:
            done = await self._produce(len(out), aborted, pace)
            if done < len(out):
                out, finish = out[:done], "abort"
        finally:
            self._paces.discard(pace)
            self._tokens_returned += pace.done - kept  # in the same step: never counted twice, nor missed
            self._running -= 1
            if self._runs.get(request.request_id, (None,))[0] is reply:  # not a same-id generation's
                del self._runs[request.request_id]
            events = self._aborts[request.request_id]
            events.remove(aborted)
            if not events:
                del self._aborts[request.request_id]
            self._write_record(request, kept, pace.done - kept, finish if pace.done >= full else "abort")
        return GenerationResult(
            request_id=request.request_id,
            token_ids=tuple(out),
            logprobs=tuple(logprobs[: len(out)]),
            finish_reason=finish,
            kept=min(kept, len(out)),
        )

    def _write_record(self, request: GenerationRequest, kept: int, generated: int, finish: str) -> None:
        """One line of the engine's own account, appended and flushed (a killed process keeps it)."""
        if self.record is None:
            return
        line = {
            "request_id": request.request_id,
            "prompt_sha256": hashlib.sha256(
                struct.pack(f"<{len(request.token_ids)}I", *request.token_ids)
            ).hexdigest(),
            "prefix": len(request.prefix),
            "kept": kept,
            "generated": generated,
            "finish": finish,
        }
        with self.record.open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    def progress(self, known: dict[str, int]) -> dict[str, Progress]:
        found = {}
        for request_id, (out, logprobs, _, pace) in self._runs.items():
            start, now = known.get(request_id, 0), min(pace.tokens(self.per_token_delay_s), len(out))
            if now > start:
                found[request_id] = Progress(start, tuple(out[start:now]), tuple(logprobs[start:now]))
        return found

    async def _produce(self, count: int, aborted: asyncio.Event, pace: Pace) -> int:
        """Bring ``count`` tokens out at this engine's pace; how many came out before an abort.

        Without CPU per token, one timed wait per generation, not one sleep per token: the reply takes
        ``count * per_token_delay_s``, and an abort cuts it at the tokens "generated" so far. (A sleep
        per token costs an event-loop wake-up per token: at hundreds of calls in flight that is the
        benchmark measuring this stand-in, not the framework.) With CPU per token, slices of tokens:
        each has its CPU spent in the compute process (one for the engine, so the generations share a
        core at most, their slices in turn), then waits its time; CPU that other processes take makes
        the generation later, as it would a real engine's."""
        delay, cpu = self.per_token_delay_s, self.cpu_per_token_s
        if delay <= 0 and cpu <= 0:
            pace.done = count
            return count
        per_slice = count if cpu <= 0 else max(1, int(BURN_SLICE_S / cpu))
        while pace.done < count:
            tokens = min(per_slice, count - pace.done)
            if cpu > 0:
                self.cpu_asked_s += tokens * cpu
                await asyncio.get_running_loop().run_in_executor(
                    self._compute_process(), burn_cpu, tokens * cpu
                )
            if delay > 0:
                pace.waiting(tokens)
                with anyio.move_on_after(tokens * delay) as generating:
                    await aborted.wait()
                if not generating.cancelled_caught:  # aborted before this slice's last token
                    pace.done = pace.tokens(delay)
                    pace.waiting(0)
                    return pace.done
                pace.waiting(0)
            pace.done += tokens
            if aborted.is_set():
                return pace.done
        return count

    def _compute_process(self) -> ProcessPoolExecutor:
        if self._compute is None:  # made without an await: two generations never make two
            self._compute = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),  # no fork of a process with threads
                initializer=exit_with_parent,
                initargs=(os.getpid(),),
            )
        return self._compute

    def tokens_accrued(self) -> int:
        """Tokens out so far: every returned generation's, and each running one's at its pace."""
        return self._tokens_returned + sum(p.tokens(self.per_token_delay_s) - p.kept for p in self._paces)

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


BURN_SLICE_S = 0.002  # CPU per slice: a generation's tokens come out slice by slice


@dataclass(eq=False)  # one per generation, told apart by identity
class Pace:
    """Where one generation stands: the tokens out, and the wait it is in for the next ones."""

    done: int = 0  # tokens out before the current wait
    kept: int = 0  # of them, a continued call's prefix: not brought out by this generation
    waiting_since: float | None = None  # time.monotonic() when the current wait began
    waiting_for: int = 0  # tokens the current wait brings out

    def waiting(self, tokens: int) -> None:
        """A wait for ``tokens`` more begins now (0: no wait)."""
        self.waiting_since, self.waiting_for = (time.monotonic(), tokens) if tokens else (None, 0)

    def tokens(self, per_token_delay_s: float) -> int:
        """The tokens out now: those before the wait, and those of the wait whose time has passed."""
        if self.waiting_since is None or per_token_delay_s <= 0:
            return self.done
        passed = int((time.monotonic() - self.waiting_since) / per_token_delay_s)
        return self.done + min(self.waiting_for, passed)


def burn_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time in a busy loop (time descheduled does not count)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def exit_with_parent(parent: int) -> None:
    """A compute process ends when the engine's process is gone, even killed (it would wait forever on
    its task queue otherwise)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


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
