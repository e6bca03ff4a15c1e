"""Engines continuing a generation from a prefix (prefix recovery, docs/recovery.md#prefix).

The deterministic engine: ``progress`` reports the tokens out so far of a running generation and
nothing of one that has returned; a request whose ``prefix`` is the start of its own reply brings out
only the rest (the engine's record and ``tokens_accrued`` count only those) and returns the same
reply as an uninterrupted call; a prefix that is not its own is not continued. A Ray pool learns the
tokens of its replicas' running requests by polling. Interleavings wait on conditions, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from parkway.actors.engines.base import GenerationRequest, finished_prefix
from parkway.actors.engines.deterministic import DeterministicEngine
from parkway.actors.engines.ray_host import EnginePool, EngineSpec
from parkway.actors.sdk import chat

from tests.support.waiting import until

TOOLS = [chat.ToolSpec("increment", (("by", "int"),)), chat.ToolSpec("get", (), mutates=False)]
PROMPT = tuple(
    chat.encode(
        chat.render(
            [
                chat.Message("system", chat.system_prompt("count", TOOLS, 3)),
                chat.Message("user", "Count to 9."),
            ]
        )
    )
)


def call(request_id: str = "r_g0:0", *, prefix: tuple[int, ...] = (), logprobs: tuple[float, ...] = ()):
    return GenerationRequest(
        request_id=request_id,
        token_ids=PROMPT,
        seed=11,
        max_tokens=400,
        prefix=prefix,
        prefix_logprobs=logprobs,
    )


def records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_progress_reports_the_tokens_out_so_far_of_a_running_generation(tmp_path: Path) -> None:
    engine = DeterministicEngine(per_token_delay_s=0.002, filler_words=40)
    whole, logprobs = engine.reply_tokens(call())
    running = asyncio.ensure_future(engine.generate(call()))
    await until(lambda: len(engine.progress({}).get("r_g0:0", _empty).token_ids) >= 20)
    seen = engine.progress({})["r_g0:0"]
    assert seen.start == 0 and 20 <= len(seen.token_ids) < len(whole)
    assert seen.token_ids == tuple(whole[: len(seen.token_ids)])
    assert seen.logprobs == tuple(logprobs[: len(seen.token_ids)])
    later = engine.progress({"r_g0:0": len(seen.token_ids)}).get("r_g0:0")
    assert later is None or later.start == len(seen.token_ids)  # only what is new past ``known``
    result = await running
    assert result.token_ids == tuple(whole) and result.kept == 0
    assert engine.progress({}) == {}  # returned: nothing running to report


async def test_its_own_prefix_is_continued_and_only_the_rest_is_brought_out(tmp_path: Path) -> None:
    record = tmp_path / "engine.jsonl"
    engine = DeterministicEngine(per_token_delay_s=0.0005, filler_words=40, record=str(record))
    uninterrupted = await DeterministicEngine(filler_words=40).generate(call())
    cut = 57
    prefix, prefix_logprobs = uninterrupted.token_ids[:cut], uninterrupted.logprobs[:cut]
    result = await engine.generate(call(prefix=prefix, logprobs=prefix_logprobs))
    assert result.token_ids == uninterrupted.token_ids and result.logprobs == uninterrupted.logprobs
    assert result.kept == cut and result.finish_reason == uninterrupted.finish_reason
    assert engine.tokens_accrued() == len(uninterrupted.token_ids) - cut  # the prefix was not brought out
    [line] = records(record)
    assert (line["prefix"], line["kept"], line["generated"]) == (cut, cut, len(uninterrupted.token_ids) - cut)


async def test_a_prefix_that_is_not_its_own_is_generated_from_the_first_token(tmp_path: Path) -> None:
    record = tmp_path / "engine.jsonl"
    engine = DeterministicEngine(filler_words=10, record=str(record))
    uninterrupted = await engine.generate(call("a"))
    foreign = tuple(reversed(uninterrupted.token_ids[:12]))
    result = await engine.generate(call("b", prefix=foreign, logprobs=(-0.5,) * 12))
    assert result.token_ids == uninterrupted.token_ids and result.kept == 0
    assert records(record)[-1]["generated"] == len(uninterrupted.token_ids)


def test_a_prefix_that_already_ends_the_call_needs_no_generation() -> None:
    stop = GenerationRequest(
        "s", PROMPT, 1, 100, stop_token_ids=(7,), prefix=(5, 6, 7), prefix_logprobs=(-1.0,) * 3
    )
    done = finished_prefix(stop)
    assert (
        done is not None and done.finish_reason == "stop" and done.kept == 3 and done.token_ids == (5, 6, 7)
    )
    full = GenerationRequest("f", PROMPT, 1, 2, prefix=(5, 6, 8), prefix_logprobs=(-1.0,) * 3)
    done = finished_prefix(full)
    assert done is not None and done.finish_reason == "length" and done.token_ids == (5, 6)
    assert (
        finished_prefix(GenerationRequest("n", PROMPT, 1, 100, prefix=(5,), prefix_logprobs=(-1.0,))) is None
    )


async def test_an_inline_pool_reads_progress_without_a_poll() -> None:
    pool = EnginePool(EngineSpec(kwargs={"per_token_delay_s": 0.002, "filler_words": 40}), host="inline")
    await pool.start()
    try:
        assert pool.continues and not pool.polls
        running = asyncio.ensure_future(pool.generate(call()))
        await until(lambda: len(pool.known_progress().get("r_g0:0", ((),))[0]) >= 10)
        assert await pool.poll_progress() == 0  # nothing to poll: the engine is read directly
        await running
        assert pool.known_progress() == {}
    finally:
        await pool.stop()


@pytest.mark.slow  # Ray's worker processes
async def test_a_ray_pool_learns_its_replicas_tokens_by_polling() -> None:
    pool = EnginePool(
        EngineSpec(kwargs={"per_token_delay_s": 0.002, "filler_words": 60}),
        host="ray",
        replicas=1,
        ray_num_cpus=2,
    )
    await pool.start()
    try:
        assert pool.continues and pool.polls
        whole, _ = DeterministicEngine(filler_words=60).reply_tokens(call())
        running = asyncio.ensure_future(pool.generate(call()))
        learned = 0

        async def polled() -> bool:
            nonlocal learned
            learned += await pool.poll_progress()
            return len(pool.known_progress().get("r_g0:0", ((),))[0]) >= 30

        async with asyncio.timeout(30):
            while not await polled():  # noqa: ASYNC110 - a remote engine's state: polled, no event to wait on
                await asyncio.sleep(0.01)
        tokens, logprobs = pool.known_progress()["r_g0:0"]
        assert tokens == tuple(whole[: len(tokens)]) and len(logprobs) == len(tokens) == learned
        result = await running
        assert result.token_ids == tuple(whole)
        assert pool.known_progress() == {}  # returned: its tokens are in the reply, no longer polled
    finally:
        await pool.stop()


class _Empty:
    token_ids: tuple[int, ...] = ()


_empty = _Empty()


def test_the_engines_the_config_takes_for_prefix_are_the_ones_that_continue() -> None:
    from parkway.actors.engines.ray_host import engine_class
    from parkway.actors.run.config import PREFIX_ENGINES

    assert all(engine_class(kind).continues for kind in PREFIX_ENGINES)


async def test_an_aborted_generation_is_no_longer_reported() -> None:
    engine = DeterministicEngine(per_token_delay_s=0.002, filler_words=40)
    running = asyncio.ensure_future(engine.generate(call()))
    await until(lambda: len(engine.progress({}).get("r_g0:0", _empty).token_ids) >= 5)
    assert await engine.abort("r_g0:0")
    result = await running
    assert result.finish_reason == "abort" and engine.progress({}) == {} and engine.in_flight() == 0
