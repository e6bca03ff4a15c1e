"""One device run of parkway's vLLM engine path (VllmEngine in an inline EnginePool) on a GPU.

    python3 vllm_gpu_check.py                      every stage, each in its own process, in bounded time
    python3 vllm_gpu_check.py kernels              vLLM's compiled ops on the GPU, against torch
    python3 vllm_gpu_check.py engine DTYPE [BACKEND|auto] [native]     parkway's engine path

Each stage prints one ``RESULT {json}`` line; the whole run writes them to ``$OUT/vllm_gpu.json`` and
exits non-zero unless the kernels, a bf16 engine and the fp32 engine all passed. scripts/gpu/device_run.sh
sets up what it needs: PYTHONPATH with the unpacked payload (vLLM and its wheels) and a folder holding
parkway/{actors,protocol,brokers}, and the tiny model at $CHECK_MODEL.

A stage is a process of its own so that a crashed or hung engine (a CUDA error, a kernel missing from
the trimmed payload) costs that stage, not the run, and each engine starts on a clean GPU.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL_DIR = os.environ.get("CHECK_MODEL", "/tmp/vllm-gpu/tiny")
PROMPT = tuple(range(10, 74))  # 64 prompt tokens, all inside the tiny model's vocabulary
MAX_TOKENS = 128
# The whole run, so it ends inside one device call (10 minutes at most); no stage starts after it.
DEADLINE_S = float(os.environ.get("CHECK_DEADLINE_S", "420"))
# vLLM's default would give the KV cache 90% of the GPU: millions of blocks for the tiny model, and
# minutes of allocation. A fixed small cache keeps start-up about the engine.
KV_CACHE_BYTES = 256 << 20


def report_stage(stage: str, **fields: Any) -> None:
    print("RESULT " + json.dumps({"stage": stage, **fields}), flush=True)


def check_kernels() -> None:
    """The compiled ops a dense model calls, on the GPU, against torch: proves the pruned kernel
    library still holds sm_90 code and registers with this torch."""
    import torch

    started = time.perf_counter()
    import vllm._custom_ops  # noqa: F401  (loads vllm._C_stable_libtorch through the platform)

    import_s = time.perf_counter() - started
    hidden = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    normed = torch.empty_like(hidden)
    torch.ops._C.rms_norm(normed, hidden, weight, 1e-6)
    as_float = hidden.float()
    expected = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    rms_norm_error = (normed.float() - expected.to(hidden.dtype).float()).abs().max().item()

    gate_up = torch.randn(64, 2 * 512, dtype=torch.bfloat16, device="cuda")
    activated = torch.empty(64, 512, dtype=torch.bfloat16, device="cuda")
    torch.ops._C.silu_and_mul(activated, gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    silu_error = (activated.float() - torch.nn.functional.silu(gate) * up).abs().max().item()
    torch.cuda.synchronize()

    fa3: bool | str | None  # True, or why vLLM found FlashAttention-3 unusable
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON

        fa3 = FA3_AVAILABLE or FA3_UNAVAILABLE_REASON
    except Exception as error:
        fa3 = repr(error)
    report_stage(
        "kernels",
        ok=rms_norm_error < 0.1 and silu_error < 0.1,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        import_s=round(import_s, 1),
        rms_norm_max_err=rms_norm_error,
        silu_and_mul_max_err=silu_error,
        fa3=fa3,
    )


def add_engine_options(options: dict[str, Any]) -> None:
    """Make every VllmEngine the pool builds pass ``options`` to vLLM too: parkway's engine does not
    expose the attention backend or the custom-op switch, which the fallback stages need."""
    from parkway.actors.engines import vllm_engine

    class VllmEngineWithOptions(vllm_engine.VllmEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.options.update(options)

    # build_engine looks the class up in the module each time it builds one
    vllm_engine.VllmEngine = VllmEngineWithOptions


async def check_engine(dtype: str, backend: str, native_ops: bool) -> None:
    """Start parkway's engine path as the policy does (inline host), then throughput at 1 and 16
    concurrent requests, same-seed determinism, an in-place weight reload, and an abort."""
    from parkway.actors.engines.base import GenerationRequest, GenerationResult
    from parkway.actors.engines.ray_host import EnginePool, EngineSpec

    extra_options: dict[str, Any] = {}
    if backend != "auto":
        extra_options["attention_backend"] = backend
    if native_ops:  # every CustomOp in plain torch: no vllm._C kernel on the model's path
        extra_options["compilation_config"] = {"custom_ops": ["none"]}
    if extra_options:
        add_engine_options(extra_options)

    engine_kwargs = {
        "model": MODEL_DIR,
        "max_model_len": 2048,
        "dtype": dtype,
        "max_num_seqs": 16,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }
    pool = EnginePool(EngineSpec(kind="vllm", kwargs=engine_kwargs), host="inline")
    started = time.perf_counter()
    await pool.start()
    fields: dict[str, Any] = {
        "dtype": dtype,
        "backend": backend,
        "native_ops": native_ops,
        "engine_start_s": round(time.perf_counter() - started, 1),
    }
    try:
        await pool.generate(GenerationRequest("warm-up", PROMPT, seed=0, max_tokens=8))

        async def generate_concurrently(count: int, prefix: str) -> tuple[int, float]:
            requests = [
                GenerationRequest(f"{prefix}{i}", PROMPT, seed=i, max_tokens=MAX_TOKENS) for i in range(count)
            ]
            started = time.perf_counter()
            results = await asyncio.gather(*(pool.generate(request) for request in requests))
            return sum(len(result.token_ids) for result in results), time.perf_counter() - started

        for concurrency in (1, 16):
            # one untimed round per size first: Triton compiles its kernels per batch shape
            await generate_concurrently(concurrency, f"untimed-{concurrency}-")
            tokens, seconds = await generate_concurrently(concurrency, f"timed-{concurrency}-")
            fields[f"c{concurrency}_tokens"] = tokens
            fields[f"c{concurrency}_tokens_per_s"] = round(tokens / seconds, 1)
            fields[f"c{concurrency}_s"] = round(seconds, 3)

        async def seeded(request_id: str) -> GenerationResult:
            return await pool.generate(GenerationRequest(request_id, PROMPT, seed=123, max_tokens=32))

        first, second = await seeded("seeded-1"), await seeded("seeded-2")
        fields["same_seed_same_tokens"] = first.token_ids == second.token_ids
        fields["same_seed_logprob_max_diff"] = max(
            (abs(a - b) for a, b in zip(first.logprobs, second.logprobs, strict=False)), default=0.0
        )
        fields["finite_logprobs"] = all(math.isfinite(x) and x <= 0.0 for x in first.logprobs)

        started = time.perf_counter()
        await pool.load_weights(MODEL_DIR)  # WeightsReload.parkway_reload_weights in vLLM's GPU worker
        fields["load_weights_s"] = round(time.perf_counter() - started, 2)
        reloaded = await seeded("seeded-after-reload")
        fields["reload_same_tokens"] = reloaded.token_ids == first.token_ids

        long_request = GenerationRequest("aborted", PROMPT, seed=7, max_tokens=1900)
        running = asyncio.create_task(pool.generate(long_request))
        await asyncio.sleep(0.3)
        fields["abort_accepted"] = await pool.abort("aborted")
        aborted = await asyncio.wait_for(running, 30)
        fields["abort_finish"] = aborted.finish_reason
        fields["abort_tokens"] = len(aborted.token_ids)
        fields["in_flight_after"] = pool.in_flight()
        fields["ok"] = bool(fields["same_seed_same_tokens"] and fields["c16_tokens"] > 0)
    finally:
        started = time.perf_counter()
        await pool.stop()
        fields["stop_s"] = round(time.perf_counter() - started, 1)
        report_stage("engine", **fields)


def run_all_stages() -> int:
    run_started = time.perf_counter()
    out = Path(os.environ.get("OUT", "/tmp/vllm-gpu/out"))
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []

    def run_stage(args: list[str], timeout_s: float) -> dict[str, Any] | None:
        left_s = DEADLINE_S - (time.perf_counter() - run_started)
        if left_s < 30:
            records.append({"stage": " ".join(args), "skipped": "deadline"})
            return None
        timeout_s = min(timeout_s, left_s)
        started = time.perf_counter()
        print(f"=== stage {' '.join(args)} (timeout {timeout_s:.0f} s)", flush=True)
        returncode: int | str
        try:
            process = subprocess.run(
                [sys.executable, __file__, *args],
                timeout=timeout_s,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            text, returncode = process.stdout, process.returncode
        except subprocess.TimeoutExpired as expired:
            partial = expired.stdout or b""
            text = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            returncode = "timeout"
        (out / f"log_{'_'.join(args)}.txt").write_text(text)
        reported = [
            json.loads(line[len("RESULT ") :]) for line in text.splitlines() if line.startswith("RESULT ")
        ]
        record = reported[-1] if reported else {"stage": " ".join(args), "ok": False}
        record.update(rc=returncode, wall_s=round(time.perf_counter() - started, 1))
        if returncode != 0 or not record.get("ok"):
            record["tail"] = "\n".join(text.splitlines()[-25:])
        records.append(record)
        print(json.dumps({key: value for key, value in record.items() if key != "tail"}), flush=True)
        if "tail" in record:
            print(record["tail"], flush=True)
        (out / "vllm_gpu.json").write_text(json.dumps(records, indent=1))
        return record

    def passed(record: dict[str, Any] | None) -> bool:
        # what the stage reported, not its exit status: vLLM's engine-core process can fail its own
        # teardown after a stage has reported, and that is no reason to run the fallbacks
        return bool(record and record.get("ok"))

    kernels = run_stage(["kernels"], 120)
    # bf16: the backend vLLM picks (FlashAttention-3 when fa3.tar.xz was shipped), else Triton's, else
    # Triton's with no compiled op at all, to tell a kernel problem from an engine problem.
    bf16 = run_stage(["engine", "bfloat16", "auto"], 200)
    if not passed(bf16):
        bf16 = run_stage(["engine", "bfloat16", "TRITON_ATTN"], 180)
        if not passed(bf16):
            bf16 = run_stage(["engine", "bfloat16", "TRITON_ATTN", "native"], 180)
    fp32 = run_stage(["engine", "float32", "auto"], 180)  # FlashAttention has no fp32: Triton's
    (out / "vllm_gpu.json").write_text(json.dumps(records, indent=1))
    print(f"total {time.perf_counter() - run_started:.0f} s", flush=True)
    return 0 if passed(kernels) and passed(bf16) and passed(fp32) else 1


def main() -> None:
    args = sys.argv[1:]
    if not args:
        sys.exit(run_all_stages())
    if args[0] == "kernels":
        check_kernels()
    elif args[0] == "engine" and len(args) >= 2:
        backend = args[2] if len(args) > 2 else "auto"
        asyncio.run(check_engine(args[1], backend, native_ops=len(args) > 3 and args[3] == "native"))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
