"""The deterministic engine and its hosts: determinism (also across processes), the tool-call format,
max_tokens, stop tokens, abort; the inline pool and a Ray pool of two replicas.

Ray costs seconds to start on a small machine, so it starts once for this module, and only the tests
that ask for it (``ray_cluster``) use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from parkway.actors.engines.base import GenerationRequest
from parkway.actors.engines.deterministic import DeterministicEngine, request_rng
from parkway.actors.engines.ray_host import EnginePool, EngineSpec, build_engine, remote_engine_actor
from parkway.actors.sdk import chat

from tests.support.waiting import until

COUNTER = [chat.ToolSpec("increment", (("by", "int"),)), chat.ToolSpec("get", (), mutates=False)]
ACCOUNTS = "choice:alice|bob|carol"
BANK = [
    chat.ToolSpec("transfer", (("src", ACCOUNTS), ("dst", ACCOUNTS), ("amount", "int"))),
    chat.ToolSpec("deposit", (("who", ACCOUNTS), ("amount", "int"), ("memo", "word"))),
]


def conversation(tools: list[chat.ToolSpec], turns: int, user: str = "Count to 12.") -> list[chat.Message]:
    return [
        chat.Message("system", chat.system_prompt("reach the target", tools, turns)),
        chat.Message("user", user),
    ]


def request(
    messages: list[chat.Message],
    *,
    seed: int = 7,
    max_tokens: int = 512,
    request_id: str = "g_g0:0",
    stop: tuple[int, ...] = (),
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        token_ids=tuple(chat.encode(chat.render(messages))),
        seed=seed,
        max_tokens=max_tokens,
        stop_token_ids=stop,
    )


def check_arguments(spec: chat.ToolSpec, arguments: dict[str, object]) -> None:
    assert set(arguments) == {name for name, _ in spec.args}
    for name, kind in spec.args:
        value = arguments[name]
        if kind == "int":
            assert isinstance(value, int) and 1 <= value <= 9
        elif kind.startswith("choice:"):
            assert value in kind[len("choice:") :].split("|")
        else:
            assert isinstance(value, str) and value.isalpha() and value.islower()


async def test_same_request_same_tokens_and_logprobs() -> None:
    engine = DeterministicEngine()
    first = await engine.generate(request(conversation(COUNTER, 4)))
    again = await DeterministicEngine().generate(request(conversation(COUNTER, 4), request_id="other:1"))
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    assert first.finish_reason == "stop" and first.token_ids[-1] == chat.EOS
    assert len(first.logprobs) == len(first.token_ids) and all(lp < 0 for lp in first.logprobs)
    other_seeds = {
        (await engine.generate(request(conversation(COUNTER, 4), seed=s))).token_ids for s in range(8)
    }
    assert len(other_seeds) > 1  # the seed matters
    assert engine.in_flight() == 0


@pytest.mark.slow  # a second Python process
def test_the_rng_is_the_same_in_another_process() -> None:
    prompt = tuple(chat.encode(chat.render(conversation(BANK, 3))))
    here = [request_rng(11, prompt).random() for _ in range(3)]
    code = (
        "import json, sys; from parkway.actors.engines.deterministic import request_rng; "
        "prompt = tuple(json.loads(sys.argv[1])); print(json.dumps([request_rng(11, prompt).random() for _ in range(3)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different hash() must not matter
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(prompt)], capture_output=True, text=True, check=True, env=env
    )
    assert json.loads(out.stdout) == here


@pytest.mark.parametrize("tools", [COUNTER, BANK], ids=["counter", "bank"])
async def test_tool_calls_until_the_last_turn_then_an_answer(tools: list[chat.ToolSpec]) -> None:
    engine = DeterministicEngine()
    specs = {spec.name: spec for spec in tools}
    for seed in range(6):
        messages = conversation(tools, turns=4)
        for turn in range(4):
            result = await engine.generate(request(messages, seed=seed))
            assert result.finish_reason == "stop" and result.token_ids[-1] == chat.EOS
            text = chat.decode(result.token_ids)
            reply = chat.parse_reply(text)
            assert reply.garbage is None, text
            if turn < 3:
                [call] = reply.tool_calls
                check_arguments(specs[call.name], call.arguments)
                if call.name == "transfer":  # a valid transfer: two different accounts
                    assert call.arguments["src"] != call.arguments["dst"]
                messages += [
                    chat.Message("assistant", text),
                    chat.Message("tool", json.dumps({"ok": True, "output": {"value": turn}})),
                ]
            else:
                assert reply.answer is not None and reply.answer.isdigit() and not reply.tool_calls


async def test_src_and_dst_always_differ() -> None:
    engine = DeterministicEngine(filler_words=0)
    transfer_only = [BANK[0]]
    for seed in range(60):
        result = await engine.generate(request(conversation(transfer_only, 2), seed=seed))
        [call] = chat.parse_reply(chat.decode(result.token_ids)).tool_calls
        assert call.arguments["src"] != call.arguments["dst"]


async def test_no_tools_or_one_turn_answers_at_once() -> None:
    engine = DeterministicEngine()
    for messages in (conversation([], 5), conversation(COUNTER, 1), [chat.Message("user", "hi")]):
        reply = chat.parse_reply(chat.decode((await engine.generate(request(messages))).token_ids))
        assert reply.answer is not None and not reply.tool_calls


async def test_max_tokens_cuts_with_length_and_stop_tokens_stop() -> None:
    engine = DeterministicEngine()
    full = await engine.generate(request(conversation(COUNTER, 3)))
    cut = await engine.generate(request(conversation(COUNTER, 3), max_tokens=10))
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:10]
    assert cut.logprobs == full.logprobs[:10]
    exact = await engine.generate(request(conversation(COUNTER, 3), max_tokens=len(full.token_ids)))
    assert exact == full  # it ends on EOS exactly at the limit: a stop, not a cut
    lt = ord("<")
    stopped = await engine.generate(request(conversation(COUNTER, 3), stop=(lt,)))
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == lt
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(lt) + 1]
    empty = await engine.generate(request(conversation(COUNTER, 3), max_tokens=0))
    assert empty.token_ids == () and empty.finish_reason == "length"


async def test_abort_returns_the_tokens_so_far_and_in_flight_drains() -> None:
    engine = DeterministicEngine(per_token_delay_s=0.01)
    full = DeterministicEngine().reply_tokens(request(conversation(COUNTER, 3)))[0]
    task = asyncio.ensure_future(engine.generate(request(conversation(COUNTER, 3), request_id="g_g0:3")))
    other = asyncio.ensure_future(
        engine.generate(request(conversation(BANK, 3), request_id="g_g1:0", max_tokens=40))
    )
    await until(lambda: engine.in_flight() == 2)
    assert await engine.abort("g_g0:3") is True
    assert await engine.abort("nobody:0") is False
    result = await task
    assert result.finish_reason == "abort" and result.request_id == "g_g0:3"
    assert len(result.token_ids) < len(full) and result.token_ids == tuple(full[: len(result.token_ids)])
    assert len(result.logprobs) == len(result.token_ids)
    assert engine.in_flight() == 1
    assert (await other).finish_reason == "length"  # only the aborted request was cut short
    assert engine.in_flight() == 0
    assert await engine.abort("g_g0:3") is False  # nothing left to abort


async def test_cpu_per_token_is_spent_in_slices_and_changes_no_token() -> None:
    # The CPU is asked of the compute process token by token, in slices; what the engine says is the
    # same as without it. (The CPU itself is not timed here.)
    plain = DeterministicEngine()
    busy = DeterministicEngine(cpu_per_token_s=0.0005)  # 4 tokens per 2 ms slice
    await busy.start()
    try:
        for tools, turns in ((COUNTER, 3), (BANK, 2), ([], 1)):
            expected = await plain.generate(request(conversation(tools, turns)))
            asked = busy.cpu_asked_s
            assert await busy.generate(request(conversation(tools, turns))) == expected
            assert busy.cpu_asked_s - asked == pytest.approx(len(expected.token_ids) * 0.0005)
        assert busy.tokens_accrued() == plain.tokens_accrued() > 0
    finally:
        await busy.stop()
    assert busy._compute is None  # the compute process was told to go
    with pytest.raises(ValueError):
        DeterministicEngine(cpu_per_token_s=-0.001)


async def test_tokens_accrue_while_a_generation_runs_and_add_up_when_it_returns() -> None:
    engine = DeterministicEngine(per_token_delay_s=0.01)
    full = DeterministicEngine().reply_tokens(request(conversation(COUNTER, 3)))[0]
    task = asyncio.ensure_future(engine.generate(request(conversation(COUNTER, 3), request_id="g_g0:0")))
    await until(lambda: engine.tokens_accrued() > 0)  # before the generation returns
    assert not task.done() and engine.tokens_accrued() < len(full)
    assert (await task).token_ids == tuple(full)
    assert engine.tokens_accrued() == len(full)
    cut = asyncio.ensure_future(engine.generate(request(conversation(BANK, 3), request_id="g_g1:0")))
    await until(lambda: engine.tokens_accrued() > len(full))
    await engine.abort("g_g1:0")
    aborted = await cut
    assert aborted.finish_reason == "abort"
    assert engine.tokens_accrued() == len(full) + len(aborted.token_ids)  # exactly what came out


async def test_inline_pool() -> None:
    pool = EnginePool(EngineSpec(kwargs={"per_token_delay_s": 0.01}), host="inline")
    await pool.start()
    try:
        task = asyncio.ensure_future(pool.generate(request(conversation(COUNTER, 2), request_id="a:0")))
        await until(lambda: pool.in_flight() == 1)
        assert await pool.abort("a:0") is True
        assert (await task).finish_reason == "abort"
        assert pool.in_flight() == 0
    finally:
        await pool.stop()
    with pytest.raises(ValueError):
        build_engine(EngineSpec(kind="nonesuch"))
    with pytest.raises(ValueError):
        EnginePool(host="nowhere")


@pytest.mark.slow  # a fresh Python process
def test_importing_the_hosts_needs_no_ray() -> None:
    code = (
        "import sys; import parkway.actors.engines.ray_host, parkway.actors.roles.policy; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- Ray ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield ray
    ray.shutdown()


@pytest.mark.slow  # Ray's worker processes
async def test_two_engine_actors_in_separate_processes_agree(ray_cluster) -> None:
    actors = [remote_engine_actor().options(num_cpus=0).remote(EngineSpec()) for _ in range(2)]
    try:
        req = request(conversation(BANK, 3), seed=3)
        results = [await actor.generate.remote(req) for actor in actors]
        local = await DeterministicEngine().generate(req)
        assert results[0] == results[1] == local
        assert [await actor.in_flight.remote() for actor in actors] == [0, 0]
    finally:
        for actor in actors:
            ray_cluster.kill(actor)


@pytest.mark.slow  # Ray's worker processes
async def test_ray_pool_round_robin_and_abort(ray_cluster) -> None:
    pool = EnginePool(EngineSpec(kwargs={"per_token_delay_s": 0.01}), host="ray", replicas=2)
    await pool.start()
    try:
        prompt = conversation(COUNTER, 3)
        first = asyncio.ensure_future(pool.generate(request(prompt, request_id="r:0")))
        second = asyncio.ensure_future(pool.generate(request(prompt, request_id="r:1")))
        await until(lambda: pool.in_flight() == 2)
        counts: list[int] = []

        async def both_replicas_busy() -> None:
            while counts != [1, 1]:
                counts[:] = await pool.replica_in_flight()

        await asyncio.wait_for(both_replicas_busy(), 10)  # round robin: one request on each replica
        assert await pool.abort("r:1") is True
        aborted, finished = await second, await first
        assert aborted.finish_reason == "abort"
        assert finished.finish_reason == "stop"
        assert aborted.token_ids == finished.token_ids[: len(aborted.token_ids)]
        assert pool.in_flight() == 0 and await pool.replica_in_flight() == [0, 0]
        assert await pool.abort("r:1") is False
    finally:
        await pool.stop()
    assert ray_cluster.is_initialized()  # the pool did not start Ray, so it leaves it running
