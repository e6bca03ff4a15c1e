"""What tracing costs: throughput and the snapshot pause with tracing off, on with no exporter, and on
with the OTLP/HTTP exporter, in one sitting.

    python bench/tracing_overhead.py [--rounds 3] [--groups 8] [--quick]

Each round runs the same embedded workload (every actor in this process on the in-memory broker: bank
tasks, groups of 3, up to 6 turns, a snapshot every 0.05 s) once per variant, the variants interleaved
and their order rotated each round:

- ``off``: no tracer (the default);
- ``none``: the SDK's tracer provider with no exporter (every span made, none sent);
- ``otlp``: the SDK with the batched OTLP/HTTP exporter sending to a real receiver in this process
  (``tests/support/otlp.py``, decoding every request).

It reports, per variant, the median over rounds of rollouts per second (sealed rollouts over the
run's wall time) and of the runs' p50 and p95 admission-closed window, and each median's ratio to
``off``. Writes ``bench/results/tracing_overhead.json``.

What ``off`` costs against no tracing code at all cannot be told apart in those runs (their spread is
a few percent), so it is measured directly: the off path's calls per delivery (``inject`` on the
envelope, ``handling`` around the handler, a rollout's ``call`` wrapper around each model and tool call)
timed in a loop, and the deliveries and calls of one ``off`` run counted, giving the off path's share of
that run's wall time.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # bench/ is scripts, not a package
_sys.path.insert(1, str(_Path(__file__).resolve().parent.parent))  # tests.support: the OTLP receiver

import asyncio
import statistics
import tempfile
import time
from typing import Any

from common import add_quick, machine, markdown_table, parser, write_record
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from parkway.actors.runtime import tracing, tracing_sdk

from tests.support.embedded import embedded_run
from tests.support.otlp import OtlpReceiver

VARIANTS = ("off", "none", "otlp")


def workload(groups: int) -> dict[str, Any]:
    return {
        "run": "tracebench",
        "seed": 5,
        "policy": {"host": "inline", "per_token_delay_s": 0.0003},
        "tasks": {"builtin": "bank", "limit": groups},
        "rollout": {"group_size": 3, "max_turns": 6},
        "snapshot_interval_s": 0.05,
    }


def use(variant: str, receiver: OtlpReceiver) -> TracerProvider | None:
    tracing.disable()
    if variant == "off":
        return None
    ids = tracing_sdk.ForcedIds()
    provider = TracerProvider(id_generator=ids)
    if variant == "otlp":
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces"))
        )
    tracing.enable(provider, forced_ids=ids)
    return provider


async def one(variant: str, groups: int, receiver: OtlpReceiver) -> dict[str, float]:
    provider = use(variant, receiver)
    with tempfile.TemporaryDirectory() as state:
        summary = await embedded_run(workload(groups), _Path(state))
    if provider is not None:
        provider.force_flush()
        provider.shutdown()
    tracing.disable()
    return {
        "rollouts_per_s": summary.rollouts_sealed / summary.wall_s,
        "pause_p50_ms": summary.pause_ms.get("p50", 0.0),
        "pause_p95_ms": summary.pause_ms.get("p95", 0.0),
        "snapshots": summary.snapshots_published,
        "wall_s": summary.wall_s,
    }


async def _direct() -> None:
    return None


async def off_path_ns(loops: int = 200_000) -> dict[str, float]:
    """Nanoseconds per call of each piece of the off path, and of the bare work it wraps."""
    tracing.disable()
    headers: dict[str, str] = {}
    started = time.perf_counter_ns()
    for _ in range(loops):
        tracing.inject(headers)
    inject_ns = (time.perf_counter_ns() - started) / loops
    started = time.perf_counter_ns()
    for _ in range(loops):
        with tracing.handling("tq/0", headers, None):
            pass
    handling_ns = (time.perf_counter_ns() - started) / loops
    wrapper = tracing.rollout("t0000_g0", 0, 0)
    started = time.perf_counter_ns()
    for _ in range(loops):
        await wrapper.call("model", 0, _direct())
    wrapped_ns = (time.perf_counter_ns() - started) / loops
    started = time.perf_counter_ns()
    for _ in range(loops):
        await _direct()
    bare_ns = (time.perf_counter_ns() - started) / loops
    return {"inject_ns": inject_ns, "handling_ns": handling_ns, "call_wrapper_ns": wrapped_ns - bare_ns}


async def counted_off_run(groups: int, receiver: OtlpReceiver) -> dict[str, float]:
    """One ``off`` run with the off path's entry points counted (not timed)."""
    counts = {"inject": 0, "handling": 0, "rollout": 0}
    originals = (tracing.inject, tracing.handling, tracing.rollout)

    def inject(headers: dict[str, str]) -> None:
        counts["inject"] += 1
        originals[0](headers)

    def handling(*args: Any) -> Any:
        counts["handling"] += 1
        return originals[1](*args)

    class Counted:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        async def call(self, kind: str, index: int, work: Any) -> Any:
            counts["rollout"] += 1
            return await self._inner.call(kind, index, work)

    def rollout(*args: Any) -> Any:
        return Counted(originals[2](*args))

    tracing.inject, tracing.handling, tracing.rollout = inject, handling, rollout  # type: ignore[assignment]  # counting wrappers
    try:
        result = await one("off", groups, receiver)
    finally:
        tracing.inject, tracing.handling, tracing.rollout = originals  # type: ignore[assignment]  # restored
    return {**result, **{f"{k}_calls": float(v) for k, v in counts.items()}}


async def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--groups", type=int, default=8, help="prompt groups of 3 rollouts per run")
    add_quick(p, "1 round of 2 groups")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.groups = 1, 2
    began = machine()
    receiver = OtlpReceiver().start()
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    try:
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                runs[variant].append(await one(variant, args.groups, receiver))
                print(f"round {r + 1} {variant}: {runs[variant][-1]}", flush=True)
        counted = await counted_off_run(args.groups, receiver)
        per_call = await off_path_ns()
    finally:
        receiver.stop()
    off_path_s = (
        counted["inject_calls"] * per_call["inject_ns"]
        + counted["handling_calls"] * per_call["handling_ns"]
        + counted["rollout_calls"] * per_call["call_wrapper_ns"]
    ) / 1e9
    off_share = off_path_s / counted["wall_s"]
    medians = {v: {k: statistics.median(run[k] for run in runs[v]) for k in runs[v][0]} for v in VARIANTS}
    ratios = {
        v: {k: round(medians[v][k] / medians["off"][k], 3) if medians["off"][k] else None for k in medians[v]}
        for v in VARIANTS
    }
    write_record(
        "tracing_overhead",
        "tracing_overhead",
        began,
        args,
        {
            "runs": runs,
            "medians": medians,
            "ratios_to_off": ratios,
            "off_path": {"per_call_ns": per_call, "counted_run": counted, "share_of_wall": off_share},
        },
        spans_received=len(receiver.snapshot()),
    )
    rows = [
        (
            v,
            f"{medians[v]['rollouts_per_s']:.1f}",
            f"{ratios[v]['rollouts_per_s']}",
            f"{medians[v]['pause_p50_ms']:.1f}",
            f"{medians[v]['pause_p95_ms']:.1f}",
            f"{ratios[v]['pause_p95_ms']}",
        )
        for v in VARIANTS
    ]
    print(
        markdown_table(["tracing", "rollouts/s", "ratio", "pause p50 ms", "pause p95 ms", "p95 ratio"], rows)
    )
    print(f"spans received over OTLP: {len(receiver.snapshot())}")
    print(
        "off path: inject {inject_ns:.0f} ns, handling {handling_ns:.0f} ns, call wrapper {call_wrapper_ns:.0f} ns"
        " per call".format(**per_call)
    )
    print(
        f"one off run: {counted['handling_calls']:.0f} deliveries, {counted['inject_calls']:.0f} envelopes,"
        f" {counted['rollout_calls']:.0f} wrapped calls in {counted['wall_s']:.2f} s:"
        f" the off path is {100 * off_share:.3f}% of its wall time"
    )


if __name__ == "__main__":
    asyncio.run(main())
